"""Checkpoint index logic: which tensors a layer range needs, and which file holds each.

A snapshot is an HF-layout folder holding ``config.json`` and either a single
``model.safetensors`` or ``model.safetensors.index.json`` + shards. Tensors are always
selected by *name* through the index: one layer often straddles two files.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from meshnet_common.errors import ModelError, UnsupportedArchitecture
from meshnet_common.layers import LayerRange
from meshnet_common.models import MAX_DIM, MAX_LAYERS, MAX_NUMEL, MAX_TENSORS, check_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# llama.cpp's split files: NAME-00001-of-00003.gguf ...
_GGUF_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")

# Files a node needs besides weights (those that exist are used).
AUXILIARY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


@dataclass(frozen=True)
class CheckpointNaming:
    """How one model family names its tensors in a checkpoint."""

    layer_prefix: str  # followed by "<i>."
    head_prefixes: tuple[str, ...]  # embeddings (and learned positions)
    tail_prefixes: tuple[str, ...]  # final norm and lm_head
    tied_embedding: str  # the tensor lm_head reuses when embeddings are tied


_DECODER = CheckpointNaming(
    layer_prefix="model.layers.",
    head_prefixes=("model.embed_tokens.",),
    tail_prefixes=("model.norm.", "lm_head."),
    tied_embedding="model.embed_tokens.weight",
)
_GPT2 = CheckpointNaming(
    layer_prefix="transformer.h.",
    head_prefixes=("transformer.wte.", "transformer.wpe."),
    tail_prefixes=("transformer.ln_f.", "lm_head."),
    tied_embedding="transformer.wte.weight",
)

# architecture (config.json "architectures"[0]) -> naming
NAMING_BY_ARCHITECTURE: dict[str, CheckpointNaming] = {
    "LlamaForCausalLM": _DECODER,
    "MistralForCausalLM": _DECODER,
    "Qwen2ForCausalLM": _DECODER,
    "Qwen3ForCausalLM": _DECODER,
    "GPT2LMHeadModel": _GPT2,
    "Gemma2ForCausalLM": _DECODER,
    "Gemma3ForCausalLM": _DECODER,
    "Phi3ForCausalLM": _DECODER,
    "MixtralForCausalLM": _DECODER,
    "Qwen2MoeForCausalLM": _DECODER,
    "Qwen3MoeForCausalLM": _DECODER,
    "DeepseekV3ForCausalLM": _DECODER,
    "Glm4MoeForCausalLM": _DECODER,
    "GptOssForCausalLM": _DECODER,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(NAMING_BY_ARCHITECTURE))

# The safetensors dtypes of whole bytes (its sub-byte F4 / F6 are not read).
_SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "U16": 2, "U32": 4, "U64": 8, "C64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "F8_E8M0": 1,
}  # fmt: skip
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
_MAX_JSON = 64 * 1024 * 1024  # config.json, model.safetensors.index.json (DeepSeek-V3's: 9 MB)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's place in a checkpoint."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # absolute byte offset of the tensor's data in its file


def read_config(snapshot: Path) -> dict:
    """Read ``config.json``; raise ModelError naming the path when missing or corrupt."""
    path = Path(snapshot) / "config.json"
    try:
        config = _read_json(path)
    except FileNotFoundError as exc:
        raise ModelError(f"{path}: no config.json in snapshot") from exc
    if not isinstance(config, dict):
        raise ModelError(f"{path}: config must be a JSON object")
    return config


def architecture_of(config: dict, where: Path | str = "config.json") -> str:
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in NAMING_BY_ARCHITECTURE:
        raise UnsupportedArchitecture(
            f"{where}: unsupported architecture {arch!r}; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return arch


def _read_json(path: Path, limit: int = _MAX_JSON):
    """A JSON file of at most ``limit`` bytes; ModelError naming it when unreadable or
    malformed (FileNotFoundError passes through)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(limit + 1)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ModelError(f"{path}: unreadable ({exc})") from exc
    if len(raw) > limit:
        raise ModelError(f"{path}: larger than {limit} bytes")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise ModelError(f"{path}: malformed JSON ({type(exc).__name__}: {str(exc)[:80]})") from exc


def num_layers_of(config: dict) -> int:
    n = config.get("num_hidden_layers", config.get("n_layer"))
    if type(n) is not int or not 0 < n <= MAX_LAYERS:
        raise ModelError(f"config has no num_hidden_layers / n_layer in [1, {MAX_LAYERS}]")
    return n


def _read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """A safetensors file's tensors, its header checked without touching tensor data:
    name -> (dtype, shape, nbytes, absolute offset of its bytes). ModelError naming the file
    for any defect (not JSON, not an object, an unknown dtype, a negative or huge shape,
    offsets that disagree with it or lie past the end of the file)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) != 8:
                raise ModelError(f"{path}: truncated safetensors file")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(_MAX_HEADER, size - 8):
                raise ModelError(f"{path}: implausible safetensors header size {header_len}")
            raw = fh.read(header_len)
    except OSError as exc:
        raise ModelError(f"{path}: unreadable weights file ({exc})") from exc
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise ModelError(f"{path}: corrupt safetensors header ({type(exc).__name__})") from exc
    if not isinstance(header, dict):
        raise ModelError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    base = 8 + header_len
    return {name: _safetensors_entry(path, name, meta, base, size) for name, meta in header.items()}


def _safetensors_entry(path: Path, name: str, meta, base: int, size: int):
    if not isinstance(meta, dict):
        raise ModelError(f"{path}: tensor {name[:80]!r} is not described by an object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _SAFETENSORS_DTYPE_BYTES:
        raise ModelError(
            f"{path}: tensor {name[:80]!r} has dtype {str(dtype)[:20]!r}, not one read"
        )
    if not (isinstance(shape, list) and len(shape) <= 8
            and all(type(d) is int and 0 < d <= MAX_DIM for d in shape)):  # fmt: skip
        raise ModelError(f"{path}: tensor {name[:80]!r} has shape {str(shape)[:40]}")
    numel = 1
    for d in shape:
        numel *= d
    if numel > MAX_NUMEL:
        raise ModelError(f"{path}: tensor {name[:80]!r} has {numel} values, more than {MAX_NUMEL}")
    nbytes = numel * _SAFETENSORS_DTYPE_BYTES[dtype]
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):  # fmt: skip
        raise ModelError(f"{path}: tensor {name[:80]!r} has data_offsets {str(offsets)[:40]}")
    begin, end = offsets
    if end - begin != nbytes:
        raise ModelError(f"{path}: tensor {name[:80]!r} has {end - begin} bytes, expected {nbytes}")
    if base + end > size:
        raise ModelError(f"{path}: tensor {name[:80]!r} lies past the end of the file")
    return dtype, tuple(shape), nbytes, base + begin


def _weight_files(root: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of a snapshot, and its index's weight map (None: one file)."""
    index_path = root / INDEX_FILE
    if not index_path.exists():
        if (root / SINGLE_FILE).exists():
            return [SINGLE_FILE], None
        raise ModelError(f"{root}: no {INDEX_FILE} or {SINGLE_FILE}")
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or len(weight_map) > MAX_TENSORS:
        raise ModelError(f"{index_path}: empty or malformed weight_map")
    if not all(isinstance(f, str) for f in weight_map.values()):
        raise ModelError(f"{index_path}: a weight_map value is not a file name")
    files = sorted(set(weight_map.values()))
    for fname in files:
        # Lexical check, not resolve(): hub-cache snapshot files are symlinks to ../../blobs.
        if PurePosixPath(fname).is_absolute() or ".." in PurePosixPath(fname).parts:
            raise ModelError(f"{index_path}: file {fname!r} escapes the snapshot")
    return files, weight_map


def gguf_in(folder: Path) -> Path | None:
    """The GGUF of a model folder (``ORG/NAME/FILE.gguf``, or the first file of one llama.cpp
    split set: the index reads them all); None when it holds none; ModelError for files of
    several models."""
    try:
        found = sorted(p for p in folder.iterdir() if p.suffix == ".gguf" and p.is_file())
    except OSError:
        return None
    if not found:
        return None
    sets = {_GGUF_SPLIT.sub("", p.name) if _GGUF_SPLIT.search(p.name) else p.name for p in found}
    if len(sets) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelError(f"{folder}: several GGUF files ({names}); keep one model per folder")
    return found[0]  # the only file, or the split set's first (-00001-of-)


@dataclass
class CheckpointIndex:
    """Name -> file/shape/dtype map of every tensor in a snapshot, plus its config."""

    root: Path
    config: dict
    architecture: str
    num_layers: int
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    gguf: Any = None  # a GGUF file's ``GgufSource`` (``gguf_index``); None: safetensors

    @property
    def naming(self) -> CheckpointNaming:
        return NAMING_BY_ARCHITECTURE[self.architecture]

    @property
    def tied_embeddings(self) -> bool:
        if self.architecture == "GPT2LMHeadModel":
            return True
        return bool(self.config.get("tie_word_embeddings", False)) or "lm_head.weight" not in (
            self.tensors
        )

    @classmethod
    def load(cls, snapshot: Path | str) -> CheckpointIndex:
        """Index a snapshot folder, or a GGUF file. Raises ModelError naming the path on
        any defect: one line, whatever a crafted file holds (``check_config``'s maxima)."""
        root = Path(snapshot)
        try:
            index = cls._load(root)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
            # A defect no check above names: still one line naming the file, never a traceback.
            raise ModelError(f"{root}: malformed model ({type(exc).__name__}: {exc})") from exc
        check_config(index.config, root)
        return index

    @classmethod
    def _load(cls, root: Path) -> CheckpointIndex:
        if root.is_dir() and not (root / "config.json").exists():
            root = gguf_in(root) or root  # a folder holding one GGUF (and no config.json)
        if root.suffix == ".gguf" and root.is_file():
            from meshnet_common.models.gguf_index import read_gguf_index

            gguf = read_gguf_index(root)
            return cls(
                root=gguf.root, config=gguf.config, architecture=gguf.architecture,
                num_layers=gguf.num_layers, gguf=gguf.source,
                tensors={name: TensorInfo(*t) for name, t in gguf.tensors.items()},
            )  # fmt: skip
        if not root.is_dir():
            raise ModelError(f"{root}: not a directory")
        config = read_config(root)
        arch = architecture_of(config, root / "config.json")
        try:
            num_layers = num_layers_of(config)
        except ModelError as exc:
            raise ModelError(f"{root / 'config.json'}: {exc}") from exc
        files, weight_map = _weight_files(root)
        tensors: dict[str, TensorInfo] = {}
        for fname in files:
            fpath = root / fname
            if not fpath.exists():
                raise ModelError(f"{fpath}: listed in the index but missing")
            for name, (dtype, shape, nbytes, offset) in _read_safetensors_header(fpath).items():
                tensors[name] = TensorInfo(name, fname, dtype, shape, nbytes, offset)
            if len(tensors) > MAX_TENSORS:
                raise ModelError(f"{root}: more than {MAX_TENSORS} tensors")
        if weight_map is not None:
            missing = [n for n, f in weight_map.items() if tensors.get(n) is None]
            if missing:
                raise ModelError(
                    f"{root / INDEX_FILE}: tensors listed but absent from files: {missing[:3]}"
                )
        return cls(
            root=root, config=config, architecture=arch, num_layers=num_layers, tensors=tensors
        )

    def layer_of(self, name: str) -> int | None:
        """Decoder layer index a tensor belongs to, or None for non-layer tensors."""
        prefix = self.naming.layer_prefix
        if not name.startswith(prefix):
            return None
        match = re.match(r"(\d+)\.", name[len(prefix) :])
        return int(match.group(1)) if match else None

    def tensors_for(self, layers: LayerRange) -> list[str]:
        """Names of every tensor a node serving ``layers`` must hold, in checkpoint order."""
        layers.check_within(self.num_layers)
        naming = self.naming
        wanted: list[str] = []
        for name in self.tensors:
            layer = self.layer_of(name)
            if layer is not None:
                if layer in layers:
                    wanted.append(name)
            elif (
                layers.is_head()
                and name.startswith(naming.head_prefixes)
                or layers.is_tail(self.num_layers)
                and name.startswith(naming.tail_prefixes)
            ):
                wanted.append(name)
        if (
            layers.is_tail(self.num_layers)
            and self.tied_embeddings
            and naming.tied_embedding in self.tensors
            and naming.tied_embedding not in wanted
        ):
            wanted.append(naming.tied_embedding)
        return wanted

    def files_for(self, layers: LayerRange) -> list[str]:
        """Weight files holding at least one tensor of ``layers``."""
        return sorted({self.tensors[n].file for n in self.tensors_for(layers)})

    def bytes_for(self, layers: LayerRange) -> int:
        """Bytes of the checkpoint's tensors for ``layers`` (at the checkpoint's dtype)."""
        return sum(self.tensors[n].nbytes for n in self.tensors_for(layers))

    def auxiliary_files(self) -> list[str]:
        """Config/tokenizer/generation files present in the snapshot."""
        return [f for f in AUXILIARY_FILES if (self.root / f).exists()]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def dtype(self) -> str:
        """The dominant tensor dtype (by bytes), e.g. ``BF16``."""
        by_dtype: dict[str, int] = {}
        for t in self.tensors.values():
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "unknown"

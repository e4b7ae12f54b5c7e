"""The header of a GGUF file, read without the ``gguf`` package: metadata scalars and strings,
the length of every array, and each tensor's name, ggml type, shape and byte range.

Hand-written on purpose (docs/adr/0033): the ``gguf`` package's reader materializes every
metadata array as Python objects (a vocabulary and its merges: ~142 MB of heap while it
lives for SmolLM2's 98 MB file, 15 MB never given back), which a node would carry in its
resident memory and a tracker could not import (it has no numpy). Arrays are skipped here,
keeping only their length; a head reads the tokenizer through transformers.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64, metadata
count u64; each metadata entry a string key, a u32 value type and the value (strings: u64
length + bytes; arrays: u32 element type, u64 count, elements); then per tensor a string
name, u32 dims, u64 per dim (innermost first), u32 ggml type, u64 offset; then the data,
aligned to ``general.alignment`` (32 by default), offsets relative to its start.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from meshnet_common.errors import ModelError
from meshnet_common.models import MAX_DIM, MAX_NUMEL, MAX_TENSORS, MAX_VOCAB

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
# ggml type id -> (name, weights per block, bytes per block): the types a node can read
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136),
    30: ("BF16", 1, 2),
}  # fmt: skip
# What a header may state (a crafted file is refused in one line, not trusted to size a
# loop): a string value (a chat template) up to 16 MB, a key or a tensor name up to 1 KB
# (llama.cpp's are under 64 bytes), an array (a vocabulary, its merges) up to 16M items,
# 64K metadata entries, ggml's 4 dimensions, and an alignment a power of two up to 64 KB.
_MAX_STRING = 1 << 24
_MAX_NAME = 1 << 10
_MAX_ARRAY = MAX_VOCAB
_MAX_ENTRIES = 1 << 16
_MAX_DIMS = 4
_MAX_ALIGNMENT = 1 << 16


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array, skipped: its element type and length."""

    element_type: int
    count: int


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type_name: str
    dims: tuple[int, ...]  # ggml order: innermost first
    offset: int  # absolute byte offset in the file
    nbytes: int
    type_id: int = 0  # the ggml type's number, as the file stores it


@dataclass(frozen=True)
class GgufHeader:
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GgufTensor, ...]
    # where the metadata entries' bytes lie ([start, end) of the file), and the data
    # section's alignment: what a subset of the file copies (``gguf_subset``)
    metadata_span: tuple[int, int] = (0, 0)
    alignment: int = DEFAULT_ALIGNMENT


class _Reader:
    def __init__(self, fh: BinaryIO, path: Path, size: int) -> None:
        self.fh, self.path, self.size = fh, path, size

    def truncated(self) -> ModelError:
        return ModelError(f"{self.path}: truncated GGUF header")

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        raw = self.fh.read(size)
        if len(raw) != size:
            raise self.truncated()
        return struct.unpack(fmt, raw)[0]

    def skip(self, length: int) -> None:
        if self.fh.tell() + length > self.size:  # a seek past the end would not fail
            raise self.truncated()
        self.fh.seek(length, 1)

    def string(self, skip: bool = False, limit: int = _MAX_STRING) -> str | None:
        length = self.unpack("<Q")
        if length > limit:
            raise ModelError(f"{self.path}: implausible string length {length} in GGUF header")
        if skip:
            self.skip(length)
            return None
        raw = self.fh.read(length)
        if len(raw) != length:
            raise self.truncated()
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            element, count = self.unpack("<I"), self.unpack("<Q")
            if count > _MAX_ARRAY:
                raise ModelError(f"{self.path}: implausible array length {count}")
            if element == _STRING:
                for _ in range(count):
                    self.string(skip=True)
            elif element in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[element]))
            else:
                raise ModelError(f"{self.path}: GGUF array of value type {element}")
            return ArrayInfo(element, count)
        if kind not in _SCALARS:
            raise ModelError(f"{self.path}: unknown GGUF value type {kind}")
        return self.unpack(_SCALARS[kind])


def read_header(path: Path | str) -> GgufHeader:
    """The header of the GGUF at ``path``; ModelError naming the path on any defect."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return _read(_Reader(fh, path, path.stat().st_size))
    except OSError as exc:
        raise ModelError(f"{path}: unreadable GGUF ({exc})") from exc


def _read(r: _Reader) -> GgufHeader:
    if r.fh.read(4) != MAGIC:
        raise ModelError(f"{r.path}: not a GGUF file (no GGUF magic)")
    version = r.unpack("<I")
    if version not in (2, 3):
        raise ModelError(f"{r.path}: GGUF version {version}; versions 2 and 3 are read")
    n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
    if n_tensors > MAX_TENSORS or n_kv > _MAX_ENTRIES:
        raise ModelError(f"{r.path}: implausible GGUF counts ({n_tensors}, {n_kv})")
    metadata: dict[str, Any] = {}
    metadata_start = r.fh.tell()
    for _ in range(n_kv):
        key = r.string(limit=_MAX_NAME)
        if key in metadata:
            raise ModelError(f"{r.path}: GGUF metadata key {key!r} appears twice")
        metadata[key] = r.value(r.unpack("<I"))
    metadata_end = r.fh.tell()
    infos = []
    for _ in range(n_tensors):
        name = r.string(limit=_MAX_NAME)
        n_dims = r.unpack("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelError(f"{r.path}: tensor {name!r} has {n_dims} dimensions")
        dims = tuple(r.unpack("<Q") for _ in range(n_dims))
        infos.append((name, dims, r.unpack("<I"), r.unpack("<Q")))
    alignment = _alignment(metadata, r.path)
    data_start = -(-r.fh.tell() // alignment) * alignment
    tensors, names = [], set()
    for name, dims, kind, offset in infos:
        if name in names:
            raise ModelError(f"{r.path}: tensor {name!r} appears twice")
        names.add(name)
        nbytes = _nbytes(r.path, name, dims, kind)
        if offset % alignment:
            raise ModelError(f"{r.path}: tensor {name!r} is not aligned to {alignment} bytes")
        start = data_start + offset
        if start + nbytes > r.size:
            raise ModelError(f"{r.path}: tensor {name!r} lies past the end of the file")
        tensors.append(GgufTensor(name, GGML_TYPES[kind][0], dims, start, nbytes, kind))
    return GgufHeader(version, metadata, tuple(tensors), (metadata_start, metadata_end), alignment)


def _alignment(metadata: dict[str, Any], path: Path) -> int:
    """``general.alignment``: a power of two up to 64 KB (as llama.cpp checks it)."""
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        type(alignment) is not int
        or not 0 < alignment <= _MAX_ALIGNMENT
        or alignment & (alignment - 1)
    ):
        raise ModelError(
            f"{path}: general.alignment {alignment!r} is not a power of two up to {_MAX_ALIGNMENT}"
        )
    return alignment


def _nbytes(path: Path, name: str, dims: tuple[int, ...], kind: int) -> int:
    """The bytes of a tensor of ``dims`` in ggml type ``kind``; ModelError for an empty or
    implausibly large tensor, or rows that are not whole blocks."""
    if kind not in GGML_TYPES:
        raise ModelError(f"{path}: tensor {name!r} has ggml type {kind}, not one nodes read")
    type_name, weights, size = GGML_TYPES[kind]
    numel = 1
    for d in dims:
        if not 0 < d <= MAX_DIM:
            raise ModelError(f"{path}: tensor {name!r} has dimensions {list(dims)}")
        numel *= d
    if numel > MAX_NUMEL:
        raise ModelError(f"{path}: tensor {name!r} has {numel} values, more than {MAX_NUMEL}")
    if dims[0] % weights:
        raise ModelError(f"{path}: tensor {name!r} rows are not whole {type_name} blocks")
    return numel // weights * size

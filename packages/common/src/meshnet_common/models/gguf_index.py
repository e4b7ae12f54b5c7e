"""A GGUF file as a checkpoint: its tensors under the names of the HF family, by layer.

llama.cpp's GGUF holds config, tokenizer and every tensor in one file (or a split set of
files), tensors named ``blk.N.attn_q.weight`` and stored in ggml's block formats. The index
maps each to the HF name of the same weight (``model.layers.N.self_attn.q_proj.weight``) with
its HF shape ``[out, in]``, its ggml type as the dtype (``Q4_1``, ``F32``, ...), and where its
bytes lie in the file, so everything that selects tensors by layer range (the loader, memory
pricing, subset serving) works on a GGUF as on a safetensors snapshot.

The config comes from the file's metadata (the keys transformers' own table reads, without
importing transformers: the tracker has none); the families are those whose GGUF tensors
map one to one onto HF tensors: Llama (and Mistral, which llama.cpp writes as ``llama``), Qwen2,
Qwen3, Qwen2-MoE, Qwen3-MoE, Gemma 2 and Gemma 3 (text).
llama.cpp permutes the rows of Llama's query and key projections for its rotary layout;
``row_permutation`` names the heads to undo it with (transformers undoes it the same way).
Its Gemma converter stores every RMSNorm weight as ``w + 1`` (HF's Gemma norms compute
``x * (1 + w)``, llama.cpp's ``x * w``); ``value_shift`` names them, and the reader subtracts 1
as transformers' own GGUF reader does. What llama.cpp hard-codes for Gemma rather than
writing it (the sliding/global layer pattern, Gemma 3's local rope base, the query scale)
is put back in the config as llama.cpp computes it (``_gemma_config``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from meshnet_common.errors import ModelError
from meshnet_common.models import (
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_TENSORS,
    MAX_VOCAB,
    bounded,
    check_config,
)
from meshnet_common.models.gguf_header import ArrayInfo, read_header

GGUF_SUFFIX = ".gguf"

# general.architecture -> the HF class of the same model, and its HF model_type
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
}  # fmt: skip
MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
# llama.cpp's qwen3moe always renormalizes the chosen experts' weights; qwen2moe never does
_NORM_TOP_K = {"qwen2moe": False, "qwen3moe": True}
# Architectures whose q/k rows llama.cpp's converter permuted.
_PERMUTED = {"llama"}

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE: the router, a shared expert and its gate (Qwen2-MoE)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 2/3's four norms per layer: llama.cpp's ffn_norm is the pre-MLP norm there, and the
# norms after attention and after the MLP are their own tensors (llama.cpp's names).
_GEMMA = {"gemma2", "gemma3"}
_GEMMA_LAYER = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's sliding-window period when the file does not say (``set_swa_pattern``: layer
# i is local unless i % n == n - 1), and the layer counts of the 27B models, whose query
# scale is hidden / heads rather than the head width.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# A layer's routed experts, stacked [experts, out, in] in one GGUF tensor: listed in the
# index expert by expert (``mlp.experts.E.gate_proj.weight``), each a slice of its bytes.
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)$")
# GGUF metadata key (after "<arch>.") -> HF config field, for the families above: the keys
# transformers' own table (``transformers.integrations.ggml``) reads, plus ``key_length``
# (Qwen3's heads may be wider than hidden / heads). Kept here so the tracker, which has no
# transformers, reads a GGUF's shape too.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
# Tensors llama.cpp adds that the HF model computes itself (Llama 3's rope frequencies).
_DERIVED = ("rope_freqs.weight",)


@dataclass(frozen=True)
class GgufSource:
    """Where an index's tensors come from in a GGUF: the file, each HF name's GGUF name, and
    the heads whose rows to un-permute (HF name -> heads), and what to subtract from the
    values of those a converter shifted (Gemma's norms: 1)."""

    file: str  # the file (of split files: the first, which holds the metadata)
    names: dict[str, str] = field(default_factory=dict)
    row_permutation: dict[str, int] = field(default_factory=dict)
    value_shift: dict[str, float] = field(default_factory=dict)


def is_gguf(path: Path | str) -> bool:
    return Path(path).suffix == GGUF_SUFFIX and Path(path).is_file()


def pretrained_args(model_path: Path | str) -> tuple[Path, dict]:
    """What transformers' ``from_pretrained`` takes for a model path: a snapshot folder as it
    is, a GGUF file as its folder and ``gguf_file`` (tokenizer and chat template come from
    the file's metadata)."""
    path = Path(model_path)
    if is_gguf(path):
        return path.parent, {"gguf_file": path.name}
    return path, {}


def _layer_table(arch: str) -> dict[str, str]:
    return {**_IN_LAYER, **_GEMMA_LAYER} if arch in _GEMMA else _IN_LAYER


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF tensor name of a GGUF tensor of the supported families (None: not known)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _LAYER_TENSOR.match(gguf_name)
    table = _layer_table(arch)
    if m is None or m["part"] not in table:
        return None
    return f"model.layers.{m['layer']}.{table[m['part']]}.{m['kind']}"


def gguf_names(num_layers: int = 1024, arch: str = "llama") -> dict[str, str]:
    """HF name -> GGUF name for every tensor the table knows (writers of test files)."""
    names = {hf: g for g, hf in _GLOBAL.items()}
    for layer in range(num_layers):
        for part, hf_part in _layer_table(arch).items():
            for kind in ("weight", "bias"):
                names[f"model.layers.{layer}.{hf_part}.{kind}"] = f"blk.{layer}.{part}.{kind}"
    return names


def gguf_config(
    meta: dict, path: Path, tensor_names: set[str], vocab_rows: int | None = None
) -> dict:
    """The HF config of a GGUF from its metadata (``_CONFIG_KEYS``, as transformers' table);
    ``vocab_rows``: the token embedding's rows, the vocabulary the model computes (llama.cpp's
    Gemma 3 converter cuts the embedding to the tokenizer's tokens and writes no vocab size)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(
            f"{path}: GGUF architecture {arch!r} is not served from GGUF yet; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    config: dict = {"model_type": MODEL_TYPES.get(arch, arch), "architectures": [ARCHITECTURES[arch]]}  # fmt: skip
    for suffix, key in _CONFIG_KEYS.items():
        value = meta.get(f"{arch}.{suffix}")
        if value is not None:
            config[key] = value
    if vocab_rows is not None:
        config["vocab_size"] = vocab_rows
    elif "vocab_size" not in config and isinstance(meta.get("tokenizer.ggml.tokens"), ArrayInfo):
        config["vocab_size"] = meta["tokenizer.ggml.tokens"].count
    for token in ("bos", "padding"):
        value = meta.get(f"tokenizer.ggml.{token}_token_id")
        if value is not None:
            config["pad_token_id" if token == "padding" else f"{token}_token_id"] = value
    # What ends a generation: end of text, and the end of a turn or message where the file
    # names them (more are found by their text: ``head.generation.gguf_end_ids``)
    ends = [meta.get(f"tokenizer.ggml.{token}_token_id") for token in ("eos", "eot", "eom")]
    ends = list(dict.fromkeys(value for value in ends if value is not None))
    if ends:
        config["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    if "head_dim" not in config and meta.get(f"{arch}.rope.dimension_count"):
        config["head_dim"] = meta[f"{arch}.rope.dimension_count"]
    keys = {hf: f"{arch}.{suffix}" for suffix, hf in _CONFIG_KEYS.items()}
    keys["vocab_size"] = "the token embedding's rows" if vocab_rows else keys["vocab_size"]
    check_config(config, path, keys)  # the numbers below size lists and divide
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):
        values = config.get(token)
        for value in values if isinstance(values, list) else () if values is None else (values,):
            bounded(value, 0, MAX_VOCAB, f"{path}: {token}")
    if arch in _GEMMA:
        _gemma_config(config, meta, arch, path)
    if arch in _NORM_TOP_K:  # a layer without routed experts is dense (by its tensors)
        sparse = {int(m["layer"]) for n in tensor_names
                  if (m := _LAYER_TENSOR.match(n)) and m["part"] in _EXPERTS}  # fmt: skip
        config["norm_topk_prob"] = _NORM_TOP_K[arch]
        config["decoder_sparse_step"] = 1
        config["mlp_only_layers"] = sorted(set(range(config["num_hidden_layers"])) - sparse)
    return config


def _gemma_config(config: dict, meta: dict, arch: str, path: Path) -> None:
    """What llama.cpp computes for Gemma 2/3 rather than reading it from the file: which
    layers are local (every ``n``-th global: the file's ``attention.sliding_window_pattern``
    or llama.cpp's 2 / 6; no window, all global), the query scale (``head_dim``; 27B:
    hidden / heads), the soft-caps (Gemma 2: 50 / 30 when absent; Gemma 3: none) and Gemma 3's
    local rope base (10000) and linear rope scaling of its global layers."""
    layers, window = config["num_hidden_layers"], config.get("sliding_window")
    key = f"{arch}.attention.sliding_window_pattern"
    n = meta.get(key) or _SWA_PATTERN[arch]
    if isinstance(n, ArrayInfo):  # (newer converters write a flag per layer for other models)
        raise ModelError(f"{path}: a per-layer {key} is not read yet")
    n = bounded(n, 1, MAX_LAYERS, f"{path}: {key}")
    config["layer_types"] = [
        "sliding_attention" if window and i % n < n - 1 else "full_attention"
        for i in range(layers)
    ]  # fmt: skip
    config.setdefault("sliding_window", None)  # none in the file: every layer global
    big = layers == _GEMMA_27B_LAYERS[arch]
    heads = config["num_attention_heads"]
    config["query_pre_attn_scalar"] = config["hidden_size"] // heads if big else config["head_dim"]  # fmt: skip
    if arch == "gemma2":
        config.setdefault("attn_logit_softcapping", 50.0)
        config.setdefault("final_logit_softcapping", 30.0)
        return
    config.setdefault("attn_logit_softcapping", None)
    config.setdefault("final_logit_softcapping", None)
    config["rope_local_base_freq"] = 10000.0
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if type(factor) not in (int, float) or not factor > 0:
            raise ModelError(
                f"{path}: {arch}.rope.scaling.factor {factor!r} is not a positive number"
            )
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}


# ggml types of a layer's weights -> the runtime precision ``auto`` serves them in, by the type
# holding most bytes: 4-bit and lower blocks as int4, 5- to 8-bit blocks as int8, float
# tensors at the compute dtype; a mix takes its majority's (Q4_K_M / Q4_K_S int4, Q5_K_M /
# Q5_K_S and Q6_K int8). Whatever the node's precision, Q4_0/Q4_1/Q4_K stay int4 as they are
# (``GGUF_INT4_BLOCKS``) and Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 keep their values (``KEPT_BLOCKS``: int8
# codes with a scale, and a zero, per block), docs/adr/0049: only Q2_K/Q3_K/IQ* are rounded.
# ggml type -> weights per scale, as held (and, for Q5_1 / Q5_K, per zero)
KEPT_BLOCKS = {"Q8_0": 32, "Q6_K": 16, "Q5_0": 32, "Q5_1": 32, "Q5_K": 32}
KEPT_ZEROS = ("Q5_1", "Q5_K")  # W = q * d + z: a float32 zero per block too
GGUF_INT4_BLOCKS = ("Q4_0", "Q4_1", "Q4_K")  # held as int4 as they are, at int8 too
_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS")
_FLOAT_TYPES = ("F32", "F16", "BF16")


def runtime_of(tensors: dict) -> str | None:
    """``int4``, ``int8`` or None (float): what ``--quantization auto`` serves a GGUF in,
    by the type holding most bytes of its layers' matrices."""
    by_type: dict[str, int] = {}
    for t in tensors.values():
        if t.name.startswith("model.layers.") and len(t.shape) == 2:
            by_type[t.dtype] = by_type.get(t.dtype, 0) + t.nbytes
    if not by_type:
        return None
    top = max(by_type, key=by_type.__getitem__)
    return None if top in _FLOAT_TYPES else "int4" if top in _INT4_TYPES else "int8"


_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_files(path: Path) -> list[Path]:
    """``path`` alone, or every file of the llama.cpp split set it belongs to, in order
    (``NAME-00001-of-00003.gguf`` ...); ModelError when one is missing."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    files = [
        path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelError(f"{path.parent}: split GGUF file(s) missing: {', '.join(missing)}")
    return files


class GgufTensor(NamedTuple):
    """One tensor of a GGUF under its HF name: the fields of ``checkpoint.TensorInfo``."""

    name: str
    file: str
    dtype: str  # the ggml type's name
    shape: tuple[int, ...]  # HF order, [out, in]
    nbytes: int
    offset: int


class GgufIndex(NamedTuple):
    """What a GGUF holds, as a ``CheckpointIndex`` has it (``CheckpointIndex.load`` makes
    one of it)."""

    root: Path
    config: dict
    architecture: str  # the HF class
    num_layers: int
    tensors: dict[str, GgufTensor]
    source: GgufSource


def read_gguf_index(path: Path | str) -> GgufIndex:
    """The index of one GGUF file, or of a llama.cpp split set (any of its files: the first
    holds the metadata, each its own tensors). ModelError naming the path on any defect."""
    files = split_files(Path(path))
    path = files[0]
    headers = [read_header(f) for f in files]
    header = headers[0]
    meta = header.metadata
    split_count = meta.get("split.count")
    if split_count is not None and len(files) > 1 and split_count != len(files):
        raise ModelError(f"{path}: split.count {split_count}, but {len(files)} file(s) found")
    placed = [(f.name, t) for f, h in zip(files, headers, strict=True) for t in h.tensors]
    embedding = [t.dims[-1] for _, t in placed if t.name == "token_embd.weight"]
    config = gguf_config(meta, path, {t.name for _, t in placed}, next(iter(embedding), None))
    arch = meta["general.architecture"]
    source = GgufSource(file=path.name)
    tensors: dict[str, GgufTensor] = {}
    for file, t in placed:
        if len(tensors) > MAX_TENSORS:  # a GGUF's experts are listed one by one
            raise ModelError(f"{path}: more than {MAX_TENSORS} tensors")
        m = _LAYER_TENSOR.match(t.name)
        if m is not None and m["part"] in _EXPERTS:
            prefix = f"model.layers.{m['layer']}.mlp.experts"
            _list_experts(tensors, source, t, file, prefix, path)
            continue
        name = hf_name(t.name, arch)
        if name is None:
            if t.name in _DERIVED:
                continue
            raise ModelError(f"{path}: GGUF tensor {t.name!r} has no place in {arch}")
        shape = tuple(reversed(t.dims))  # ggml lists the innermost dimension first
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, *shape)  # Qwen2-MoE's [1, hidden] gate, written as a vector
        tensors[name] = GgufTensor(name, file, t.type_name, shape, t.nbytes, t.offset)
        source.names[name] = t.name
        if arch in _GEMMA and t.name.endswith("norm.weight"):
            source.value_shift[name] = 1.0  # llama.cpp stored 1 + w
        if arch in _PERMUTED and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            source.row_permutation[name] = _permuted_heads(config, name, shape, path)
    config["quantization_config"] = {"quant_method": "gguf", "runtime": runtime_of(tensors)}
    return GgufIndex(
        root=path.parent, config=config, architecture=ARCHITECTURES[arch],
        num_layers=int(config["num_hidden_layers"]), tensors=tensors, source=source,
    )  # fmt: skip


def _permuted_heads(config: dict, name: str, shape: tuple[int, ...], path: Path) -> int:
    """The heads whose query (or key) rows llama.cpp interleaved: the config's (key-value
    heads default to the query heads, as llama.cpp reads them), dividing the rows in two
    halves each."""
    heads = config["num_attention_heads"]
    if "k_proj" in name:
        heads = config.get("num_key_value_heads") or heads
    if shape[0] % (2 * heads):
        raise ModelError(f"{path}: {name} has {shape[0]} rows, not two halves of {heads} heads")
    return heads


def _list_experts(tensors: dict, source: GgufSource, t, file: str, prefix: str, path: Path) -> None:
    """Index a stacked experts tensor expert by expert: each a contiguous slice (of whole
    blocks: the header refused empty tensors and rows of partial blocks)."""
    if len(t.dims) != 3 or t.dims[2] > MAX_EXPERTS:
        raise ModelError(f"{path}: experts tensor {t.name!r} has dimensions {list(t.dims)}")
    inner, out, experts = t.dims  # ggml order: [in, out, experts]
    size = t.nbytes // experts
    for e in range(experts):
        name = f"{prefix}.{e}.{_EXPERTS[t.name.split('.')[2]]}.weight"
        tensors[name] = GgufTensor(name, file, t.type_name, (out, inner), size, t.offset + e * size)
        source.names[name] = t.name

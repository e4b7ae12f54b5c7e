"""Write a tiny HF snapshot as a GGUF file, the way llama.cpp's converter lays it out: for
tests of the GGUF source (never a downloaded file).

Layer matrices go to one block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 through the ``gguf``
package's own quantizer; Q4_K, Q5_K and Q6_K through ``pack_q4_k`` / ``pack_q5_k`` /
``pack_q6_k`` here, in ggml's block layouts, which the ``gguf`` package reads but cannot
write) or to a mix of types as llama.cpp's Q4_K_M / Q5_K_M (``MIXES``); norms and
embeddings stay F32 (a mix quantizes the embedding and ``output`` too, and chooses layers
and fallbacks as ``llama-quantize`` does). What llama.cpp's converter transforms, this
does too: Llama's query and key rows interleaved per head (``permute``), Gemma's norms
stored as ``1 + w``; and it writes Gemma's metadata as that converter does (sliding window,
soft-caps), plus ``attention.sliding_window_pattern`` where a tiny model's layer pattern is
not llama.cpp's fixed one (2 for Gemma 2, 6 for Gemma 3).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.gguf_index import ARCHITECTURES, gguf_names

BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
# llama.cpp's K-quant mixes, in outline: the base type, with ``output`` and the value and down
# projections of some layers (``_more_bits``) at Q6_K; the token embedding at the base type
# too. A matrix whose rows are not whole 256s takes llama.cpp's fallback type for the
# K-quant it would have had (``FALLBACK``: SmolLM2's width 576, Gemma 3 1B's 1152).
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_GEMMA = ("gemma2", "gemma3")
_EXPERT = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")  # fmt: skip
_ROUTERS = ("mlp.gate.weight", "shared_expert_gate.weight")


def _k_quants(weight: np.ndarray, levels: int):
    """Q4_K / Q5_K's shared part: per 32 weights a 6-bit scale and minimum relative to the
    super-block's f16 ``d`` and ``dmin``, ``W = d sc q - dmin m`` with ``q`` in
    ``0..levels``. Returns the 4-byte head, ggml's 12 bytes of packed scales, and the codes
    ``[rows, blocks, 8, 32]``."""
    rows, k = weight.shape
    x = weight.reshape(rows, k // 256, 8, 32).astype(np.float32)
    low = np.minimum(x.min(axis=-1), 0.0)  # the offset only lowers: -dmin m <= 0
    scale = (x.max(axis=-1) - low) / levels  # [rows, blocks, 8]
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = ((-low).max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63)
    m = np.clip(np.round(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)), 0, 63)
    step, offset = (d32 * sc)[..., None], (dmin32 * m)[..., None]
    q = np.divide(x + offset, step, out=np.zeros_like(x), where=step > 0)
    q = np.clip(np.round(q), 0, levels).astype(np.uint8)  # [rows, blocks, 8, 32]
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
            (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )  # [rows, blocks, 12], ggml's packing of eight 6-bit pairs
    head = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8)], axis=-1)
    return head.reshape(rows, -1, 4), scales, q


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Codes ``[rows, blocks, 8, 32]`` -> 128 bytes a block: groups 2j and 2j + 1 share 32
    bytes, the first in the low nibbles."""
    rows, blocks = q.shape[:2]
    pairs = (q & 15).reshape(rows, blocks, 4, 2, 32)
    return (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, blocks, 128)


def pack_q4_k(weight: np.ndarray) -> np.ndarray:
    """``[rows, K]`` float32 (K a multiple of 256) -> Q4_K bytes ``[rows, K / 256 * 144]``:
    f16 ``d``, ``dmin``, 12 bytes of 6-bit scales and minimums, 128 bytes of 4-bit codes."""
    head, scales, q = _k_quants(weight, 15)
    return np.concatenate([head, scales, _nibble_pairs(q)], axis=-1).reshape(len(weight), -1)


def pack_q5_k(weight: np.ndarray) -> np.ndarray:
    """``[rows, K]`` -> Q5_K bytes ``[rows, K / 256 * 176]``: Q4_K's head and scales, then
    ``qh`` (32 bytes: bit ``g`` of byte ``l`` is the fifth bit of weight ``l`` of group
    ``g``) and the low four bits as Q4_K's codes; ``W = d sc q - dmin m``, ``q`` in 0..31."""
    head, scales, q = _k_quants(weight, 31)
    high = (q >> 4).astype(np.uint8)  # [rows, blocks, 8, 32]
    qh = np.zeros(high.shape[:2] + (32,), dtype=np.uint8)
    for g in range(8):
        qh |= high[:, :, g] << g
    return np.concatenate([head, scales, qh, _nibble_pairs(q)], axis=-1).reshape(len(weight), -1)


def pack_q6_k(weight: np.ndarray) -> np.ndarray:
    """``[rows, K]`` -> Q6_K bytes ``[rows, K / 256 * 210]``: ``W = d * sc * (q - 32)`` with
    an int8 ``sc`` per 16 weights and an f16 ``d`` per 256; ``ql`` (128 bytes: low four bits),
    ``qh`` (64: high two bits), the 16 scales, ``d``. In each half of 128 weights, 32-weight
    group ``g`` takes ``ql`` byte ``l`` (g 0, 2) or ``32 + l`` (g 1, 3), low nibble for
    g < 2, and bits ``2g, 2g + 1`` of ``qh`` byte ``l``."""
    rows, k = weight.shape
    x = weight.reshape(rows, k // 256, 16, 16).astype(np.float32)
    step = np.abs(x).max(axis=-1) / 31.0  # [rows, blocks, 16]
    d = (step.max(axis=-1) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 127)
    unit = (d32 * sc)[..., None]
    q = np.divide(x, unit, out=np.zeros_like(x), where=unit > 0)
    q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8)  # [rows, blocks, 16, 16]
    g = q.reshape(rows, k // 256, 2, 4, 32)  # halves, groups of 32, l
    ql = np.concatenate(
        [
            (g[:, :, :, 0] & 15) | ((g[:, :, :, 2] & 15) << 4),
            (g[:, :, :, 1] & 15) | ((g[:, :, :, 3] & 15) << 4),
        ],
        axis=-1,
    )  # fmt: skip  [rows, blocks, 2, 64]
    qh = sum((g[:, :, :, j] >> 4) << (2 * j) for j in range(4)).astype(np.uint8)  # [.., 2, 32]
    parts = [
        ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64),
        sc.astype(np.int8).view(np.uint8), d[..., None].view(np.uint8),
    ]  # fmt: skip
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


_PACKERS = {"Q4_K": pack_q4_k, "Q5_K": pack_q5_k, "Q6_K": pack_q6_k}


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves interleaved, row by row."""
    n = weight.shape[0]
    return weight.reshape(heads, 2, n // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers, and every
    third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _matrix_type(fmt: str, gguf_name: str, width: int, layers: int) -> str:
    """The block type of one matrix of rows of ``width``: ``fmt``, or in a ``*_K_M`` mix
    llama.cpp's choice in outline (``output`` and, in ``_more_bits`` layers, the value and
    down projections at Q6_K, the rest at the base; ``FALLBACK`` where the rows are not whole
    256s)."""
    if fmt not in MIXES:
        return fmt
    more = any(p in gguf_name for p in (".attn_v.", ".ffn_down")) and _more_bits(
        int(gguf_name.split(".")[1]), layers
    )
    kind = "Q6_K" if gguf_name == "output.weight" or more else MIXES[fmt]
    return kind if width % 256 == 0 else FALLBACK[kind]


def _blocks(values: np.ndarray, fmt: str) -> np.ndarray:
    """``values`` in block type ``fmt`` along the last axis, any leading ones."""
    import gguf

    flat = values.reshape(-1, values.shape[-1])
    packer = _PACKERS.get(fmt)
    data = packer(flat) if packer else gguf.quants.quantize(flat, gguf.GGMLQuantizationType[fmt])
    return data.reshape(*values.shape[:-1], -1)


def _swa_pattern(layer_types: list[str]) -> int:
    """The period ``n`` of a Gemma layer pattern (layer i global iff i % n == n - 1)."""
    for n in range(1, len(layer_types) + 2):
        if all((t == "full_attention") == (i % n == n - 1) for i, t in enumerate(layer_types)):
            return n
    raise ValueError(f"layer types {layer_types} are not llama.cpp's periodic pattern")


def _add_metadata(writer, arch: str, c: dict) -> None:
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c.get("max_position_embeddings", 2048))
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = c.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (local: 10000)
    writer.add_rope_freq_base(float(rope.get("rope_theta", c.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(c["vocab_size"])
    for key in ("bos", "eos"):
        if isinstance(c.get(f"{key}_token_id"), int):
            getattr(writer, f"add_{key}_token_id")(c[f"{key}_token_id"])
    experts_count = c.get("num_experts") or c.get("num_local_experts")
    if experts_count:
        writer.add_expert_count(experts_count)
        writer.add_expert_used_count(c["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if c.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if arch in _GEMMA:  # what llama.cpp's Gemma converters write
        if c.get("sliding_window"):
            writer.add_sliding_window(c["sliding_window"])
            n = _swa_pattern(c["layer_types"])
            if n != {"gemma2": 2, "gemma3": 6}[arch]:  # llama.cpp's own; a tiny model's differs
                writer.add_sliding_window_pattern(n)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if c.get(key) is not None:
                getattr(writer, f"add_{key}")(float(c[key]))


def write_gguf(
    snapshot: Path | str, out: Path | str, fmt: str, *, split_max_tensors: int = 0
) -> Path:
    """``snapshot`` (a Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Gemma 2 or Gemma 3
    safetensors snapshot) as the GGUF ``out``, its layers' matrices in ``fmt`` (one of
    ``BLOCK_FORMATS``, or a ``MIXES`` mix). ``split_max_tensors``: as llama.cpp's split
    files of at most that many tensors (``OUT-00001-of-0000N.gguf`` ...; returns the first)."""
    import gguf
    import torch
    from safetensors import safe_open

    if fmt not in BLOCK_FORMATS and fmt not in MIXES:
        raise ValueError(f"{fmt}: expected one of {', '.join(BLOCK_FORMATS + tuple(MIXES))}")
    index = CheckpointIndex.load(snapshot)
    # llama.cpp writes Mistral as Llama (its sliding window dropped)
    arch = {"MistralForCausalLM": "llama"} | {hf: name for name, hf in ARCHITECTURES.items()}
    arch = arch[index.architecture]
    c = index.config
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    out = Path(out)
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    _add_metadata(writer, arch, c)

    def add_blocks(name: str, values: np.ndarray) -> None:
        kind = _matrix_type(fmt, name, values.shape[-1], index.num_layers)
        writer.add_tensor(name, _blocks(values, kind), raw_dtype=gguf.GGMLQuantizationType[kind])

    to_gguf = gguf_names(index.num_layers, arch)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = defaultdict(dict)
    for name, info in index.tensors.items():
        with safe_open(str(index.root / info.file), framework="pt") as fh:
            values = fh.get_tensor(name).to(torch.float32).numpy()
        if m := _EXPERT.match(name):  # stacked per layer, as llama.cpp writes experts
            experts[m["layer"], m["proj"]][int(m["expert"])] = values
            continue
        target = to_gguf[name]
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _permute(values, heads if "q_proj" in name else kv_heads)
        if arch in _GEMMA and name.endswith("norm.weight"):
            values = values + 1.0  # llama.cpp's Gemma norms compute x * w: HF's 1 + w
        if name.endswith(_ROUTERS):  # llama.cpp keeps routers in float (the gate a vector)
            writer.add_tensor(target, values.reshape(-1) if values.shape[0] == 1 else values)
        elif index.layer_of(name) is not None and values.ndim == 2:
            add_blocks(target, values)
        elif fmt in MIXES and target in ("token_embd.weight", "output.weight"):
            add_blocks(target, values)  # llama.cpp's mixes quantize these too
        else:
            writer.add_tensor(target, values)
    for (layer, proj), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])  # [experts, out, in]
        add_blocks(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        return min(out.parent.glob(f"{out.stem}-00001-of-*.gguf"))
    return out

"""Write a tiny HF snapshot as a GGUF file, the way llama.cpp's converter lays it out: for
tests of the GGUF source (never a downloaded file).

Layer matrices go to one block format (Q4_0, Q4_1, Q8_0 through the ``gguf`` package's own
quantizer; Q4_K through ``pack_q4_k`` here, which the ``gguf`` package cannot write); norms
and embeddings stay F32. Llama's query and key rows are interleaved per head as llama.cpp's
converter does (``permute``), so a reader must undo it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.gguf_index import ARCHITECTURES, gguf_names

BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
_EXPERT = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")  # fmt: skip
_ROUTERS = ("mlp.gate.weight", "shared_expert_gate.weight")


def pack_q4_k(weight: np.ndarray) -> np.ndarray:
    """``[rows, K]`` float32 (K a multiple of 256) -> Q4_K bytes ``[rows, K / 256 * 144]``:
    per 32 weights a 6-bit scale and minimum relative to the super-block's f16 ``d`` and
    ``dmin``, ``W = d sc q - dmin m``."""
    rows, k = weight.shape
    x = weight.reshape(rows, k // 256, 8, 32).astype(np.float32)
    low = np.minimum(x.min(axis=-1), 0.0)  # Q4_K's offset only lowers: -dmin m <= 0
    scale = (x.max(axis=-1) - low) / 15.0  # [rows, blocks, 8]
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = ((-low).max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63)
    m = np.clip(np.round(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)), 0, 63)
    step, offset = (d32 * sc)[..., None], (dmin32 * m)[..., None]
    q = np.divide(x + offset, step, out=np.zeros_like(x), where=step > 0)
    q = np.clip(np.round(q), 0, 15).astype(np.uint8)  # [rows, blocks, 8, 32]
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
            (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )  # [rows, blocks, 12], ggml's packing of eight 6-bit pairs
    pairs = q.reshape(rows, k // 256, 4, 2, 32)
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, k // 256, 128)
    head = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8)], axis=-1)
    return np.concatenate([head.reshape(rows, -1, 4), scales, qs], axis=-1).reshape(rows, -1)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves interleaved, row by row."""
    n = weight.shape[0]
    return weight.reshape(heads, 2, n // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(snapshot: Path | str, out: Path | str, fmt: str) -> Path:
    """``snapshot`` (a Llama, Qwen2, Qwen3, Qwen2-MoE or Qwen3-MoE safetensors snapshot) as
    the GGUF ``out``."""
    import gguf
    import torch
    from safetensors import safe_open

    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"{fmt}: expected one of {', '.join(BLOCK_FORMATS)}")
    index = CheckpointIndex.load(snapshot)
    arch = {hf: name for name, hf in ARCHITECTURES.items()}[index.architecture]
    c = index.config
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    out = Path(out)
    writer = gguf.GGUFWriter(str(out), arch)
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
    kind = gguf.GGMLQuantizationType[fmt]

    def blocks(values: np.ndarray) -> np.ndarray:  # along the last axis, any leading ones
        flat = values.reshape(-1, values.shape[-1])
        data = pack_q4_k(flat) if fmt == "Q4_K" else gguf.quants.quantize(flat, kind)
        return data.reshape(*values.shape[:-1], -1)

    to_gguf = gguf_names(index.num_layers)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = defaultdict(dict)
    for name, info in index.tensors.items():
        with safe_open(str(index.root / info.file), framework="pt") as fh:
            values = fh.get_tensor(name).to(torch.float32).numpy()
        if m := _EXPERT.match(name):  # stacked per layer, as llama.cpp writes experts
            experts[m["layer"], m["proj"]][int(m["expert"])] = values
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _permute(values, heads if "q_proj" in name else kv_heads)
        if name.endswith(_ROUTERS):  # llama.cpp keeps routers in float (the gate a vector)
            writer.add_tensor(to_gguf[name], values.reshape(-1) if values.shape[0] == 1 else values)
        elif index.layer_of(name) is not None and values.ndim == 2:
            writer.add_tensor(to_gguf[name], blocks(values), raw_dtype=kind)
        else:
            writer.add_tensor(to_gguf[name], values)
    for (layer, proj), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])  # [experts, out, in]
        part = proj.removesuffix("_proj")
        writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", blocks(stacked), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out

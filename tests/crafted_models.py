"""Hostile model files of a few hundred bytes, packed byte by byte (GGUF and safetensors
headers), so a test states exactly what a crafted file holds: counts that lie, empty or
huge dimensions, misaligned offsets, values of the wrong type.

``gguf_file`` writes a small Llama GGUF that every parser here reads; a test changes one
thing (a metadata value, a tensor's dimensions, a count) and expects a one-line ModelError.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

UINT32, FLOAT32, STRING, ARRAY, UINT64 = 4, 6, 8, 9, 10
F32_TYPE = 0  # ggml's F32


@dataclass(frozen=True)
class Raw:
    """A metadata value given as its GGUF value type and packed bytes."""

    kind: int
    payload: bytes


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(value) -> tuple[int, bytes]:
    if isinstance(value, Raw):
        return value.kind, value.payload
    if isinstance(value, str):
        return STRING, _string(value)
    if isinstance(value, float):
        return FLOAT32, struct.pack("<f", value)
    if isinstance(value, int) and 0 <= value < 1 << 32:
        return UINT32, struct.pack("<I", value)
    return UINT64, struct.pack("<Q", value)


def string_array(count: int, items: list[str] = ()) -> Raw:
    """An array of strings claiming ``count`` elements, holding ``items``."""
    return Raw(ARRAY, struct.pack("<IQ", STRING, count) + b"".join(map(_string, items)))


LLAMA_METADATA = {
    "general.architecture": "llama",
    "llama.block_count": 1,
    "llama.embedding_length": 32,
    "llama.feed_forward_length": 64,
    "llama.attention.head_count": 2,
    "llama.attention.head_count_kv": 1,
    "llama.context_length": 128,
}
# Qwen3-MoE: the same numbers, and two experts
MOE_METADATA = {
    **{k.replace("llama.", "qwen3moe."): v for k, v in LLAMA_METADATA.items()},
    "general.architecture": "qwen3moe",
    "qwen3moe.expert_count": 2,
}
# (name, dims in ggml order, ggml type, offset in the data section)
LLAMA_TENSORS = [
    ("token_embd.weight", (32, 2), F32_TYPE, 0),
    ("blk.0.attn_q.weight", (32, 4), F32_TYPE, 256),  # 4 rows: two halves of 2 heads
]
LLAMA_DATA_BYTES = 256 + 32 * 4 * 4


def gguf_file(
    path: Path,
    metadata: dict | None = None,
    tensors: list | None = None,
    *,
    base: dict = LLAMA_METADATA,
    drop: tuple[str, ...] = (),
    counts: tuple[int, int] | None = None,
    data_bytes: int | None = None,
) -> Path:
    """Write a GGUF v3 at ``path``: ``base`` updated by ``metadata`` less the keys ``drop``,
    ``tensors`` (default ``LLAMA_TENSORS``), ``counts`` (tensors, entries) as the header
    claims them, and ``data_bytes`` of zeros after the aligned header."""
    meta = {k: v for k, v in {**base, **(metadata or {})}.items() if k not in drop}
    tensors = LLAMA_TENSORS if tensors is None else tensors
    n_tensors, n_kv = counts or (len(tensors), len(meta))
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)
    for key, value in meta.items():
        kind, payload = _value(value)
        out += _string(key) + struct.pack("<I", kind) + payload
    for name, dims, kind, offset in tensors:
        out += _string(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset)
    alignment = meta.get("general.alignment", 32)
    if isinstance(alignment, int) and 0 < alignment <= 4096:
        out += b"\0" * (-len(out) % alignment)
    out += b"\0" * (LLAMA_DATA_BYTES if data_bytes is None else data_bytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(out)
    return path


def safetensors_file(path: Path, header, data_bytes: int = 0) -> Path:
    """A safetensors file whose header is ``header`` (JSON-encoded unless bytes), then
    ``data_bytes`` of zeros."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
    return path


def llama_config(**changes) -> dict:
    """A tiny Llama ``config.json`` that the index reads."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 8, "vocab_size": 8,
    }  # fmt: skip
    config.update(changes)
    return config


def safetensors_snapshot(folder: Path, header, data_bytes: int = 0, **config) -> Path:
    """A snapshot folder: ``config.json`` (``llama_config``) and a ``model.safetensors``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(llama_config(**config)))
    safetensors_file(folder / "model.safetensors", header, data_bytes)
    return folder


GOOD_SAFETENSORS = {
    "model.embed_tokens.weight": {"dtype": "F32", "shape": [8, 4], "data_offsets": [0, 128]},
}

"""Memory preflight: will this shard (plus its KV budget) fit before we try to load it?"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from meshnet_common.checkpoint import CheckpointIndex
from meshnet_common.errors import InsufficientMemory
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.quantization import check_nf4_widths

logger = logging.getLogger(__name__)

GIB = 1024**3
# Loading briefly holds one extra tensor and allocator slack; keep a margin.
OVERHEAD_FRACTION = 0.10
OVERHEAD_MIN_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a shard needs at a precision, and what is available to it."""

    weight_bytes: int
    kv_bytes: int
    overhead_bytes: int
    declared_bytes: int | None
    available_bytes: int

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.overhead_bytes

    @property
    def limit_bytes(self) -> int:
        if self.declared_bytes is None:
            return self.available_bytes
        return min(self.declared_bytes, self.available_bytes)

    def describe(self) -> str:
        declared = "-" if self.declared_bytes is None else f"{self.declared_bytes / GIB:.2f} GiB"
        return (
            f"needs {self.needed_bytes / GIB:.2f} GiB (weights {self.weight_bytes / GIB:.2f}, "
            f"KV budget {self.kv_bytes / GIB:.2f}, overhead {self.overhead_bytes / GIB:.2f}); "
            f"declared {declared}, available {self.available_bytes / GIB:.2f} GiB"
        )


def _is_quantizable(index: CheckpointIndex, name: str) -> bool:
    """Linear weights inside decoder layers get quantized; embeddings/norms/biases do not."""
    info = index.tensors[name]
    return index.layer_of(name) is not None and name.endswith(".weight") and len(info.shape) == 2


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def weight_bytes(index: CheckpointIndex, layers: LayerRange, precision: Precision) -> int:
    """Resident bytes of the shard's tensors at ``precision`` (tied lm_head counted once)."""
    total = 0.0
    for name in index.tensors_for(layers):
        numel = _numel(index.tensors[name].shape)
        if precision.is_quantized and _is_quantizable(index, name):
            total += numel * precision.linear_bytes_per_param
        else:
            total += numel * precision.other_bytes_per_param
    return int(total)


def kv_bytes_per_token(config: dict, num_stage_layers: int, precision: Precision) -> int:
    """KV-cache bytes one token costs on a stage of ``num_stage_layers`` layers."""
    hidden = config.get("hidden_size", config.get("n_embd"))
    heads = config.get("num_attention_heads", config.get("n_head"))
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    act_bytes = 4 if precision is Precision.FLOAT32 else 2
    return 2 * num_stage_layers * kv_heads * head_dim * act_bytes


def available_bytes(device: str) -> int:
    """Free memory on the device: free VRAM on CUDA, available RAM on CPU."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return int(psutil.virtual_memory().available)


def estimate(
    index: CheckpointIndex,
    layers: LayerRange,
    precision: Precision,
    *,
    device: str = "cpu",
    kv_budget_tokens: int = 65536,
    declared_gb: float | None = None,
) -> MemoryEstimate:
    weights = weight_bytes(index, layers, precision)
    kv = kv_budget_tokens * kv_bytes_per_token(index.config, len(layers), precision)
    return MemoryEstimate(
        weight_bytes=weights,
        kv_bytes=kv,
        overhead_bytes=max(OVERHEAD_MIN_BYTES, int(OVERHEAD_FRACTION * weights)),
        declared_bytes=None if declared_gb is None else int(declared_gb * GIB),
        available_bytes=available_bytes(device),
    )


def linear_out_widths(index: CheckpointIndex, layers: LayerRange) -> dict[str, int]:
    """Output width of every quantizable weight of the shard (GPT-2 Conv1D stores [in, out])."""
    gpt2 = index.architecture == "GPT2LMHeadModel"
    return {
        name: index.tensors[name].shape[1 if gpt2 else 0]
        for name in index.tensors_for(layers)
        if _is_quantizable(index, name)
    }


def preflight(
    index: CheckpointIndex,
    layers: LayerRange,
    precision: Precision,
    *,
    device: str = "cpu",
    kv_budget_tokens: int = 65536,
    declared_gb: float | None = None,
) -> MemoryEstimate:
    """Raise InsufficientMemory (or ModelError for nf4 widths) unless the shard fits."""
    layers.check_within(index.num_layers)
    if precision is Precision.NF4:
        check_nf4_widths(linear_out_widths(index, layers), device)
    est = estimate(
        index,
        layers,
        precision,
        device=device,
        kv_budget_tokens=kv_budget_tokens,
        declared_gb=declared_gb,
    )
    if est.needed_bytes > est.limit_bytes:
        raise InsufficientMemory(
            f"layers {layers} of {index.root.name} at {precision.value} do not fit: "
            + est.describe()
        )
    logger.info("memory preflight ok: %s", est.describe())
    return est


def resolve_device(device: str) -> str:
    """``auto`` -> cuda when available, else cpu; refuse cuda without a GPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InsufficientMemory("--device cuda requested but no CUDA device is available")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}: use auto, cpu or cuda")
    return device

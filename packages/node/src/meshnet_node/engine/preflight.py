"""Memory preflight: will this shard (plus its KV budget) fit before we try to load it?"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from meshnet_common.config import defaults
from meshnet_common.errors import InsufficientMemory, ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.memory import ModelCosts
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.precision import Precision
from meshnet_node.engine.quantization import check_nf4_widths

logger = logging.getLogger(__name__)

GIB = 1024**3


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


def weight_bytes(index: CheckpointIndex, layers: LayerRange, precision: Precision) -> int:
    """Resident bytes of the shard's tensors at ``precision`` (tied lm_head counted once)."""
    return ModelCosts.from_index(index).weight_bytes(layers, precision)


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
    kv_budget_tokens: int = defaults.KV_BUDGET_TOKENS,
    declared_gb: float | None = None,
) -> MemoryEstimate:
    costs = ModelCosts.from_index(index)
    weights = costs.weight_bytes(layers, precision)
    kv = costs.kv_bytes(len(layers), kv_budget_tokens, precision)
    return MemoryEstimate(
        weight_bytes=weights,
        kv_bytes=kv,
        overhead_bytes=costs.shard_bytes(layers, precision, kv_budget_tokens) - weights - kv,
        declared_bytes=None if declared_gb is None else int(declared_gb * GIB),
        available_bytes=available_bytes(device),
    )


def linear_out_widths(index: CheckpointIndex, layers: LayerRange) -> dict[str, int]:
    """Output width of every quantizable weight of the shard (GPT-2 Conv1D stores [in, out])."""
    gpt2 = index.architecture == "GPT2LMHeadModel"
    return {
        name: index.tensors[name].shape[1 if gpt2 else 0]
        for name in index.tensors_for(layers)
        if index.layer_of(name) is not None
        and name.endswith(".weight")
        and len(index.tensors[name].shape) == 2
    }


def preflight(
    index: CheckpointIndex,
    layers: LayerRange,
    precision: Precision,
    *,
    device: str = "cpu",
    kv_budget_tokens: int = defaults.KV_BUDGET_TOKENS,
    declared_gb: float | None = None,
) -> MemoryEstimate:
    """Raise InsufficientMemory (or ModelError for nf4 widths) unless the shard fits."""
    layers.check_within(index.num_layers)
    refusal = ModelCosts.from_index(index).refusal(precision)
    if refusal is not None:
        raise ModelError(f"{index.root.name}: {refusal}")
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

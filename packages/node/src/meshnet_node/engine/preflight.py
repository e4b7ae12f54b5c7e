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
from meshnet_common.precision import (
    DEFAULT_GROUP_SIZE,
    Precision,
    compute_dtype_name,
    describe_precision,
    native_format_name,
)
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


def weight_bytes(
    index: CheckpointIndex,
    layers: LayerRange,
    precision: Precision,
    *,
    dtype: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> int:
    """Resident bytes of the shard's tensors at ``precision`` computing in ``dtype``
    (tied lm_head counted once)."""
    return ModelCosts.from_index(index).weight_bytes(
        layers, precision, dtype=dtype, group_size=group_size
    )


def resolve_precision_for(settings, index: CheckpointIndex) -> tuple[Precision, str]:
    """(precision, compute dtype name) a node with ``settings`` (--quantization, --dtype)
    serves this checkpoint at: auto takes its shipped fp8/mxfp4; InvalidRequest for fp8 or
    mxfp4 asked of a checkpoint that does not ship it."""
    precision = settings.precision_for(native_format_name(index.config))
    return precision, compute_dtype_name(precision, settings.dtype, gguf=index.gguf is not None)


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
    dtype: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> MemoryEstimate:
    """What the shard needs at ``precision`` computing in ``dtype`` (default: the
    precision's own), int4 in groups of ``group_size``, and what is available."""
    costs = ModelCosts.from_index(index)
    weights = costs.weight_bytes(layers, precision, dtype=dtype, group_size=group_size)
    kv = costs.kv_bytes(len(layers), kv_budget_tokens, precision, dtype=dtype)
    total = costs.shard_bytes(
        layers, precision, kv_budget_tokens, dtype=dtype, group_size=group_size
    )
    return MemoryEstimate(
        weight_bytes=weights,
        kv_bytes=kv,
        overhead_bytes=total - weights - kv,
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
    dtype: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> MemoryEstimate:
    """Raise InsufficientMemory (or ModelError for nf4 widths, or a precision the model
    cannot be served at) unless the shard fits. ``precision`` is resolved (never auto)."""
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
        dtype=dtype,
        group_size=group_size,
    )
    if est.needed_bytes > est.limit_bytes:
        shown = describe_precision(precision, dtype, group_size)
        raise InsufficientMemory(
            f"layers {layers} of {index.root.name} at {shown} do not fit: " + est.describe()
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

"""Weight precisions a node may declare, and what they cost in memory."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only where a dtype is asked for (never on a tracker)
    import torch


class Precision(StrEnum):
    """Weight precision of a shard; activations stay bfloat16 (float32 for float32 shards)."""

    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    INT8 = "int8"
    NF4 = "nf4"

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of activations, norms and embeddings on a shard of this precision."""
        import torch

        return torch.float32 if self is Precision.FLOAT32 else torch.bfloat16

    @property
    def verify_tolerance(self) -> float:
        """How far two replicas' outputs for the same input may lie apart (relative L2 of a
        row) and still count as the same computation: the square root of the activation
        dtype's machine epsilon, ~0.088 in bfloat16 and ~3.5e-4 in float32. Decode steps and
        a recomputation in one prefill are other arithmetic: measured up to 1.1e-2 (bfloat16)
        and 6e-7 (float32) on ten SmolLM2 layers (docs/adr/0026)."""
        return (2.0**-7 if self is not Precision.FLOAT32 else 2.0**-23) ** 0.5

    @property
    def is_quantized(self) -> bool:
        return self in (Precision.INT8, Precision.NF4)

    @property
    def linear_bytes_per_param(self) -> float:
        """Bytes per weight of a quantized-or-not Linear layer (incl. scale overhead)."""
        return {
            Precision.BFLOAT16: 2.0,
            Precision.FLOAT32: 4.0,
            Precision.INT8: 1.0 + 4.0 / 4096,  # int8 + one fp32 scale per row (rows >= 64)
            Precision.NF4: 0.5 + 4.0 / 64,  # 4 bit + one fp32 absmax per 64-weight block
        }[self]

    @property
    def other_bytes_per_param(self) -> float:
        """Bytes per parameter of tensors left unquantized (embeddings, norms, biases)."""
        return 4.0 if self is Precision.FLOAT32 else 2.0

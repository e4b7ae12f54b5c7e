"""How close a kernel's product must come to the exact one before it serves.

Shared by the FP8/MXFP4 check (``packed``) and the int8/int4 check (``intpack``)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F


def close(ours: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Within float32 rounding of the exact product (bf16: plus the weight's and the
    output's rounding to bf16): errors are bounded by the sum of the terms' magnitudes, not
    by the result's."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    scale = F.linear(x.double().abs(), weight.double().abs()) + exact.abs()
    unit = 2.0**-8 if x.dtype is torch.bfloat16 else 0.0
    bound = (1e-5 + unit) * scale + 1e-30
    return ours.dtype is x.dtype and bool(((ours.double() - exact).abs() <= bound).all())


def near(ours: Tensor, theirs: Tensor, x: Tensor, weight: Tensor) -> bool:
    """Two products of the same weight within twice ``close``'s bound of each other."""
    scale = F.linear(x.double().abs(), weight.double().abs())
    unit = 2.0**-8 if x.dtype is torch.bfloat16 else 0.0
    bound = 2 * (1e-5 + unit) * scale + 1e-30
    return bool(((ours.double() - theirs.double()).abs() <= bound).all())

"""How close a kernel's product must come to the exact one before it serves.

Shared by the FP8/MXFP4 check (``packed``) and the int8/int4 check (``intpack``)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

DIGIT_INPUTS = 32  # inputs sharing one scale when rows are taken as two int8 digits
DIGIT_STEPS = 127 * 254 * 2  # an input is within max |x| of its 32 / this (ADR-0045)


def digits_bound(x: Tensor, weight: Tensor) -> Tensor | float:
    """How far a product of rows taken as two int8 digits per 32 inputs (ADR-0045: int4
    and Q8_0 products where the CPU has AVX-512 VNNI) may be from the exact one: each input
    within the largest of its 32 / 64516, times the weights' magnitudes."""
    rows, k = x.shape[0], x.shape[-1]
    if k % DIGIT_INPUTS:
        return 0.0  # the digits serve whole 32s only: such widths take exact inputs
    blocks = k // DIGIT_INPUTS
    top = x.double().abs().reshape(rows, blocks, DIGIT_INPUTS).amax(-1)  # (rows, K / 32)
    per_block = weight.double().abs().reshape(-1, blocks, DIGIT_INPUTS).sum(-1)  # (N, K / 32)
    return (top / DIGIT_STEPS) @ per_block.T


def close(
    ours: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, *, digits: bool = False
) -> bool:
    """Within float32 rounding of the exact product (bf16: plus the weight's and the
    output's rounding to bf16): errors are bounded by the sum of the terms' magnitudes, not
    by the result's. ``digits``: the rows may be taken as two int8 digits (``digits_bound``
    more)."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    scale = F.linear(x.double().abs(), weight.double().abs()) + exact.abs()
    unit = 2.0**-8 if x.dtype is torch.bfloat16 else 0.0
    bound = (1e-5 + unit) * scale + 1e-30
    if digits:
        bound = bound + digits_bound(x, weight)
    return ours.dtype is x.dtype and bool(((ours.double() - exact).abs() <= bound).all())


def near(ours: Tensor, theirs: Tensor, x: Tensor, weight: Tensor, *, digits: bool = False) -> bool:
    """Two products of the same weight within twice ``close``'s bound of each other."""
    scale = F.linear(x.double().abs(), weight.double().abs())
    unit = 2.0**-8 if x.dtype is torch.bfloat16 else 0.0
    bound = 2 * (1e-5 + unit) * scale + 1e-30
    if digits:
        bound = bound + 2 * digits_bound(x, weight)
    return bool(((ours.double() - theirs.double()).abs() <= bound).all())

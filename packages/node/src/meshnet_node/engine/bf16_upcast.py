"""bfloat16 products on CPUs without bfloat16 arithmetic: many rows are multiplied in float32.

On a CPU that lacks AVX-512 (no oneDNN bf16 kernels), torch multiplies bfloat16 matrices
with a fallback whose cost grows linearly with the rows: 16 rows cost 16 times one row, so a
batched decode step or a prompt gains nothing from being batched. Widening the weight to
float32 costs about as much as one bf16 row, after which float32 GEMM amortizes the weight
over the rows: a step of 16 rows runs 3.6-4.6x faster. A few rows (a single session's
decode step) stay on the bf16 path, which is faster for them (ADR-0027).

The weight is widened in blocks of output features into a per-thread scratch buffer of a
few MiB that is reused, never into a fresh full-size float32 copy: a large fresh allocation
is an ``mmap`` whose page faults cost more than the product (23 ms for a 4096x2048 weight).
The weights themselves stay bfloat16 in memory; only the arithmetic is float32, on the same
bf16 inputs, and the result is rounded back to bfloat16.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from meshnet_node.kernels import bf16_dot

logger = logging.getLogger(__name__)

# Rows per compute thread from which widening pays, measured on a 2-core AMD EPYC without
# AVX-512 (SmolLM2's whole forward, and 576x1536 .. 4096x2048 and 49152x576 weights): with one
# thread break-even falls at 2-3 rows, with two (the bf16 fallback splits rows between
# threads, float32 GEMM of few rows scales less) at 5-6.
ROWS_PER_THREAD = 3
# With the kernel that sums as torch does several rows at a time (ADR-0030), float32 GEMM
# pays only from 48-128 rows of a call on that machine (2 threads; 64 on SmolLM2's weights).
ROWS_PER_THREAD_WITH_KERNEL = 32
SCRATCH_BYTES = 4 << 20  # float32 weight block; 4 MiB was fastest of 256 KiB .. 4 MiB

_scratch = threading.local()  # .buf: the float32 block; .exact: widening paused (depth)

P = ParamSpec("P")
R = TypeVar("R")


def bf16_is_emulated(device: torch.device | str) -> bool:
    """True on a CPU where torch has no fast bfloat16 matrix kernels (oneDNN needs AVX-512)."""
    if torch.device(device).type != "cpu":
        return False
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _scratch_buffer() -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of it
            buf = _scratch.buf = torch.empty(SCRATCH_BYTES // 4, dtype=torch.float32)
    return buf


def widened_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bf16 tensors, computed in float32 block by block."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features).float()  # (R, in)
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype, device=x.device)  # (R, out)
    scratch = _scratch_buffer()
    block = max(1, scratch.numel() // in_features)
    for start in range(0, out_features, block):
        end = min(start + block, out_features)
        w32 = scratch[: (end - start) * in_features].view(end - start, in_features)
        w32.copy_(weight[start:end])  # (b, in), exact: bf16 widens to float32 without rounding
        part = rows @ w32.t()  # (R, b)
        if bias is not None:
            part += bias[start:end]
        out[:, start:end] = part
    return out.view(*x.shape[:-1], out_features)


def upcast_min_rows(*, attention: bool = False) -> int:
    """Rows in one call from which :func:`widened_linear` beats the bf16 product (torch's,
    or the kernel's when it is ready), or float32 attention torch's bf16 SDPA; no rows at
    all (widening paused) inside :func:`torch_products`."""
    if getattr(_scratch, "exact", 0):
        return 2**62
    kernel = not attention and bf16_dot.kernel() is not None
    per_thread = ROWS_PER_THREAD_WITH_KERNEL if kernel else ROWS_PER_THREAD
    return per_thread * torch.get_num_threads()


def torch_products(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with every product torch's own, however many rows: a verification pass's rows
    must each equal the one-token step at their position bit for bit (ADR-0019), and a
    one-token step is never widened."""

    @functools.wraps(fn)
    def exact(*args: P.args, **kwargs: P.kwargs) -> R:
        _scratch.exact = getattr(_scratch, "exact", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _scratch.exact -= 1

    return exact


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype is torch.bfloat16 and x.numel() >= upcast_min_rows() * x.shape[-1]:
        return widened_linear(x, self.weight, self.bias)
    return bf16_dot.linear(x, self.weight, self.bias)


def _conv1d_forward(self: Conv1D, x: torch.Tensor) -> torch.Tensor:
    """GPT-2's ``Conv1D`` is a Linear whose weight is stored (in, out)."""
    if x.dtype is torch.bfloat16 and x.numel() >= upcast_min_rows() * x.shape[-1]:
        return widened_linear(x, self.weight.t(), self.bias)
    return Conv1D.forward(self, x)


def widen_linears(module: nn.Module) -> int:
    """Route every bfloat16 ``nn.Linear`` (and GPT-2 ``Conv1D``) under ``module`` through
    :func:`widened_linear` when a call has :func:`upcast_min_rows` rows or more. Returns how
    many were routed."""
    count = 0
    for sub in module.modules():
        forward = {nn.Linear: _forward, Conv1D: _conv1d_forward}.get(type(sub))
        if forward is not None and sub.weight.dtype is torch.bfloat16:
            sub.forward = types.MethodType(forward, sub)
            count += 1
    return count


def widen_if_emulated(module: nn.Module, device: torch.device | str) -> int:
    """:func:`widen_linears` where bfloat16 arithmetic is emulated, else nothing."""
    if not bf16_is_emulated(device):
        return 0
    count = widen_linears(module)
    if count:
        logger.info("bf16 is emulated on this CPU: %d linears multiply many rows in float32", count)
    return count

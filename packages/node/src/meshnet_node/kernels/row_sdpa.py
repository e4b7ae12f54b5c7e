"""A batched decode step's attention, each row through torch's own SDPA as transformers
calls it for a one-token step, the rows spread over the compute thread's team in C++
(``row_sdpa.cpp``, built into the packed module; docs/adr/0051).

A batched step attends row by row: each session has its own cache (``row_attention``,
``DecodeProgram.rows``). From Python each row's call costs the wrapper, the dispatcher and
a parallel region of the whole team for a 1 x n product: for 16 sessions of SmolLM2's
10-layer stage, 160 calls and ~40% of the pass. ``attend`` makes the same calls from C++,
a row per thread at a time.

The same bits by construction: the call is transformers' ``sdpa_attention_forward`` for
one row (its grouped-head choice, ``mode_of``, is repeated here and checked), on the same
tensors; inside it torch's CPU flash attention computes each (batch, head, query block)
alone and in order over the key blocks, so running it on one thread instead of the team
does not change its sums. Before a kind of call (dtype, heads, head size, grouping, mask)
is served this way, probes of 1 to 16 rows at lengths from 1 to 1030 are compared with
transformers' own per-row calls bit for bit, with the thread's torch threads; a kind that
differs stays with the per-row calls, and the log says so once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from meshnet_node.kernels import intpack

logger = logging.getLogger(__name__)

PLAIN, GQA, PACKED = 0, 1, 2  # as row_sdpa.cpp: how the grouped heads reach SDPA
# What a one-token step's call may carry that sdpa_attention_forward ignores or that is
# passed on here (anything else: the per-row calls).
_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "position_ids", "is_causal"})
_LENGTHS = (1, 2, 31, 64, 65, 127, 300, 513, 1030)
_ROWS = (1, 3, 16)

_checked: dict[tuple, bool] = {}
_lock = threading.Lock()


def mode_of(groups: int, key: torch.Tensor, value: torch.Tensor, mask) -> int | None:
    """How ``sdpa_attention_forward`` hands a one-token row's grouped heads to SDPA (None:
    a way this does not repeat)."""
    if groups <= 1:
        return PLAIN
    forced = os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") == "1"
    if forced or (mask is None and key.shape[-1] == value.shape[-1] <= 256):
        return GQA
    if mask is not None and mask.shape[1] != 1:
        return None  # pack_gqa would fold a per-head mask too
    return PACKED


def _mask_kind(mask) -> tuple | None:
    return None if mask is None else (mask.dtype, tuple(mask.shape[:3]))


def _signature(query, key, value, mask, mode: int, groups: int) -> tuple:
    return (query.dtype, query.shape[1], query.shape[3], key.shape[1], value.shape[3],
            mode, groups, _mask_kind(mask))  # fmt: skip


def attend(
    module: nn.Module, function: Callable, query: torch.Tensor,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]], masks: Sequence, kwargs: dict,
) -> torch.Tensor | None:  # fmt: skip
    """Rows ``query`` (B, heads, 1, D) each against its own ``kv[b]`` and ``masks[b]``, as
    ``function(module, query[b:b+1], k, v, mask, **kwargs)[0]`` gives them, concatenated
    (B, 1, heads, D); None where this does not apply (``function`` is not transformers'
    SDPA, a call it does not repeat, the kernel is not built, or its probes differed)."""
    if function is not sdpa_attention_forward or query.device.type != "cpu":
        return None
    if query.shape[2] != 1 or not _KWARGS.issuperset(kwargs) or kwargs.get("dropout", 0.0):
        return None
    kernel = intpack.module()  # the packed module, once built and checked
    if kernel is None or not hasattr(kernel, "rows_sdpa"):
        return None
    groups = getattr(module, "num_key_value_groups", 1)
    # The rows' keys and values come from one projection (one head width): the kind of a
    # row's mask decides its mode, so each kind is looked at once.
    key, value = kv[0]
    kinds = {_mask_kind(m): m for m in masks}  # every kind of mask the rows have, probed
    modes = {mode_of(groups, key, value, m) for m in kinds.values()}
    if len(modes) != 1 or None in modes:
        return None
    mode = modes.pop()
    if not all(_usable(_signature(query, key, value, m, mode, groups), kernel, module,
                       query, key, value, m, mode, groups) for m in kinds.values()):  # fmt: skip
        return None
    return kernel.rows_sdpa(query, [k for k, _ in kv], [v for _, v in kv], list(masks),
                            kwargs.get("scaling"), mode, groups)  # fmt: skip


def _usable(signature: tuple, kernel, module, query, key, value, mask, mode, groups) -> bool:
    with _lock:
        known = _checked.get(signature)
    if known is not None:
        return known
    ok = _probe(kernel, module, query, key, value, mask, mode, groups)
    if ok and query.dtype is torch.float16:  # its float32 twin too: see _probe
        ok = _probe(kernel, module, query, key, value, mask, mode, groups, torch.float32)
    with _lock:
        _checked[signature] = ok
    if not ok:
        logger.warning("batched rows' attention (%s, %d heads of %d) stays per row: torch's "
                       "SDPA gave other bits on one thread here", query.dtype,
                       query.shape[1], query.shape[3])  # fmt: skip
    return ok


def _probe(kernel, module, query, key, value, mask, mode: int, groups: int,
           dtype: torch.dtype | None = None) -> bool:  # fmt: skip
    """Probes of this kind of call (in ``dtype``, default the call's own): the C++ rows
    against transformers' per-row calls.

    A kind whose summation order depends on which thread runs a row shows it at nearly
    every length in float32, rarely in float16, whose rounding hides most orders: where
    torch's CPU flash attention multiplies through MKL's float32 GEMM (float32 and float16;
    MKL's kernels on an AMD EPYC Zen 4 give one thread's rows other bits than another's),
    so a float16 kind is served only if its float32 twin passes too. bfloat16 takes
    oneDNN's kernels, alike on every thread."""
    gen = torch.Generator().manual_seed(query.shape[1] * 131 + query.shape[3])
    dtype = query.dtype if dtype is None else dtype
    heads, d, kv_heads, vd = query.shape[1], query.shape[3], key.shape[1], value.shape[3]
    scaling = d**-0.5
    for rows in _ROWS:
        lengths = [_LENGTHS[(rows + i) % len(_LENGTHS)] for i in range(rows)]
        q = (torch.randn(rows, heads, 1, d, generator=gen) * 3).to(dtype)
        kv = [((torch.randn(1, kv_heads, n, d, generator=gen) * 3).to(dtype),
               torch.randn(1, kv_heads, n, vd, generator=gen).to(dtype))
              for n in lengths]  # fmt: skip
        masks = [_probe_mask(mask, n, dtype) for n in lengths]
        want = torch.cat([
            sdpa_attention_forward(module, q[b : b + 1], k, v, m, dropout=0.0, scaling=scaling)[0]
            for b, ((k, v), m) in enumerate(zip(kv, masks, strict=True))
        ])  # fmt: skip
        got = kernel.rows_sdpa(q, [k for k, _ in kv], [v for _, v in kv], masks, scaling,
                               mode, groups)  # fmt: skip
        if got.shape != want.shape or not torch.equal(got, want):
            return False
    return True


def _probe_mask(mask, length: int, dtype: torch.dtype):
    """A mask like ``mask`` for a cache of ``length`` (a float one in ``dtype``): the first
    third hidden (None: none)."""
    if mask is None:
        return None
    seen = torch.ones(*mask.shape[:3], length, dtype=torch.bool)
    seen[..., : length // 3] = False
    if mask.dtype is torch.bool:
        return seen
    return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)

"""Products whose every row is that row's product alone, whatever else the pass holds
(docs/adr/0038).

A node's passes hold any number of rows: one decode step, a batch of sessions' steps, drafts
to verify, a prompt chunk, a replay. The unsplit model decodes one row at a time. For a
split model to give the unsplit model's tokens under every schedule, each row of a product
must come out as that row alone would: the same bits whatever the row count and whatever
the other rows are. torch's products do not promise that. Measured with torch 2.13 on an
AMX Xeon, a bf16 ``F.linear`` of 576 -> 1536 gives a row other bits in a call of 13 rows or
more than alone (oneDNN switches kernels, and blocks the sums otherwise); with AVX-512 bf16
and no AMX (AMD Zen 4) 1536 -> 576 does from 17 rows, and 2048 -> 8192 from 2.

So every product of a stage's one-token rows (a decode step, batched steps, drafts to
verify, the passes a replay repeats) runs in row groups no taller than its shape's **row limit**:
the most rows (up to ``MAX_ROWS``) for which the product of every count from 1 to the limit
was checked to give each row its one-row product, bit for bit, on a weight and inputs of
that shape whose sums show any change of order (``probe_weight``), with the torch threads
the node computes with. A call of more rows is cut into groups of at most the limit. The
limit is found once per weight shape, kept per process, and logged; a shape whose one-row product itself
differs from its parts' (a fused group, ``fused_linears``) stays apart.

Then such a row's bits depend on its inputs only: batched decode equals one session at a
time, a verification pass equals its rows one step at a time, a replay equals the passes it
replaces, and every decode step equals the unsplit model's.

A prompt chunk is the other kind of pass (``prompt_rows``): the unsplit model computes a
prompt's rows in one call of all of them, and torch's products of L rows are its own; so a
chunk's products are one call of all its rows, member by member for a fused group, as the
unsplit model's (a prompt of one wire chunk, up to 128 tokens, is computed exactly as
there). A pass that merged several chunks of a prompt computes each chunk as its own call,
so a chunk is computed the same way however its pass was formed (a replay, the prefix
cache's 128-token blocks).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from meshnet_node.kernels import bf16_dot

logger = logging.getLogger(__name__)

# The most rows a product is checked for and called with (a batch of more sessions' steps
# is two calls). Each row count checked leaves oneDNN its compiled kernels for the shape
# (~0.6 MB a count here), what serving that many rows would compile anyway: measured with
# SmolLM2's shapes, 32 counts kept ~90 MB more in a process, 16 counts ~45 MB.
MAX_ROWS = 16

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

_limits: dict[tuple, int] = {}  # shape signature -> row limit (0: not even one row)
_lock = threading.Lock()
# A prompt chunk's rows: how many rows one call takes (the wire chunk), 0 outside one.
_prompt: contextvars.ContextVar[int] = contextvars.ContextVar("prompt_rows", default=0)


@contextlib.contextmanager
def prompt_rows(chunk: int) -> Iterator[None]:
    """Within (``chunk`` > 0): the rows are a prompt's, multiplied one wire chunk of
    ``chunk`` rows per call, as the unsplit model multiplies a prompt of one chunk (a pass
    that merged several chunks of a prompt computes each as its own call). 0: off."""
    token = _prompt.set(max(0, chunk))
    try:
        yield
    finally:
        _prompt.reset(token)


def in_prompt() -> int:
    """The rows a prompt chunk's call takes now (``prompt_rows``); 0 outside one."""
    return _prompt.get()


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A stage's product: meshnet's bf16 kernel where it applies and is ready (torch's sums,
    ADR-0030), else torch's."""
    return bf16_dot.linear(x, weight, bias)


def probe(rows: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Inputs for ``probe_weight``: rows of ones, of random signs, of magnitudes spread over
    many octaves, and plain normal ones."""
    gen = torch.Generator().manual_seed(rows * 7919 + k)
    x = torch.randn(rows, k, generator=gen)
    spread = torch.randn(rows, k, generator=gen) * torch.exp(
        3 * torch.randn(rows, k, generator=gen)
    )
    signs = torch.randint(0, 2, (rows, k), generator=gen).float() * 2 - 1
    x[1::4], x[2::4], x[3::4] = signs[1::4], spread[2::4], 1.0
    if dtype is torch.float16:  # its range ends at 65504: sums of probes must stay finite
        x = x.clamp(-8.0, 8.0)
    return x.to(device=device, dtype=dtype)


def probe_weight(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A weight of ``shape`` on which a sum in any other order gives other bits (ADR-0030's
    probes): every row holds +2^25, -2^25, 1, +2^24, -2^24 and two smaller powers of two at
    random places over small noise, so big terms cancel and a small one is lost or kept
    depending on when it is added (scaled down for float16, whose range ends at 65504).
    Built 4096 rows at a time (no float32 copy of it all)."""
    n, k = shape
    gen = torch.Generator().manual_seed(n * 31 + k)
    out = torch.empty(n, k, dtype=dtype, device=device)
    big = torch.tensor([2.0**25, -(2.0**25), 1.0, 2.0**24, -(2.0**24)])
    scale = 2.0**-16 if dtype is torch.float16 else 1.0
    for start in range(0, n, 4096):
        rows = min(4096, n - start)
        w = 0.01 * torch.randn(rows, k, generator=gen)
        small = torch.randint(0, 25, (rows, 2), generator=gen).float().exp2()
        small[:, 1] *= -1
        places = torch.randint(0, k, (rows, 7), generator=gen)
        w.scatter_(1, places, torch.cat([big.expand(rows, 5), small], dim=1) * scale)
        out[start : start + rows] = w.to(dtype)
    return out


def probe_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A bias for ``probe_weight``'s products, in ``bias``'s dtype (None: no bias)."""
    if bias is None:
        return None
    gen = torch.Generator().manual_seed(len(bias))
    return (torch.randn(len(bias), generator=gen) * 4).to(bias.dtype)


def alone(x: torch.Tensor, parts: Sequence[nn.Module], fn: Product = product) -> torch.Tensor:
    """Each row of ``x`` (rows, in) multiplied alone by each part, as a one-token step calls
    it, ``(1, 1, in)`` (their outputs side by side)."""
    rows = []
    for i in range(x.shape[0]):
        row = x[i : i + 1].unsqueeze(0)  # (1, 1, in)
        rows.append(torch.cat([fn(row, p.weight, p.bias) for p in parts], dim=-1)[0])
    return torch.cat(rows)


def find_limit(
    weight: torch.Tensor, bias: torch.Tensor | None, parts: Sequence[nn.Module],
    threads: int | None = None, fn: Product = product,
) -> int:  # fmt: skip
    """The most rows (0 to ``MAX_ROWS``) for which ``fn(x, weight, bias)`` gives every row
    the parts' one-row products, for every row count up to it, with ``threads`` torch
    threads (None: this thread's count)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or before)
        with torch.inference_mode():
            x = probe(MAX_ROWS, weight.shape[1], weight.dtype, weight.device)
            expected = alone(x, parts, fn)
            for rows in range(1, MAX_ROWS + 1):
                if not torch.equal(fn(x[:rows].unsqueeze(0), weight, bias)[0], expected[:rows]):
                    return rows - 1
    finally:
        torch.set_num_threads(before)
    return MAX_ROWS


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One row ``x`` (in,) times ``weight``: torch's matrix-vector product (``addmv`` with a
    bias), which skips the GEMM's set-up. Whether it is the faster of the two depends on
    the CPU: on an AMX Xeon, SmolLM2's shapes in bf16 at 2 threads took 1.5-2x less than a
    one-row ``F.linear``; on an AMD Zen 4 (AVX-512 bf16, no AMX) 1.2-1.8x more
    (``gemv_pays`` measures it)."""
    return torch.mv(weight, x) if bias is None else torch.addmv(bias, weight, x)


# (shape, dtype, device, bias, threads, fn) -> whether a row alone is a matrix-vector product
_gemv_ok: dict[tuple, bool] = {}
TIMED_CALLS = 5  # calls of each product timed, interleaved; the least time of each counts


def gemv_pays(weight: torch.Tensor, bias, threads: int | None = None,
              fn: Product = product) -> bool:  # fmt: skip
    """Whether a row alone is multiplied as ``gemv``: where it gives the row the bits ``fn``
    gives it as a one-token step (``(1, 1, in)``), on the order-revealing weight of
    ``weight``'s shape and ``MAX_ROWS`` probe rows, and (on a CPU) takes less time than
    ``fn`` on that weight, both with ``threads`` torch threads. Either way the row's bits
    are ``fn``'s: the time decides only which call computes them. Checked once per shape,
    then remembered."""
    threads = threads or torch.get_num_threads()
    key = (tuple(weight.shape), weight.dtype, weight.device.type, bias is not None, threads, fn)
    with _lock:
        chosen = _gemv_ok.get(key)
        if chosen is None:
            chosen, why = _probed_gemv(weight, bias, threads, fn)
            _gemv_ok[key] = chosen
            logger.info("products %s x %d (%s, %d thread(s)): one row %s (%s)",
                        weight.shape[0], weight.shape[1], weight.dtype, threads,
                        "as a matrix-vector product" if chosen else "as torch's GEMM",
                        why)  # fmt: skip
    return chosen


def _probed_gemv(weight: torch.Tensor, bias, threads: int, fn: Product) -> tuple[bool, str]:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            probed = probe_weight(tuple(weight.shape), weight.dtype, weight.device)
            probed_bias = probe_bias(bias)
            x = probe(MAX_ROWS, weight.shape[1], weight.dtype, weight.device)
            exact = all(
                torch.equal(gemv(row, probed, probed_bias),
                            fn(row.view(1, 1, -1), probed, probed_bias).view(-1))
                for row in x
            )  # fmt: skip
            if not exact:
                return False, "the matrix-vector product gives other bits"
            if weight.device.type != "cpu":
                return True, "the same bits"
            row = x[0]
            mv_s, gemm_s = faster_of(
                lambda: gemv(row, probed, probed_bias),
                lambda: fn(row.view(1, 1, -1), probed, probed_bias),
            )  # fmt: skip
            timing = f"the same bits; {mv_s * 1e6:.0f} us against {gemm_s * 1e6:.0f} us"
            return mv_s < gemm_s, timing
    finally:
        torch.set_num_threads(before)


def faster_of(first: Callable[[], object], second: Callable[[], object],
              calls: int = TIMED_CALLS) -> tuple[float, float]:  # fmt: skip
    """The least time of ``calls`` calls of each, interleaved (after one untimed call
    each), in seconds."""
    first(), second()
    best = [float("inf"), float("inf")]
    for _ in range(calls):
        for i, call in enumerate((first, second)):
            started = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - started)
    return best[0], best[1]


def _signature(weight: torch.Tensor, bias, sizes: tuple[int, ...], threads: int) -> tuple:
    return (sizes, weight.shape[1], weight.dtype, weight.device.type, bias is not None, threads)


def row_limit(
    weight: torch.Tensor, bias: torch.Tensor | None, parts: Sequence[nn.Module] | None = None,
    threads: int | None = None,
) -> int:  # fmt: skip
    """The row limit of products of ``weight``'s shape (whose outputs are ``parts``' side by
    side, or its own), found on an order-revealing weight of that shape (``probe_weight``),
    once per shape and thread count, then remembered."""
    threads = threads or torch.get_num_threads()
    sizes = tuple(int(p.weight.shape[0]) for p in parts) if parts else (int(weight.shape[0]),)
    key = _signature(weight, bias, sizes, threads)
    with _lock:
        limit = _limits.get(key)
        if limit is None:
            limit = _limits[key] = _probed_limit(weight, bias, sizes, threads)
            logger.info("products %s x %d (%s, %d thread(s)): rows in groups of at most %d",
                        sizes, key[1], key[2], threads, limit)  # fmt: skip
    return limit


def _probed_limit(weight: torch.Tensor, bias, sizes: tuple[int, ...], threads: int) -> int:
    with torch.inference_mode():
        probed = probe_weight(tuple(weight.shape), weight.dtype, weight.device)
        probed_bias = probe_bias(bias)
        parts, start = [], 0
        for size in sizes:
            part_bias = None if probed_bias is None else probed_bias[start : start + size]
            parts.append(types.SimpleNamespace(weight=probed[start : start + size], bias=part_bias))
            start += size
        return find_limit(probed, probed_bias, parts, threads)


def grouped(
    x: torch.Tensor, weight: torch.Tensor, bias, limit: int, fn: Product = product
) -> torch.Tensor:
    """``fn(x, weight, bias)`` computed in groups of at most ``limit`` rows, each called as
    one sequence ``(1, rows, in)`` with a plain layout: the shape the unsplit model calls its
    products with (torch hands a 3-D input, and one whose strides differ, to other kernels
    than a plain 3-D one, with other bits: measured with oneDNN on AMX)."""
    flat = x.reshape(-1, x.shape[-1])  # (R, in)
    count = flat.shape[0]
    if count <= limit:
        out = fn(flat.unsqueeze(0), weight, bias)  # (1, R, in): strides (R*in, in, 1)
    else:
        out = torch.cat([fn(flat[i : i + limit].unsqueeze(0), weight, bias)
                         for i in range(0, count, limit)], dim=1)  # fmt: skip
    return out.view(*x.shape[:-1], weight.shape[0])


class RowGroups:
    """A Linear's forward in row groups of at most its shape's row limit; a row alone as a
    matrix-vector product where that gives its bits and is faster (``gemv_pays``).

    Holds the Linear's weight and bias themselves (a decode step calls ~120 of these: the
    module's attribute lookups and a second call cost ~5 us each)."""

    def __init__(self, linear: nn.Linear, limit: int, fn: Product = product,
                 one_row: bool = False) -> None:  # fmt: skip
        self.weight, self.bias, self.limit, self.fn = linear.weight, linear.bias, limit, fn
        self.out_features, self.one_row = linear.out_features, one_row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (R, in)
        if self.one_row and flat.shape[0] == 1:
            return gemv(flat[0], self.weight, self.bias).view(*x.shape[:-1], self.out_features)
        limit = _prompt.get() or self.limit  # a prompt: one call per wire chunk
        if flat.shape[0] > limit:
            return grouped(x, self.weight, self.bias, limit, self.fn)
        out = self.fn(flat.unsqueeze(0), self.weight, self.bias)  # (1, R, in), plain strides
        return out.view(*x.shape[:-1], self.out_features)


def route_rows(module: nn.Module, threads: int | None = None, *, kernel: bool = True) -> int:
    """Run every ``nn.Linear`` under ``module`` in row groups of its row limit, checked with
    ``threads`` torch threads (a fused group's Linear carries its limit against its members
    already: ``row_limit`` set by ``fused_linears``), a row alone as a matrix-vector product
    where that is bit for bit and faster (``gemv_pays``); ``kernel``: through meshnet's bf16
    kernel where it applies (``product``), else torch's own. Returns how many were routed."""
    count = 0
    for sub in module.modules():
        if type(sub) is not nn.Linear or sub.weight.device.type == "meta":
            continue
        limit = getattr(sub, "row_limit", None)
        if limit is None:
            limit = row_limit(sub.weight, sub.bias, threads=threads)
        fn = product if kernel else nn.functional.linear
        one_row = limit >= 1 and gemv_pays(sub.weight, sub.bias, threads, fn)
        sub.forward = RowGroups(sub, max(limit, 1), fn, one_row)
        count += 1
    return count


class TokensAlone:
    """A module's forward, one token at a time outside prompts: a mixture-of-experts block
    or GPT-2's ``Conv1D``.

    Their products are torch's own calls on the tokens the module holds (a router's raw
    ``F.linear`` on 2-D rows, an expert's on however many tokens chose it, ``Conv1D``'s
    ``addmm``), so their bits depend on the other tokens of the pass. Called once per token,
    the module computes each as a one-token step does. A prompt chunk is one call, as the
    unsplit model's."""

    def __init__(self, forward: Callable) -> None:
        self.forward = forward

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs):
        shape = hidden_states.shape
        rows = hidden_states.reshape(-1, shape[-1])
        if rows.shape[0] <= 1 or _prompt.get():
            return self.forward(hidden_states, *args, **kwargs)
        outs = [self.forward(rows[i : i + 1].view(1, 1, -1), *args, **kwargs)
                for i in range(rows.shape[0])]  # fmt: skip
        if isinstance(outs[0], tuple):  # (hidden, router logits): each joined by token
            return tuple(_joined(list(parts), shape) for parts in zip(*outs, strict=True))
        return _joined(outs, shape)


def _joined(parts: list, shape: torch.Size):
    """Per-token outputs as one: a hidden state in the input's shape, a per-token tensor
    (router logits) stacked by token, anything else as the first token's."""
    first = parts[0]
    if not isinstance(first, torch.Tensor):
        return first
    if first.dim() == 3:
        return torch.cat(parts, dim=0).view(*shape[:-1], first.shape[-1])
    return torch.cat(parts, dim=0)


def route_alone(module: nn.Module) -> int:
    """Run every mixture-of-experts block under ``module`` (a module with a child whose class
    name ends in ``Experts``: transformers' routed experts, or ``PackedExperts``) and every
    GPT-2 ``Conv1D`` a token at a time outside prompts (``TokensAlone``). Returns how many
    were routed."""
    count = 0
    for sub in module.modules():
        moe = any(type(c).__name__.endswith("Experts") for c in sub.children())
        if moe or type(sub).__name__ == "Conv1D":
            sub.forward = TokensAlone(sub.forward)
            count += 1
    return count

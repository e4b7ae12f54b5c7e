"""FP8 / MXFP4 products on packed weights against torch's bf16 product on the same shape.

Prints, per weight shape and row count, the milliseconds of ``fp8_linear`` and
``mxfp4_linear`` (bf16 inputs, as a node calls them), of their two paths forced (the fused
kernel, dequantize + GEMM: where they cross sets ``packed.FUSED_MAX_ROWS``), and of bf16
``F.linear``. Best of repeated calls, taken in turn.

Then int8 / int4 (``--part lowbit``): per shape and row count, torch's kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) against meshnet's
(``int8_linear``, ``int4_linear``) and bf16 ``F.linear``, and the unpacking of an int4
weight for the many-row path (``int4_dequantize`` against the pure-torch unpacking).

    .venv/bin/python bench/packed_kernels.py [--threads 1,2] [--seconds 3] [--part all]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from torch.nn import functional as F

from meshnet_node.kernels import intpack, packed

SHAPES = [(8192, 2048), (2048, 8192), (1536, 576)]  # (N out, K in)
ROWS = [1, 4, 16, 32, 64, 128]


def best_ms(calls: list, seconds: float) -> list[float]:
    """Best time of each call, the calls taken in turn for ``seconds`` (at least 5 rounds):
    on a shared machine a neighbour's burst then hits all of them alike, and the best run
    of each is the one nobody disturbed."""
    best = [float("inf")] * len(calls)
    for call in calls:
        call()
    end, rounds = time.perf_counter() + seconds, 0
    while rounds < 5 or (time.perf_counter() < end and rounds < 200):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - t0)
        rounds += 1
    return [1e3 * t for t in best]


def forced(fn, rows_limit: int):
    def call():
        saved = dict(packed.FUSED_MAX_ROWS)
        packed.FUSED_MAX_ROWS.update(dict.fromkeys(saved, rows_limit))
        try:
            return fn()
        finally:
            packed.FUSED_MAX_ROWS.update(saved)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="2", help="thread counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0, help="per shape and row count")
    parser.add_argument("--part", choices=["all", "fp8", "lowbit"], default="all")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="x's dtype in the int8/int4 part")  # fmt: skip
    args = parser.parse_args()
    packed.start()
    if packed.wait(900) is None:
        print(f"kernel unavailable: {packed.unavailable_reason()} (timing the fallback)")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        if args.part in ("all", "fp8"):
            fp8_part(threads, args.seconds)
        if args.part in ("all", "lowbit"):
            lowbit_part(threads, args.seconds, getattr(torch, args.dtype))


def fp8_part(threads: int, seconds: float) -> None:
    print(f"threads {threads}; fused kernel up to rows {packed.FUSED_MAX_ROWS}")
    print("ms per call (best of repeated calls), bf16 x; 'x bf16': fp8 or mxfp4 / bf16")
    head = f"{'N x K':>11} {'rows':>4} | {'bf16':>7} | {'fp8':>7} {'fused':>7} {'deq+mm':>7} {'x bf16':>6} | {'mxfp4':>7} {'fused':>7} {'deq+mm':>7} {'x bf16':>6}"  # fmt: skip
    print(head)
    print("-" * len(head))
    for n, k in SHAPES:
        shape(n, k, seconds)


def shape(n: int, k: int, seconds: float) -> None:
    gen = torch.Generator().manual_seed(0)
    w8, s8 = packed.fp8_probe(n, k, (128, 128), seed=1)
    blocks, scales = packed.mxfp4_probe(n, k, seed=2)
    wbf = torch.randn(n, k, generator=gen).bfloat16()
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        fp8 = partial(packed.fp8_linear, x, w8, s8, (128, 128))
        fp4 = partial(packed.mxfp4_linear, x, blocks, scales)
        calls = [partial(F.linear, x, wbf)]
        calls += [fp8, forced(fp8, 1 << 30), forced(fp8, 0), fp4, forced(fp4, 1 << 30), forced(fp4, 0)]  # fmt: skip
        base, *t = best_ms(calls, seconds)
        cells = [f"{n}x{k}".rjust(11), f"{rows:>4}", "|", f"{base:7.3f}", "|"]
        for auto, fused, deq in (t[:3], t[3:]):
            cells += [f"{auto:7.3f}", f"{fused:7.3f}", f"{deq:7.3f}", f"{auto / base:6.2f}", "|"]
        print(" ".join(cells[:-1]), flush=True)


LOWBIT_ROWS = [1, 4, 16, 64, 128]


def lowbit_part(threads: int, seconds: float, dtype: torch.dtype, group: int = 64) -> None:
    """torch's int8/int4 kernels against meshnet's and the dtype's F.linear, same x."""
    if not intpack.ready():
        print(f"int8/int4 kernel unavailable: {intpack.unavailable_reason()}")
        return
    name = "bf16" if dtype is torch.bfloat16 else "f32"
    print(f"\nthreads {threads}; int8 / int4 (group {group}); x {dtype}; ms per call (best of")
    print(f"repeated calls, taken in turn); 'x {name}': meshnet's / {name} F.linear")
    head = f"{'N x K':>11} {'rows':>4} | {name:>7} | {'int8 th':>7} {'ours':>7} {'x ' + name:>6} | {'int4 th':>7} {'ours':>7} {'x ' + name:>6}"  # fmt: skip
    print(head)
    print("-" * len(head))
    for n, k in SHAPES:
        gen = torch.Generator().manual_seed(0)
        q, scale = intpack.int8_probe(n, k, dtype, seed=1)
        _, pk, sz = intpack.int4_probe(n, k, group, dtype, seed=2)
        block = intpack.int4_block_n(n)
        dense = torch.randn(n, k, generator=gen).to(dtype)
        for rows in LOWBIT_ROWS:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            calls = [
                partial(F.linear, x, dense),
                partial(intpack.TorchLowbit.int8_linear, x, q, scale),
                partial(intpack.int8_linear, x, q, scale),
                partial(intpack.TorchLowbit.int4_linear, x, pk, sz, group, block),
                partial(intpack.int4_linear, x, pk, sz, group, block),
            ]
            base, t8, o8, t4, o4 = best_ms(calls, seconds)
            print(f"{n}x{k}".rjust(11), f"{rows:>4} | {base:7.3f} | {t8:7.3f} {o8:7.3f} {o8 / base:6.2f} | {t4:7.3f} {o4:7.3f} {o4 / base:6.2f}", flush=True)  # fmt: skip
        out = torch.empty(n, k, dtype=dtype)
        torch_ms, ours_ms = best_ms(
            [
                partial(intpack.TorchLowbit.int4_dequantize, pk, sz, group, block, out),
                partial(intpack.int4_dequantize, pk, sz, group, block, out),
            ],
            seconds,
        )
        print(f"{n}x{k}".rjust(11), f"int4 unpack into {name}: pure torch {torch_ms:.3f} ms, meshnet {ours_ms:.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()

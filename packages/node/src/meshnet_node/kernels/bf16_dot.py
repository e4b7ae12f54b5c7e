"""torch's own bfloat16 product, computed several rows at a time (docs/adr/0030).

On an x86 CPU with AVX2 but without AVX-512, torch has no oneDNN bf16 kernels: it multiplies
a bf16 ``nn.Linear`` as one float32 dot product per output, so 16 rows cost 16 times one row
and batching sessions or prompt tokens saves no arithmetic. ``bf16_dot.cpp`` sums every
output in exactly torch's order (same blocks, accumulators, tree and lane sums, same fused
multiply-adds, same rounding), but a tile of 4 rows x 3 weight rows at a time, from
registers. Its outputs are therefore torch's, bit for bit, whatever the rows: the unsplit
model, a session alone, a batched step, a verification pass and a replay all agree, as
before, only faster (one 576x1536 weight, 2 threads: 1 row 95 -> 41 us, 16 rows 1426 -> 257
us).

The C++ is built once per machine with torch's extension builder (g++ and ninja; cached
under ``TORCH_EXTENSIONS_DIR``, ``make install`` builds it ahead). Before the first use it
is checked against torch on inputs whose sums depend on the order of every addition; a
machine where it does not build, or where torch sums differently (another torch build, a
CPU that dispatches another kernel), keeps torch's product and says so once in the log.
Once built, it is imported at once; the one-time build runs in a background thread, so a
node never waits for it: until it is ready, products are torch's, which are the same
numbers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bf16_dot.cpp")
HEADER = Path(__file__).with_name("omp_for.h")  # included by the source: part of its build key
NAME = "meshnet_bf16_dot"
BLOCK = 64  # the kernel handles inner dimensions that are a multiple of this

_state: dict[str, Any] = {"module": None, "thread": None, "reason": None}
_lock = threading.Lock()


def applies(device: torch.device | str = "cpu") -> bool:
    """True where torch multiplies bf16 with its AVX2 dot-product fallback: a CPU whose
    dispatch level is AVX2 and where oneDNN has no bf16 kernels."""
    if torch.device(device).type != "cpu":
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
LDFLAGS = ["-fopenmp"]  # torch's libgomp, already loaded (same soname), serves it


def build_path() -> Path:
    """Where the built module lies: one folder per source, flags, torch and Python, under
    torch's extension cache (``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``)."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), HEADER.read_bytes(), repr((CFLAGS, LDFLAGS)).encode(),
                 torch.__version__.encode(), sys.version.encode()):  # fmt: skip
        key.update(part)
    name = f"{NAME}_{key.hexdigest()[:16]}"
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "torch_extensions"
    )
    return Path(cache, name, f"{name}.so")


def _import(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(path: Path) -> types.ModuleType:
    from torch.utils import cpp_extension  # imported only to build: it pulls in setuptools

    path.parent.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=path.stem, sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
        build_directory=str(path.parent), verbose=False,
    )  # fmt: skip


def probe(rows: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs on which a sum in any other order gives a different bf16 result. Every weight
    row holds +2^25, -2^25, 1, +2^24, -2^24 and two smaller powers of two at random
    positions over small noise; rows of x are ones, random signs (the big terms cancel, and
    a small one is lost or kept depending on when) or widely spread magnitudes; a bias."""
    gen = torch.Generator().manual_seed(seed)
    w = 0.01 * torch.randn(n, k, generator=gen)
    for row in range(n):
        at = torch.randperm(k, generator=gen)[:7]
        small = torch.randint(0, 25, (2,), generator=gen).float().exp2()
        w[row, at] = torch.cat(
            [torch.tensor([2.0**25, -(2.0**25), 1.0, 2.0**24, -(2.0**24)]), small]
        )
        w[row, at[6]] *= -1
    x = torch.ones(rows, k)
    signs = torch.randint(0, 2, (rows, k), generator=gen).float() * 2 - 1
    spread = torch.randn(rows, k, generator=gen) * torch.exp(
        3 * torch.randn(rows, k, generator=gen)
    )
    x[1::3], x[2::3] = signs[1::3], spread[2::3]
    bias = torch.randn(n, generator=gen) * 4
    return x.bfloat16(), w.bfloat16(), bias.bfloat16()


def agrees_with_torch(module: types.ModuleType) -> str | None:
    """None if the kernel equals torch's product on the probes, else what differed."""
    shapes = [(1, 64, 64), (2, 576, 200), (3, 128, 100), (6, 1536, 100), (16, 2048, 40)]
    for seed, (rows, k, n) in enumerate(shapes):
        x, w, bias = probe(rows, k, n, seed)
        for b in (None, bias):
            ours = module.linear(x, w, b)
            theirs = nn.functional.linear(x, w, b)
            if not torch.equal(ours, theirs):
                wrong = int((ours != theirs).sum())
                kind = "with" if b is not None else "without"
                return f"{wrong} of {ours.numel()} outputs differ ({rows}x{k}x{n}, {kind} bias)"
    return None


def _load(path: Path) -> None:
    try:
        module = _import(path) if path.exists() else _build(path)
    except Exception as exc:  # no compiler, no ninja, a failed build: torch's product stays
        last = (str(exc).strip().splitlines() or [""])[-1]  # a compiler's last line
        reason = f"not built ({type(exc).__name__}: {last})"
    else:
        differs = agrees_with_torch(module)
        if differs is None:
            _state["module"] = module
            logger.info("bf16 products: torch's sums, several rows at a time (%s)", NAME)
            return
        reason = f"not used: {differs}"
    _state["reason"] = reason
    logger.warning("bf16 products stay torch's own, one row at a time: %s kernel %s", NAME, reason)


def start(device: torch.device | str = "cpu") -> bool:
    """Load and check the kernel where it applies (once per process): at once when it is
    built already (milliseconds), else built in a background thread meanwhile torch's
    product serves (the same numbers). Returns whether it applies here."""
    if not applies(device):
        return False
    with _lock:
        if _state["thread"] is None:
            path = build_path()
            # Not a daemon: a process that ends during the one-time build waits for it
            # rather than tearing the compiler's import down under it.
            thread = threading.Thread(target=_load, args=(path,), name="bf16-dot-build")
            _state["thread"] = thread
            thread.start()
            if path.exists():
                thread.join()
    return True


def wait(timeout: float | None = None) -> types.ModuleType | None:
    """The kernel once built and checked (None where it is unavailable)."""
    thread = _state["thread"]
    if thread is not None:
        thread.join(timeout)
    return _state["module"]


def unavailable_reason() -> str | None:
    return _state["reason"]


def kernel() -> types.ModuleType | None:
    """The kernel if it is ready now, else None (torch's product meanwhile)."""
    return _state["module"]


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this call: bf16 operands on the CPU, a contiguous weight and
    an inner dimension that is a multiple of 64 (others keep torch's product)."""
    return (
        x.dtype is torch.bfloat16
        and weight.dtype is torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[1] % BLOCK == 0
        and weight.is_contiguous()
        and not x.requires_grad
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, with the kernel when it is ready and takes the call."""
    module = _state["module"]
    if module is None or not usable(x, weight):
        return nn.functional.linear(x, weight, bias)
    out = module.linear(x.reshape(-1, weight.shape[1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def route_linears(module: nn.Module) -> int:
    """Send every bf16 ``nn.Linear`` under ``module`` through :func:`linear`. Returns how
    many."""
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear and sub.weight.dtype is torch.bfloat16:
            sub.forward = types.MethodType(_forward, sub)
            count += 1
    return count


if __name__ == "__main__":  # ``make install``: build and check it once, ahead of any node
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not start():
        print(f"{NAME}: not needed on this machine (bf16 products are torch's own)")
    elif wait() is None:
        print(f"{NAME}: {unavailable_reason()}; nodes use torch's bf16 product")
    else:
        print(f"{NAME}: built and equal to torch's bf16 product")

"""Linear layers on FP8 and MXFP4 weights kept packed in memory (``packed.cpp``).

DeepSeek-V3/Kimi ship block-scaled float8_e4m3fn weights and gpt-oss MXFP4 experts. Kept
as they ship, a node holds a half (FP8) or a quarter (MXFP4) of the bf16 bytes; but torch
has no product on them, and its own float8 -> bf16 conversion costs ~38 ms for one
8192x2048 weight on this project's CPU (the bf16 product itself ~2 ms). So:

- few rows (decode): a fused kernel reads the packed bytes, widens them in registers and
  multiplies in float32 (one 8192x2048 weight, 1 row, 2 threads: FP8 ~1.0 ms, MXFP4
  ~0.5 ms, bf16 ``F.linear`` ~1.8 ms);
- many rows (prefill): the kernel's dequantization into a reused per-thread buffer, then
  torch's GEMM on it (bf16 where oneDNN has bf16 kernels, else float32), at about the cost
  of a bf16 layer plus one pass over the weight. Where the two cross was measured
  (``FUSED_MAX_ROWS``, ``bench/packed_kernels.py``).

Values are the checkpoints' definition: weight = code value x scale in float32, products
and sums in float32, the bias added in float32 and the result rounded once to x's dtype;
except that the many-row path on bf16 inputs multiplies the weight rounded to bf16
(torch's bf16 GEMM), as a bf16 copy of the checkpoint would. The sum order is the kernel's,
not torch's: these products equal the definition to float32 rounding, not bit for bit.

The built module holds the int8 / int4 functions too; ``intpack`` checks and serves them
apart from these.

Built once per machine like ``bf16_dot`` (docs/adr/0030): torch's extension builder into a
folder of torch's extension cache named by source, flags, CPU, torch and Python (it is
compiled for the CPU that builds it); imported at once when built, else built in a
background thread while the pure-torch fallback serves (slow: whole float32 weights per
call). Before use every function is checked against that fallback on random probes; a
machine where it cannot be built or disagrees keeps the fallback and says so once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
import types
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from meshnet_node.kernels import intpack
from meshnet_node.kernels.tolerance import close

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("packed.cpp")
# built into the same module: layer steps, the native engine's attention, a batched step's
# rows through torch's own attention (row_attention.py), and decode lanes' reads and
# fills (dataplane/lane_io.py)
PARTS = tuple(Path(__file__).with_name(f"{part}.cpp")
              for part in ("layer_step", "attention", "row_sdpa", "lane_io"))  # fmt: skip
# included by the sources: part of the build key
HEADERS = (Path(__file__).with_name("omp_for.h"), Path(__file__).with_name("fixed_order.h"))
NAME = "meshnet_packed"
# -march=native: the build runs on the machine that uses it (AVX-512 where present, else
# AVX2); the CPU's flags are part of the cache key, so a copied cache cannot mismatch.
# -ffp-contract=off: no multiply-add fused unless written (int4_dequantize equals torch's
# separate multiply and add bit for bit).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]  # torch's libgomp, already loaded (same soname), serves it

# Up to this many rows (per format and GEMM dtype) the fused kernel beats dequantizing and
# torch's GEMM, whose reuse of each weight wins above; measured on a Zen 4 (AVX-512, bf16
# GEMM by oneDNN), bench/packed_kernels.py. A float32 GEMM is half as fast as bf16 there.
FUSED_MAX_ROWS = {
    ("fp8", torch.bfloat16): 12,
    ("fp8", torch.float32): 40,
    ("mxfp4", torch.bfloat16): 12,
    ("mxfp4", torch.float32): 64,
}

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0) + (-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip

_state: dict[str, Any] = {"module": None, "thread": None, "reason": None}
_lock = threading.Lock()
_scratch = threading.local()


# -- building and loading -----------------------------------------------------------------


def applies(device: torch.device | str = "cpu") -> bool:
    """True on an x86-64 CPU, the only place the kernel is written for."""
    return torch.device(device).type == "cpu" and platform.machine().lower() in {
        "x86_64",
        "amd64",
    }


def _cpu_flags() -> bytes:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()


def build_path() -> Path:
    """Where the built module lies: one folder per source, flags, CPU, torch and Python,
    under torch's extension cache (``TORCH_EXTENSIONS_DIR``, else
    ``~/.cache/torch_extensions``)."""
    key = hashlib.sha256()
    sources = (SOURCE, *PARTS, *HEADERS)
    for part in (*(s.read_bytes() for s in sources), repr((CFLAGS, LDFLAGS)).encode(), _cpu_flags(),
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
    """Build in a folder of this process's own, then move the module into ``path`` at once:
    torch's builder locks its folder with a file that a process killed mid-build leaves
    behind, and every later build there would wait on it for ever."""
    from torch.utils import cpp_extension  # imported only to build: it pulls in setuptools

    own = path.parent / f"build-{os.getpid()}-{threading.get_ident()}"
    own.mkdir(parents=True, exist_ok=True)
    try:
        module = cpp_extension.load(
            name=path.stem, sources=[str(s) for s in (SOURCE, *PARTS)], extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS, build_directory=str(own), verbose=False,
        )  # fmt: skip
        os.replace(own / path.name, path)  # atomic: others import a whole module or build
    finally:
        shutil.rmtree(own, ignore_errors=True)
    return module


def _load(path: Path) -> None:
    try:
        module = _import(path) if path.exists() else _build(path)
    except Exception as exc:  # no compiler, no ninja, a failed build: the fallback stays
        last = (str(exc).strip().splitlines() or [""])[-1]  # a compiler's last line
        reason = f"not built ({type(exc).__name__}: {last})"
        intpack.not_built(reason)
        _state["reason"] = reason
        logger.warning("%s kernel %s: packed products stay torch's (FP8/MXFP4 slow) and "
                       "decode layer steps stay Python", NAME, reason)  # fmt: skip
        return
    else:
        intpack.install(module)
        differs = agrees_with_reference(module)
        if differs is None:
            _state["module"] = module
            logger.info("FP8/MXFP4 products on packed weights: %s kernel", NAME)
            return
        reason = f"not used: {differs}"
    _state["reason"] = reason
    logger.warning("FP8/MXFP4 products stay pure torch (slow): %s kernel %s", NAME, reason)


def start(device: torch.device | str = "cpu") -> bool:
    """Load and check the kernel (once per process): at once when it is built already,
    else built in a background thread meanwhile the fallback serves. Returns whether the
    kernel can serve this device (it still may fail to build or to check)."""
    if not applies(device):
        return False
    with _lock:
        if _state["thread"] is None:
            path = build_path()
            # Not a daemon: a process that ends during the one-time build waits for it
            # rather than tearing the compiler's import down under it.
            thread = threading.Thread(target=_load, args=(path,), name="packed-build")
            _state["thread"] = thread
            thread.start()
            if path.exists():
                thread.join()
    return True


def ready() -> bool:
    """Built, imported and checked."""
    return _state["module"] is not None


def wait(timeout: float | None = None) -> types.ModuleType | None:
    """The kernel once built and checked (None where it is unavailable)."""
    thread = _state["thread"]
    if thread is not None:
        thread.join(timeout)
    return _state["module"]


def settled() -> bool:
    """No build or check under way: what is loaded now stays (nothing, where never started)."""
    thread = _state["thread"]
    return thread is None or not thread.is_alive()


def unavailable_reason() -> str | None:
    return _state["reason"]


# -- pure-torch reference (the fallback, and what the kernel is checked against) ----------


class Reference:
    """The kernel's functions in plain torch: slow (torch converts float8 one element at a
    time, and these materialize float32 weights), but the definition."""

    lanes = 1

    @staticmethod
    def fp8_dequantize(w: Tensor, scale: Tensor, bn: int, bk: int, out: Tensor) -> None:
        n, k = w.shape
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        out.copy_(w.view(torch.float8_e4m3fn).float().mul_(full))

    @staticmethod
    def mxfp4_dequantize(blocks: Tensor, scales: Tensor, out: Tensor) -> None:
        values = torch.tensor(FP4_VALUES)
        codes = torch.stack([values[(blocks & 0x0F).long()], values[(blocks >> 4).long()]], -1)
        scale = torch.exp2(scales.float() - 127)[..., None]
        out.copy_((codes.reshape(*blocks.shape[:2], -1) * scale).reshape(out.shape))

    @staticmethod
    def fp8_linear(x: Tensor, w: Tensor, scale: Tensor, bn: int, bk: int, bias: Tensor | None):
        weight = torch.empty(w.shape, dtype=torch.float32)
        Reference.fp8_dequantize(w, scale, bn, bk, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def mxfp4_linear(x: Tensor, blocks: Tensor, scales: Tensor, bias: Tensor | None):
        weight = torch.empty(blocks.shape[0], blocks.shape[1] * 32, dtype=torch.float32)
        Reference.mxfp4_dequantize(blocks, scales, weight)
        return F.linear(x, weight, bias)


def _impl(module: Any = None) -> Any:
    return module or _state["module"] or Reference


# -- the public functions ----------------------------------------------------------------


def _buffer(n: int, k: int, dtype: torch.dtype) -> Tensor:
    """A per-thread scratch weight: a fresh 32 MB tensor per call costs ~20 ms of page
    faults here, more than the product."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    flat = buffers.get(dtype)
    if flat is None or flat.numel() < n * k:
        flat = buffers[dtype] = torch.empty(n * k, dtype=dtype)
    return flat[: n * k].view(n, k)


def _bytes(t: Tensor) -> Tensor:
    t = t.view(torch.uint8) if t.dtype is not torch.uint8 else t
    return t.contiguous()


def _gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """bf16 GEMM where oneDNN has bf16 kernels; elsewhere (AVX2 CPUs) torch's bf16 product
    is one dot product per output, and float32 GEMM is the faster one."""
    if dtype is torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return dtype
    return torch.float32


def _linear(
    x: Tensor, n: int, k: int, fmt: str, fused, dequantize, bias: Tensor | None, force: bool | None
) -> Tensor:
    """Few rows (or ``force=True``): the fused product in float32. Many (or ``force=False``):
    dequantize into the scratch buffer and torch's GEMM."""
    rows = x.reshape(-1, k)
    gemm = _gemm_dtype(x.dtype)
    if force if force is not None else rows.shape[0] <= FUSED_MAX_ROWS[fmt, gemm]:
        b = None if bias is None else bias.float().contiguous()
        y = fused(rows.float().contiguous(), b).to(x.dtype)
    else:
        weight = _buffer(n, k, gemm)
        dequantize(weight)
        y = F.linear(rows.to(gemm), weight, None if bias is None else bias.to(gemm)).to(x.dtype)
    return y.view(*x.shape[:-1], n)


def fp8_linear(
    x: Tensor, weight: Tensor, scale_inv: Tensor, block: tuple[int, int], bias: Tensor | None = None,
    *, fused: bool | None = None, _module: Any = None,
) -> Tensor:  # fmt: skip
    """``x @ dequant(weight).T + bias`` for a float8_e4m3fn ``weight`` [N, K] (or its bytes
    as uint8) with float32 ``scale_inv`` [ceil(N/bn), ceil(K/bk)], ``block`` = (bn, bk).

    ``fused``: None picks the faster path by the number of rows; True forces the fused
    kernel, whose every row's result is independent of the other rows in the call (a
    batched decode step equals its rows alone); False forces dequantize + GEMM."""
    impl, w, s = _impl(_module), _bytes(weight), scale_inv.float().contiguous()
    n, k = w.shape
    bn, bk = int(block[0]), int(block[1])
    return _linear(
        x, n, k, "fp8",
        lambda rows, b: impl.fp8_linear(rows, w, s, bn, bk, b),
        lambda out: impl.fp8_dequantize(w, s, bn, bk, out),
        bias, fused,
    )  # fmt: skip


def fp8_dequantize(
    weight: Tensor, scale_inv: Tensor, block: tuple[int, int], out: Tensor, *, _module: Any = None
) -> Tensor:
    """The dequantized weight written into ``out`` ([N, K], bf16 or float32)."""
    w = _bytes(weight)
    _impl(_module).fp8_dequantize(w, scale_inv.float().contiguous(), block[0], block[1], out)
    return out


def mxfp4_linear(
    x: Tensor, blocks: Tensor, scales: Tensor, bias: Tensor | None = None,
    *, fused: bool | None = None, _module: Any = None,
) -> Tensor:  # fmt: skip
    """``x @ dequant(weight).T + bias`` for one MXFP4 weight: ``blocks`` uint8 [N, K/32, 16]
    (two E2M1 codes a byte, low nibble first), ``scales`` uint8 [N, K/32] (E8M0, bias 127).
    ``fused`` as in :func:`fp8_linear`."""
    impl, b8, e8 = _impl(_module), blocks.contiguous(), scales.contiguous()
    n, k = b8.shape[0], b8.shape[1] * 32
    return _linear(
        x, n, k, "mxfp4",
        lambda rows, b: impl.mxfp4_linear(rows, b8, e8, b),
        lambda out: impl.mxfp4_dequantize(b8, e8, out),
        bias, fused,
    )  # fmt: skip


def mxfp4_dequantize(blocks: Tensor, scales: Tensor, out: Tensor, *, _module: Any = None) -> Tensor:
    """The dequantized [N, K] weight written into ``out`` (bf16 or float32)."""
    _impl(_module).mxfp4_dequantize(blocks.contiguous(), scales.contiguous(), out)
    return out


# -- the check before use ----------------------------------------------------------------


def fp8_probe(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[Tensor, Tensor]:
    """Random e4m3fn bytes (every code but NaN, subnormals included) and scales."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    w[(w & 0x7F) == 0x7F] = 0x7E  # NaN never occurs in a checkpoint
    grid = (-(-n // block[0]), -(-k // block[1]))
    return w, torch.rand(grid, generator=gen) * 1e-3 + 1e-4


def mxfp4_probe(n: int, k: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8)
    return blocks, torch.randint(110, 135, (n, k // 32), generator=gen, dtype=torch.uint8)


def agrees_with_reference(module: Any) -> str | None:
    """None if every function of ``module`` equals the reference's on the probes (the
    dequantizations bit for bit), else what differed."""
    fp8_shapes = [(576, 320, (128, 128)), (100, 77, (128, 128)), (256, 512, (128, 128)), (70, 200, (32, 48))]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for seed, (n, k, block) in enumerate(fp8_shapes):
        w, s = fp8_probe(n, k, block, seed)
        ref = torch.empty(n, k)
        Reference.fp8_dequantize(w, s, *block, ref)
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(n, k, dtype=dtype)
            if not torch.equal(fp8_dequantize(w, s, block, out, _module=module), ref.to(dtype)):
                return f"FP8 dequantization differs ({n}x{k}, {dtype})"
        for rows, dtype, bias in _cases(n, gen):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            if not close(fp8_linear(x, w, s, block, bias, _module=module), x, ref, bias):
                return f"FP8 product differs ({rows}x{k}x{n}, {dtype})"
    for seed, (n, k) in enumerate([(96, 64), (40, 2880), (33, 32)]):
        blocks, scales = mxfp4_probe(n, k, seed)
        ref = torch.empty(n, k)
        Reference.mxfp4_dequantize(blocks, scales, ref)
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(n, k, dtype=dtype)
            if not torch.equal(mxfp4_dequantize(blocks, scales, out, _module=module), ref.to(dtype)):  # fmt: skip
                return f"MXFP4 dequantization differs ({n}x{k}, {dtype})"
        for rows, dtype, bias in _cases(n, gen):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            if not close(mxfp4_linear(x, blocks, scales, bias, _module=module), x, ref, bias):
                return f"MXFP4 product differs ({rows}x{k}x{n}, {dtype})"
    return None


def _cases(n: int, gen: torch.Generator):
    bias = torch.randn(n, generator=gen)
    # both paths and every tile size; with and without bias
    for i, rows in enumerate((1, 3, 6, 13, 17, 33, 65)):
        for dtype in (torch.float32, torch.bfloat16):
            yield rows, dtype, (bias.to(dtype) if i % 2 == 0 else None)


if __name__ == "__main__":  # ``make install``: build and check it once, ahead of any node
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not start():
        print(f"{NAME}: not for this machine (FP8/MXFP4 products stay pure torch, slow)")
    elif wait() is None:
        print(f"{NAME}: {unavailable_reason()}; FP8/MXFP4 products stay pure torch (slow)")
    else:
        print(f"{NAME}: built and equal to the reference")
    if wait() is not None:
        state = "checked" if intpack.ready() else intpack.unavailable_reason()
        print(f"{NAME} int8/int4: {state}")

"""int8 / int4 products on packed weights and the unpacking of torch's CPU int4 packing.

Few rows: ``int8_linear`` / ``int4_linear`` replace torch's ``_weight_int8pack_mm`` /
``_weight_int4pack_mm_for_cpu`` (a GEMV per row) with tiles of rows that share each decoded
weight byte (bf16 rows multiplied by AVX-512 BF16's ``vdpbf16ps`` where the CPU has it);
each output is summed in a fixed order whatever the rows and threads, so a row alone equals
the row in a batch bit for bit. Many rows: ``int4_dequantize`` unpacks torch's packing in one
pass, bit for bit what ``out.copy_(codes).sub_(8).mul_(scale).add_(zero)`` gives in
``out``'s dtype, for the dtype's GEMM.

The functions live in the same built module as the FP8/MXFP4 kernels (``packed.cpp``, built
and loaded by ``packed``), but are checked apart (``install``): either set may serve without
the other. Until checked, or where refused, torch's kernels and a pure-torch unpacking
serve (``TorchLowbit``), with the same values to float32 rounding.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from meshnet_node.kernels.tolerance import close, near

logger = logging.getLogger(__name__)

Q8_BLOCK = 32  # inputs per scale in llama.cpp's Q8_0
Q6_K_BLOCK = 16  # inputs per scale in Q6_K's sub-blocks

_state: dict[str, Any] = {"module": None, "reason": None}


def ready() -> bool:
    """The int8 / int4 functions built, imported and checked (else torch's kernels serve)."""
    return _state["module"] is not None


def module() -> types.ModuleType | None:
    """The built module whose int8/int4 functions were checked (None until then)."""
    return _state["module"]


def unavailable_reason() -> str | None:
    return _state["reason"]


def not_built(reason: str) -> None:
    _state["reason"] = reason


def install(module: types.ModuleType) -> None:
    """Serve with ``module``'s functions if they agree with torch's on the probes. One log
    line either way."""
    try:
        differs = agrees_with_reference(module)
    except Exception as exc:  # an older build without the functions, a failed probe
        differs = f"{type(exc).__name__}: {exc}"
    if differs is None:
        _state["module"] = module
        logger.info("int8/int4 products and int4 unpacking: %s kernel", module.__name__)
    else:
        _state["reason"] = f"not used: {differs}"
        logger.warning("int8/int4 products stay torch's kernels: kernel not used: %s", differs)


class TorchLowbit:
    """The fallback and the reference: torch's kernels, and the pure-torch unpacking."""

    @staticmethod
    def int8_linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, q, scale.to(x.dtype))

    @staticmethod
    def int4_linear(x: Tensor, packed: Tensor, scale_zero: Tensor, group: int, block_n: int):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zero.to(x.dtype))

    @staticmethod
    def q8_linear(x: Tensor, q: Tensor, d: Tensor, z: Tensor | None = None) -> Tensor:
        """The definition: the float32 matrix, ``q * d (+ z)`` per block of inputs."""
        n, k = q.shape
        w = q.float().view(n, d.shape[1], -1) * d[..., None]
        if z is not None:
            w = w + z[..., None]
        return F.linear(x.float(), w.view(n, k)).to(x.dtype)

    @staticmethod
    def int4_dequantize(packed: Tensor, scale_zero: Tensor, group: int, block_n: int, out: Tensor):
        n, k = out.shape
        v = packed.reshape(n // block_n, k, block_n // 2)
        codes = torch.cat([v & 15, v >> 4], dim=2).transpose(1, 2).reshape(n, k)
        out.copy_(codes)
        grouped = out.view(n, k // group, group)
        sz = scale_zero.to(out.dtype)
        grouped.sub_(8).mul_(sz[:, :, 0].t()[..., None]).add_(sz[:, :, 1].t()[..., None])


_int4_blocks: dict[int, int | None] = {}


def int4_block_n(n: int) -> int | None:
    """The rows per block of torch's CPU int4 packing for ``n`` output rows (64 on AVX-512
    for n % 64 == 0), found by packing a probe; None: no layout this module knows."""
    if n not in _int4_blocks:
        k = 64
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator())
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        found = None
        for block in (64, 32, 16):
            if n % block == 0 and packed.numel() * 2 == n * k:
                v = packed.reshape(n // block, k, block // 2)
                got = torch.cat([v & 15, v >> 4], dim=2).transpose(1, 2).reshape(n, k)
                if torch.equal(got, codes.to(torch.uint8)):
                    found = block
                    break
        _int4_blocks[n] = found
    return _int4_blocks[n]


def _lowbit(module: Any, device: torch.device) -> Any:
    """The checked kernel on a CPU tensor; torch's functions elsewhere (CUDA included)."""
    return module or (device.type == "cpu" and _state["module"]) or TorchLowbit


def int8_linear(x: Tensor, q: Tensor, scale: Tensor, *, _module: Any = None) -> Tensor:
    """``x @ (q * scale[:, None]).T`` in ``x``'s dtype: ``q`` int8 [N, K], ``scale`` [N]
    (bf16 or float32). Rows independent of each other (any row count)."""
    impl = _lowbit(_module, x.device)
    n, k = q.shape
    rows = x.reshape(-1, k)
    if impl is TorchLowbit:
        y = impl.int8_linear(rows, q, scale)
    else:
        xin = rows.contiguous() if rows.dtype is torch.bfloat16 else rows.float().contiguous()
        y = impl.int8_linear(xin, q.contiguous(), scale.contiguous()).to(x.dtype)
    return y.view(*x.shape[:-1], n)


def q8_linear(
    x: Tensor, q: Tensor, d: Tensor, z: Tensor | None = None, *, _module: Any = None
) -> Tensor:
    """``x @ W.T`` in ``x``'s dtype for int8 codes in blocks: ``q`` int8 [N, K], ``d``
    float32 [N, K / B], ``W = q * d`` per B inputs, B = 32 (llama.cpp's Q8_0, ``d`` its f16
    scales) or 16 (Q6_K's sub-blocks, ``d`` each one's f16 times its int8 scale); with
    zeros ``z`` (float32, ``d``'s shape) ``W = q * d + z`` (Q5_1, Q5_K). Rows independent of
    each other."""
    impl = _lowbit(_module, x.device)
    n, k = q.shape
    rows = x.reshape(-1, k)
    if impl is TorchLowbit:
        y = impl.q8_linear(rows, q, d, z)
    else:
        xin = rows.contiguous() if rows.dtype is torch.bfloat16 else rows.float().contiguous()
        y = impl.q8_linear(xin, q, d, z).to(x.dtype)
    return y.view(*x.shape[:-1], n)


def int4_linear(
    x: Tensor, packed: Tensor, scale_zero: Tensor, group: int, block_n: int | None,
    *, _module: Any = None,
) -> Tensor:  # fmt: skip
    """``x @ W.T`` in ``x``'s dtype for int4 in torch's CPU packing (``packed`` from
    ``_convert_weight_to_int4pack_for_cpu``, ``block_n`` rows a block: ``int4_block_n``),
    ``scale_zero`` [K/group, N, 2] (bf16, float32, or float16 for float32 rows). Rows
    independent of each other."""
    impl = _lowbit(_module, x.device)
    if block_n not in getattr(impl, "int4_blocks", ()):  # a layout the kernel does not read
        impl = TorchLowbit
    n, k = scale_zero.shape[1], scale_zero.shape[0] * group
    rows = x.reshape(-1, k)
    if impl is TorchLowbit:
        y = impl.int4_linear(rows, packed, scale_zero, group, block_n)
    else:
        # bf16 rows go in as they are (products of bf16 pairs, exact, summed in float32)
        xin = rows.contiguous() if rows.dtype is torch.bfloat16 else rows.float().contiguous()
        sz = scale_zero.contiguous()  # a stacked weight's part: a strided view
        y = impl.int4_linear(xin, packed, sz, group, block_n).to(x.dtype)
    return y.view(*x.shape[:-1], n)


def int4_dequantize(
    packed: Tensor, scale_zero: Tensor, group: int, block_n: int, out: Tensor,
    *, _module: Any = None,
) -> Tensor:  # fmt: skip
    """The [N, K] weight written into ``out`` (bf16 or float32), bit for bit what
    ``TorchLowbit.int4_dequantize`` computes (scale and zero in ``out``'s dtype)."""
    _lowbit(_module, out.device).int4_dequantize(
        packed, scale_zero.contiguous(), group, block_n, out
    )
    return out


def int4_probe(
    n: int, k: int, group: int, dtype: torch.dtype, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Random codes [N, K] (int32), their torch packing and scale_zero in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale = (torch.rand(k // group, n, generator=gen) * 0.02 + 1e-3).to(dtype)
    zero = (torch.randn(k // group, n, generator=gen) * 0.05).to(dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return codes, packed, torch.stack([scale, zero], dim=-1).contiguous()


def int4_weight(codes: Tensor, scale_zero: Tensor, group: int) -> Tensor:
    """W [N, K] in float64 from the codes: (code - 8) * scale + zero, exactly."""
    n, k = codes.shape
    sz = scale_zero.double()
    s = sz[:, :, 0].t().repeat_interleave(group, 1)
    z = sz[:, :, 1].t().repeat_interleave(group, 1)
    return (codes.double() - 8) * s + z


def int8_probe(n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return q, (torch.rand(n, generator=gen) * 0.01 + 1e-4).to(dtype)


def agrees_with_reference(module: Any) -> str | None:
    """None if ``module``'s int8 / int4 / Q8 functions agree with torch's on probes: the int4
    unpacking bit for bit, the products within float32 rounding of the exact one and of
    torch's kernel, each row alone bit-equal to the rows together. Where the module takes
    rows as two int8 digits (``int4_vnni``, ADR-0045), int4 and Q8 products within their
    bound (``tolerance.digits_bound``)."""
    digits = takes_digits(module)
    gen = torch.Generator().manual_seed(1)
    for seed, (n, k, group) in enumerate([(128, 64, 32), (192, 256, 64), (64, 256, 128), (576, 128, 64)]):  # fmt: skip
        block_n = int4_block_n(n)
        if block_n is None:
            return f"torch's int4 packing of {n} rows is not one this module knows"
        for dtype in (torch.float32, torch.bfloat16, torch.float16):  # of the scales; float16
            codes, pk, sz = int4_probe(n, k, group, dtype, seed)  # serves float32 rows
            for out_dtype in (torch.float32, torch.bfloat16):
                ref = torch.empty(n, k, dtype=out_dtype)
                TorchLowbit.int4_dequantize(pk, sz, group, block_n, ref)
                out = torch.empty(n, k, dtype=out_dtype)
                if not torch.equal(int4_dequantize(pk, sz, group, block_n, out, _module=module), ref):  # fmt: skip
                    return f"int4 unpacking differs ({n}x{k}, group {group}, {dtype} -> {out_dtype})"  # fmt: skip
            weight = int4_weight(codes, sz, group)
            x = torch.randn(9, k, generator=gen).to(
                torch.bfloat16 if dtype is torch.bfloat16 else torch.float32
            )
            ours = int4_linear(x, pk, sz, group, block_n, _module=module)
            theirs = TorchLowbit.int4_linear(x, pk, sz, group, block_n)
            if not (close(ours, x, weight, None, digits=digits)
                    and near(ours, theirs, x, weight, digits=digits)):  # fmt: skip
                return f"int4 product differs ({n}x{k}, group {group}, {dtype})"
            alone = [int4_linear(x[i : i + 1], pk, sz, group, block_n, _module=module) for i in range(len(x))]  # fmt: skip
            if not torch.equal(torch.cat(alone), ours):
                return f"int4 product: rows alone differ from rows together ({n}x{k})"
    # K a multiple of 32: torch 2.13's bf16 _weight_int8pack_mm crashes on K = 200 or 33
    for seed, (n, k) in enumerate([(96, 64), (40, 192), (576, 576), (17, 96)]):
        for dtype in (torch.float32, torch.bfloat16):
            q, scale = int8_probe(n, k, dtype, seed)
            weight = q.double() * scale.double()[:, None]
            x = torch.randn(9, k, generator=gen).to(dtype)
            ours = int8_linear(x, q, scale, _module=module)
            theirs = TorchLowbit.int8_linear(x, q, scale)
            if not (close(ours, x, weight, None) and near(ours, theirs, x, weight)):
                return f"int8 product differs ({n}x{k}, {dtype})"
            alone = [int8_linear(x[i : i + 1], q, scale, _module=module) for i in range(len(x))]
            if not torch.equal(torch.cat(alone), ours):
                return f"int8 product: rows alone differ from rows together ({n}x{k})"
        # Q8_0's blocks and Q6_K's sub-blocks, and blocks of 32 with zeros (Q5_1, Q5_K)
        for block, zeros in ((Q8_BLOCK, False), (Q6_K_BLOCK, False), (Q8_BLOCK, True)):
            q, d = q8_probe(n, k, seed, block)
            z = (torch.rand(d.shape, generator=gen) - 0.5) * 0.01 if zeros else None
            weight = q.double() * d.double().repeat_interleave(block, 1)
            if z is not None:
                weight = weight + z.double().repeat_interleave(block, 1)
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(9, k, generator=gen).to(dtype)
                ours = q8_linear(x, q, d, z, _module=module)
                theirs = TorchLowbit.q8_linear(x, q, d, z)
                if not (close(ours, x, weight, None, digits=digits)
                        and near(ours, theirs, x, weight, digits=digits)):  # fmt: skip
                    return f"Q8 product differs ({n}x{k}, blocks of {block}, {dtype})"
                alone = [q8_linear(x[i : i + 1], q, d, z, _module=module) for i in range(len(x))]
                if not torch.equal(torch.cat(alone), ours):
                    return f"Q8 product: rows alone differ from rows together ({n}x{k}, {block})"
    return None


def takes_digits(module: Any) -> bool:
    """Whether ``module``'s int4 and Q8 products take bf16 and float32 rows as two int8
    digits per 32 inputs (AVX-512 VNNI and VBMI here, ADR-0045)."""
    return bool(getattr(module, "int4_vnni", False))


def q8_probe(n: int, k: int, seed: int, block: int = Q8_BLOCK) -> tuple[Tensor, Tensor]:
    """Random int8 codes [N, K] and f16 scales (as float32) [N, K / block]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return q, (torch.rand(n, k // block, generator=gen) * 0.01 + 1e-4).half().float()

"""int4 products on a GPU through torch's weight-only int4 kernel (tinygemm; docs/adr/0055).

On CPU an ``Int4Weight`` is read by meshnet's tiles (``kernels.intpack``). Moved to a GPU as
it is, each product unpacked the whole matrix into bf16 and ran a GEMM: more bytes read
than bf16 weights (25.9 tok/s against 34-42 for bf16, issue 54). ``to_tinygemm`` re-lays the
same codes, scales and zeros once at load into ``aten._convert_weight_to_int4pack``'s tiles,
and every product is then ``aten._weight_int4pack_mm``, which reads the 4-bit codes.

The same numbers, by the kernels' contract: both torch kernels compute
``W[n, k] = (q - 8) * scale + zero`` per group of ``group`` inputs, with ``scale_zero``
``[in / group, out, 2]`` — the form ``Int4Weight`` already holds (``lowbit.packed``). The
codes come back exactly: unpacking with scale 1 and zero 8 gives ``q`` itself. Only bf16
weights qualify (the CUDA kernel takes bf16 rows and scales); float16 or float32 stages keep
the unpacking path.

A device is trusted once: ``TinygemmCheck`` runs one product of random rows against the
dequantized matrix on it before any weight is converted; an error, or a result out of
tolerance, keeps every weight as it was and says so in the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshnet_node.kernels import intpack
from meshnet_node.lowbit.modules import PackedLinear
from meshnet_node.lowbit.packed import Int4Weight

logger = logging.getLogger(__name__)

GROUPS = (32, 64, 128, 256)  # the group sizes both kernels take
ROWS_MULTIPLE = 8  # output rows a tile holds


@dataclass(frozen=True)
class TinygemmOps:
    """The pair of torch operators for one device kind: pack codes, multiply. CUDA's packs
    two codes a byte (the even input in the high nibble); the CPU pair, which computes the
    same function, packs int32 codes and lets the conversion be tested without a GPU."""

    pack: Any
    mm: Any
    nibbles: bool

    @classmethod
    def for_device(cls, device: torch.device) -> TinygemmOps:
        aten = torch.ops.aten
        if device.type == "cpu":
            return cls(aten._convert_weight_to_int4pack_for_cpu, aten._weight_int4pack_mm_for_cpu, False)  # fmt: skip
        return cls(aten._convert_weight_to_int4pack, aten._weight_int4pack_mm, True)


def inner_k_tiles(k: int) -> int | None:
    """The widest tiling of ``k`` inputs the packing takes (8, 4 or 2 tiles of 16), None
    where none divides it."""
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` codes 0..15 -> ``[n, k / 2]`` uint8, input ``2i`` in the high nibble and
    ``2i + 1`` in the low one (what ``aten._convert_weight_to_int4pack`` reads)."""
    codes = codes.to(torch.int32)
    return ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()


def codes_of(weight: Int4Weight) -> torch.Tensor:
    """The ``[n, k]`` int32 codes of ``weight``, exactly: its unpacking with every scale 1
    and zero 8 is ``(q - 8) * 1 + 8 = q``."""
    n, k = weight.out_features, weight.in_features
    unit = torch.empty(k // weight.group, n, 2, dtype=torch.float32, device=weight.packed.device)
    unit[..., 0], unit[..., 1] = 1.0, 8.0
    out = torch.empty(n, k, dtype=torch.float32, device=weight.packed.device)
    block = intpack.int4_block_n(n)
    if block is not None:
        intpack.int4_dequantize(weight.packed, unit, weight.group, block, out)
    else:  # a layout no kernel unpacks: torch's own product on the identity (CPU only)
        out.copy_(Int4Weight(weight.packed, unit, weight.group, (n, k)).dequantize())
    return out.round_().to(torch.int32)


class TinygemmInt4:
    """A packed int4 weight in torch's weight-only kernel's tiles (``fmt`` "int4", as
    ``Int4Weight``): ``matmul(x)`` is ``x @ W.T`` in ``x``'s dtype, computed on bf16 rows."""

    fmt = "int4"

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, shape,
                 ops: TinygemmOps) -> None:  # fmt: skip
        self.packed, self.scale_zero, self.group, self.ops = packed, scale_zero, group, ops
        self.out_features, self.in_features = shape

    @classmethod
    def convertible(cls, weight: Any) -> bool:
        """Whether ``weight`` can be held this way: an ``Int4Weight`` in bf16 whose shape and
        group both kernels take."""
        return (
            isinstance(weight, Int4Weight)
            and weight.scale_zero.dtype is torch.bfloat16
            and weight.group in GROUPS
            and weight.out_features % ROWS_MULTIPLE == 0
            and weight.in_features % weight.group == 0
            and inner_k_tiles(weight.in_features) is not None
            # its codes unpack on the device (a layout only torch's CPU op reads does not)
            and (
                weight.packed.device.type == "cpu"
                or intpack.int4_block_n(weight.out_features) is not None
            )
        )

    @classmethod
    def from_int4(cls, weight: Int4Weight, ops: TinygemmOps) -> TinygemmInt4:
        codes = codes_of(weight)
        tiles = inner_k_tiles(weight.in_features)
        packed = ops.pack(pack_nibbles(codes) if ops.nibbles else codes, tiles)
        shape = (weight.out_features, weight.in_features)
        return cls(packed, weight.scale_zero.contiguous(), weight.group, shape, ops)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scale_zero": self.scale_zero}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = self.ops.mm(rows, self.packed, self.group, self.scale_zero)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix (tests and checks): the product with the identity, each output one
        weight, rounded to bf16 as the kernel's outputs are."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        return self.ops.mm(eye, self.packed, self.group, self.scale_zero).t().to(dtype)


class TinygemmCheck:
    """Whether torch's int4 kernel runs, and agrees with the unpacked matrix, on a device:
    asked once per device kind and remembered."""

    def __init__(self) -> None:
        self._known: dict[str, bool] = {}

    def works(self, device: torch.device) -> bool:
        if device.type not in self._known:
            self._known[device.type] = self._probe(device)
        return self._known[device.type]

    @staticmethod
    def _probe(device: torch.device) -> bool:
        gen = torch.Generator().manual_seed(0)
        n, k, group = 64, 256, 64
        codes, packed, scale_zero = intpack.int4_probe(n, k, group, torch.bfloat16, seed=0)
        x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
        want = x.double() @ intpack.int4_weight(codes, scale_zero, group).t()
        try:
            moved = Int4Weight(packed.to(device), scale_zero.to(device), group, (n, k))
            got = TinygemmInt4.from_int4(moved, TinygemmOps.for_device(device)).matmul(x.to(device))
            got = got.double().cpu()
        except Exception as exc:  # an operator this build or device lacks
            logger.warning("int4 on %s keeps unpacking per product: torch's int4 kernel "
                           "failed its check (%s)", device, exc)  # fmt: skip
            return False
        err = float((got - want).abs().max())
        scale = float(want.abs().max())
        if err > 0.02 * scale:  # bf16 rows and outputs: well within; a wrong layout is not
            logger.warning("int4 on %s keeps unpacking per product: torch's int4 kernel is "
                           "off by %.3g (of %.3g) on a probe", device, err, scale)  # fmt: skip
            return False
        return True


tinygemm_check = TinygemmCheck()


def to_tinygemm(
    modules: nn.Module, device: torch.device, *, check: TinygemmCheck | None = None
) -> int:
    """Hold every convertible int4 ``PackedLinear`` of ``modules`` (already on ``device``)
    in torch's int4 kernel's tiles; returns how many. Nothing changes where the device's
    check fails."""
    linears = [m for m in modules.modules()
               if isinstance(m, PackedLinear) and TinygemmInt4.convertible(m.packed)]  # fmt: skip
    if not linears or not (check or tinygemm_check).works(device):
        return 0
    ops = TinygemmOps.for_device(device)
    for module in linears:
        module.hold(TinygemmInt4.from_int4(module.packed, ops))
    return len(linears)

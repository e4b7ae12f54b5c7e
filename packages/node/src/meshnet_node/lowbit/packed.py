"""Weights held packed (int8, int4, FP8, MXFP4) and multiplied without unpacking them for good.

Every packed weight is one matrix ``[out, in]`` (a Linear's layout) with a ``matmul(x)``
that returns ``x @ W.T`` in ``x``'s dtype. Two ways to compute it (docs/adr/0031):

- **few rows** (a decode step, a batch of sessions, a verification pass): a weight-only
  kernel that reads the packed bytes — meshnet's int8 / int4 tiles
  (``meshnet_node.kernels.intpack``; torch's ``_weight_int8pack_mm`` /
  ``_weight_int4pack_mm_for_cpu`` where they are not built) and FP8 / MXFP4 kernels
  (``meshnet_node.kernels.packed``). Each output row depends on its input row alone, so a
  session gives the same numbers alone, batched or replayed.
- **a prompt chunk of many rows**: dequantize into a reused scratch matrix and run the
  compute dtype's GEMM. The low-bit kernels cost ~one GEMV per row, 2-4x bf16's GEMM at 64+
  rows. Only ``Stage._forward`` (one session's chunk) allows this path (``prompt_calls``):
  a chunk is computed with the same arithmetic every time it runs (failover replays the
  same chunks), while a decode row never depends on how many sessions share its pass.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from meshnet_common.precision import int4_group
from meshnet_node.kernels import intpack
from meshnet_node.kernels.row_stable import prompt_rows

# Above this many rows a prompt chunk dequantizes and uses the GEMM, per format. Measured on
# a Zen 4 EPYC (AVX-512 BF16, 2 threads, bf16, 8192x2048 and 1536x576): meshnet's int4 tile
# kernel beats unpacking + bf16 GEMM up to ~128 rows (3.5 vs 8.0 ms at 32 rows, equal at 128),
# its int8 kernel up to ~48 (5.6 vs 6.4 ms at 32, 9.9 vs 8.5 at 64); FP8/MXFP4 as
# ``kernels.packed.FUSED_MAX_ROWS``.
WIDE_ROWS = {"int8": 48, "int4": 96, "packed": 16}
INT4_TILE = 16  # torch's int4 packing needs output widths divisible by this

_wide_ok: contextvars.ContextVar[bool] = contextvars.ContextVar("lowbit_wide_ok", default=False)
_scratch = threading.local()


@contextlib.contextmanager
def prompt_calls(chunk: int = 0) -> Iterator[None]:
    """Within: one session's pass, whose calls of more than ``WIDE_ROWS`` rows may take the
    dequantize + GEMM path; ``chunk`` > 0: a prompt's, whose dense products are one call
    per wire chunk of ``chunk`` rows (``row_stable.prompt_rows``, ADR-0038)."""
    token = _wide_ok.set(True)
    try:
        with prompt_rows(chunk):
            yield
    finally:
        _wide_ok.reset(token)


def wide_call(x: torch.Tensor, fmt: str = "packed") -> bool:
    """True for a call that may unpack for a GEMM: a long chunk inside ``prompt_calls``."""
    return x.shape[0] > WIDE_ROWS[fmt] and _wide_ok.get()


def scratch(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused per-thread matrix of ``shape``: allocating a fresh one per call costs page
    faults that outweigh the product (~20 ms for 32 MB here)."""
    key = (dtype, device)
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    numel = shape[0] * shape[1]
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


Rows = torch.Tensor | list[torch.Tensor]  # a matrix, or row blocks stacked (gate over up)
# A chunk of int4 rows: (first row, codes [rows, in] int32 0..15, scale and zero [rows, groups])
Codes = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]


def _parts(weight: Rows) -> list[torch.Tensor]:
    return weight if isinstance(weight, list) else [weight]


def _shape(weight: Rows) -> tuple[int, int]:
    parts = _parts(weight)
    return sum(p.shape[0] for p in parts), parts[0].shape[1]


def _rows_chunked(weight: Rows, rows: int = 256) -> Iterator[tuple[int, torch.Tensor]]:
    """Row blocks of ``weight`` in float32, across its parts: quantizing a whole matrix at
    once would hold float32 temporaries of it (several times its bf16 bytes) at load, and
    stacking parts first a 16-bit copy; 256 rows keep both to a few MB."""
    offset = 0
    for part in _parts(weight):
        for start in range(0, part.shape[0], rows):
            yield offset + start, part[start : start + rows].to(torch.float32, copy=True)
        offset += part.shape[0]


class PackedWeight(Protocol):
    """A matrix ``[out, in]`` in a packed format (``Int8Weight``, ``Int4Weight``, the shipped
    formats of ``lowbit.shipped``); each owns its tensors, named as its attributes."""

    fmt: str
    out_features: int
    in_features: int

    def tensors(self) -> dict[str, torch.Tensor]: ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for 2-D ``x`` (rows, in), in ``x.dtype``."""
        ...

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix the packed bytes stand for (a fresh tensor; tests and references)."""
        ...


def packed_bytes(weight: PackedWeight) -> int:
    """The bytes a packed weight's tensors hold."""
    return sum(t.numel() * t.element_size() for t in weight.tensors().values())


class Int8Weight:
    """Per-output-channel symmetric int8: ``W[n, k] = q[n, k] * scale[n]``."""

    fmt = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.q, self.scale = q, scale  # (N, K) int8, (N,) compute dtype
        self.out_features, self.in_features = q.shape

    @classmethod
    def quantize(cls, weight: Rows, dtype: torch.dtype) -> Int8Weight:
        q = torch.empty(_shape(weight), dtype=torch.int8)
        scale = torch.empty(q.shape[0], dtype=dtype)
        for start, block in _rows_chunked(weight):
            s = (block.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(dtype)  # (rows,)
            scale[start : start + len(block)] = s
            q[start : start + len(block)] = torch.round(block / s.float()[:, None]).clamp(-127, 127)
        return cls(q, scale)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"q": self.q, "scale": self.scale}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and not wide_call(x, self.fmt):
            return intpack.int8_linear(x, self.q, self.scale)
        w = scratch(tuple(self.q.shape), x.dtype, x.device)
        w.copy_(self.q)  # exact: int8 values are integers every float dtype holds
        return F.linear(x, w) * self.scale.to(x.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale.float()[:, None]).to(dtype)


class Int4Weight:
    """Group-wise asymmetric int4 in torch's CPU packing: ``W[n, k] = (q - 8) * scale + zero``
    per group of ``group`` inputs, ``scale_zero`` ``[in / group, out, 2]`` in the compute dtype
    (``aten._weight_int4pack_mm_for_cpu``'s form), or in float16 where a float32 one holds
    only float16 values (``narrowed``: half the bytes, the same numbers)."""

    fmt = "int4"

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, shape) -> None:
        self.packed, self.scale_zero, self.group = packed, scale_zero, group
        self.out_features, self.in_features = shape

    @staticmethod
    def group_for(shape: tuple[int, int], group: int) -> int | None:
        """The group a ``[out, in]`` weight packs in when ``group`` is asked (a narrower one
        where it does not divide ``in``: ``int4_group``); None: int4 cannot hold it."""
        return int4_group(shape[1], group) if shape[0] % INT4_TILE == 0 else None

    @classmethod
    def quantize(cls, weight: Rows, group: int, dtype: torch.dtype) -> Int4Weight:
        """Round ``weight`` to 16 levels per group between its minimum and maximum."""
        aligned = all(p.shape[0] % 256 == 0 for p in _parts(weight))
        chunks = quantized_chunks(weight, group, dtype)
        return cls.from_codes(chunks, _shape(weight), group, dtype, aligned=aligned)

    @classmethod
    def from_codes(
        cls, chunks: Iterable[Codes], shape: tuple[int, int], group: int, dtype: torch.dtype,
        *, aligned: bool,
    ) -> Int4Weight:  # fmt: skip
        """Pack row chunks of codes (0..15) with their scales and zeros ``[rows, in / group]``
        (quantized here, or taken from a checkpoint's blocks). ``aligned``: every chunk is
        256 rows, so each may pack alone."""
        n, k = shape
        scale_zero = torch.empty(k // group, n, 2, dtype=dtype)
        # torch packs rows in blocks of its choosing; where whole chunks pack to the matching
        # slice of the whole (checked once: ``int4_packing.chunks_pack_alone``), each chunk
        # packs as it arrives, else the codes of the matrix pack at once.
        chunked = aligned and int4_packing.chunks_pack_alone()
        packed = torch.empty(n, k // 2, dtype=torch.uint8) if chunked else None
        codes_all = None if chunked else torch.empty(n, k, dtype=torch.int32)
        for start, codes, scale, zero in chunks:
            rows = len(codes)
            scale_zero[:, start : start + rows, 0] = scale.t()
            scale_zero[:, start : start + rows, 1] = zero.t()
            if chunked:
                packed[start : start + rows] = _pack(codes)
            else:
                codes_all[start : start + rows] = codes
        return cls(packed if chunked else _pack(codes_all), scale_zero, group, (n, k))

    def narrowed(self) -> Int4Weight:
        """This weight with its float32 scales and zeros held in float16 where every one of
        them is a float16 value (a GGUF's Q4_0 blocks: f16 scales, zeros 0; most Q4_1
        tensors): the products read half the bytes per group and compute the same numbers
        (float16 widens to float32 exactly). Any other weight as it is."""
        sz = self.scale_zero
        if sz.dtype is not torch.float32 or not torch.equal(sz.half().float(), sz):
            return self
        return Int4Weight(self.packed, sz.half(), self.group, (self.out_features, self.in_features))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scale_zero": self.scale_zero}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        block = intpack.int4_block_n(self.out_features)
        if x.device.type == "cpu" and not (wide_call(x, self.fmt) and block is not None):
            return intpack.int4_linear(x, self.packed, self.scale_zero, self.group, block)
        w = scratch((self.out_features, self.in_features), x.dtype, x.device)
        return F.linear(x, self._unpack_into(w, block))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        block = intpack.int4_block_n(self.out_features)
        if block is not None:
            w = torch.empty(self.out_features, self.in_features, device=self.packed.device)
            return self._unpack_into(w, block).to(dtype)
        # Any layout: the kernel applied to the identity is the matrix (slow; tests only).
        sz = self.scale_zero.float() if self.scale_zero.dtype is torch.float16 else self.scale_zero
        eye = torch.eye(self.in_features, dtype=sz.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, sz)
        return out.t().contiguous().to(dtype)

    def _unpack_into(self, out: torch.Tensor, block: int | None) -> torch.Tensor:
        if block is None:  # a layout no one reads: torch's kernel on the identity (CPU)
            return out.copy_(self.dequantize(out.dtype))
        return intpack.int4_dequantize(self.packed, self.scale_zero, self.group, block, out)


def stacked(weights: Sequence[PackedWeight]) -> PackedWeight | None:
    """Sibling weights that read one input as one matrix, their rows one after another
    (docs/adr/0037): int8 always; a shipped format by its own ``stack``; int4 where each part is whole blocks of torch's packing
    of the stack (the stacked bytes are then that packing). None: formats that do not
    stack. Each output of the products is summed on its own, so the stack's product gives
    every part's outputs bit for bit; ``fused_linears`` checks that once per group."""
    first = weights[0]
    if any(type(w) is not type(first) for w in weights):
        return None
    if isinstance(first, Int8Weight):
        return Int8Weight(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]))  # fmt: skip
    if not isinstance(first, Int4Weight):  # a shipped format stacks where it says so
        stack = getattr(type(first), "stack", None)
        return None if stack is None else stack(weights)
    n = sum(w.out_features for w in weights)
    block = intpack.int4_block_n(n)
    if block is None or any(
        w.group != first.group or w.out_features % block or intpack.int4_block_n(w.out_features) != block
        for w in weights
    ):  # fmt: skip
        return None
    dtypes = {w.scale_zero.dtype for w in weights}
    if dtypes == {torch.float16, torch.float32}:  # some parts narrowed: float32 (exact)
        dtypes = {torch.float32}
    elif len(dtypes) > 1:
        return None
    (dtype,) = dtypes
    return Int4Weight(
        torch.cat([w.packed for w in weights]),
        torch.cat([w.scale_zero.to(dtype) for w in weights], 1),
        first.group, (n, first.in_features),
    )  # fmt: skip


def rows_of(weight: PackedWeight, start: int, end: int) -> PackedWeight:
    """Rows ``[start, end)`` of a ``stacked`` weight, over its memory (a part's own product
    in prompt chunks)."""
    if isinstance(weight, Int8Weight):
        return Int8Weight(weight.q[start:end], weight.scale[start:end])
    if not isinstance(weight, Int4Weight):
        return weight.rows(start, end)  # type: ignore[attr-defined]
    return Int4Weight(weight.packed[start:end], weight.scale_zero[:, start:end], weight.group,
                      (end - start, weight.in_features))  # fmt: skip


def quantized_chunks(weight: Rows, group: int, dtype: torch.dtype) -> Iterator[Codes]:
    """Asymmetric group-wise rounding, 256 rows at a time: (start, codes, scale, zero)."""
    k = _shape(weight)[1]
    for start, block in _rows_chunked(weight):
        rows = len(block)
        grouped = block.view(rows, k // group, group)
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)  # (rows, G)
        scale = ((high - low) / 15.0).clamp(min=1e-8).to(dtype)
        zero = (low + 8.0 * scale.float()).to(dtype)  # the value code 8 stands for
        base = zero.float() - 8.0 * scale.float()  # code 0
        grouped.sub_(base[..., None]).div_(scale.float()[..., None]).round_().clamp_(0, 15)
        yield start, block.to(torch.int32), scale, zero


class _Int4Packing:
    """What meshnet relies on in torch's CPU int4 packing at load (its layout is torch's
    private choice; ``intpack.int4_block_n`` finds the block for the unpacking)."""

    def __init__(self) -> None:
        self._chunks_alone: bool | None = None

    def chunks_pack_alone(self) -> bool:
        """Whether 256-row chunks pack to the matching rows of the whole matrix's packing."""
        if self._chunks_alone is None:
            gen = torch.Generator().manual_seed(0)
            probe = torch.randint(0, 16, (512, 64), dtype=torch.int32, generator=gen)
            whole = _pack(probe)
            self._chunks_alone = torch.equal(
                torch.cat([_pack(probe[:256]), _pack(probe[256:])]), whole
            )
        return self._chunks_alone


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)


int4_packing = _Int4Packing()

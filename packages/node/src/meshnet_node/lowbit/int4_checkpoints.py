"""int4 safetensors checkpoints as ``Int4Weight``s, from their packed tensors as shipped.

Three packings of the same thing — 4-bit codes with a scale (and a zero) per group of
inputs of an output row — each mapped onto ``W = (q - 8) * scale + zero``:

- **GPTQ** (``qweight`` int32 ``[in / 8, out]``, codes packed along the input, nibble i of a
  word = input 8j + i; ``qzeros`` int32 ``[groups, out / 8]`` packed along the output;
  ``scales`` ``[groups, out]``; ``g_idx`` ``[in]``): ``W = scale * (q - z)``, with ``z`` the
  stored zero plus one in the original (v1) format. So scale as is, zero ``(8 - z) scale``.
  act-order checkpoints (``g_idx`` not ``input // group``) are refused.
- **AWQ** (GEMM packing: ``qweight`` int32 ``[in, out / 8]`` packed along the output in the
  order 0 2 4 6 1 3 5 7; ``qzeros`` likewise ``[groups, out / 8]``; ``scales``
  ``[groups, out]``): ``W = (q - z) scale``, the same mapping.
- **compressed-tensors** ``pack-quantized`` (``weight_packed`` int32 ``[out, in / 8]``
  packed along the input, codes stored with +8; ``weight_scale`` ``[out, groups]``; for an
  asymmetric scheme ``weight_zero_point`` int32 ``[out / 8, groups]`` packed along the
  output, also +8): ``W = (q - 8 - zp) scale``, so zero ``-zp scale``.

Each is exact up to the zero's rounding (one float32 product; then the compute dtype's
rounding of scale and zero, as every int4 weight's). Rows are unpacked 256 at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from meshnet_common.models.int4_formats import Int4Format
from meshnet_node.lowbit.packed import Codes, Int4Weight

CHUNK_ROWS = 256
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output 8j + AWQ_ORDER[i]


class Int4CheckpointError(ValueError):
    """A packed tensor set this runtime cannot hold (bits, act order, shapes)."""


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 words ``[..., n]`` -> their eight 4-bit fields ``[..., 8 n]`` (low bits first)."""
    fields = (packed.to(torch.int32)[..., None] >> _SHIFTS) & 15
    return fields.reshape(*packed.shape[:-1], -1)


def _awq_unorder(codes: torch.Tensor) -> torch.Tensor:
    """AWQ's packing order undone along the last axis."""
    n = codes.shape[-1]
    where = torch.tensor(AWQ_ORDER).repeat(n // 8) + torch.arange(0, n, 8).repeat_interleave(8)
    out = torch.empty_like(codes)
    out[..., where] = codes
    return out


def _check_groups(g_idx: torch.Tensor | None, k: int, group: int) -> None:
    if k % group:
        raise Int4CheckpointError(f"{k} inputs are not whole groups of {group}")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        raise Int4CheckpointError(
            "act-order GPTQ (desc_act: inputs grouped out of order) is not served; "
            "re-quantize without desc_act or use another checkpoint"
        )


def _build(chunks: Iterator[Codes], n: int, k: int, group: int, dtype: torch.dtype) -> Int4Weight:
    return Int4Weight.from_codes(chunks, (n, k), group, dtype, aligned=n % CHUNK_ROWS == 0)


def gptq_int4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
    group: int, dtype: torch.dtype, *, v1: bool = True,
) -> Int4Weight:  # fmt: skip
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    _check_groups(g_idx, k, group)

    def chunks() -> Iterator[Codes]:
        zeros = nibbles(qzeros) + (1 if v1 else 0)  # [groups, out]
        for start in range(0, n, CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            codes = nibbles(qweight[:, rows].t().contiguous())  # [rows, in]
            scale = scales[:, rows].t().float()  # [rows, groups]
            zero = (8 - zeros[:, rows].t()).float() * scale
            yield start, codes, scale.to(dtype), zero.to(dtype)

    return _build(chunks(), n, k, group, dtype)


def awq_int4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int,
    dtype: torch.dtype,
) -> Int4Weight:  # fmt: skip
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _check_groups(None, k, group)
    zeros = _awq_unorder(nibbles(qzeros))  # [groups, out]

    def chunks() -> Iterator[Codes]:
        for start in range(0, n, CHUNK_ROWS):
            words = slice(start // 8, (start + CHUNK_ROWS) // 8)
            codes = _awq_unorder(nibbles(qweight[:, words])).t().contiguous()  # [rows, in]
            rows = slice(start, start + codes.shape[0])
            scale = scales[:, rows].t().float()
            zero = (8 - zeros[:, rows].t()).float() * scale
            yield start, codes, scale.to(dtype), zero.to(dtype)

    return _build(chunks(), n, k, group, dtype)


def compressed_int4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype,
    weight_zero_point: torch.Tensor | None = None,
) -> Int4Weight:  # fmt: skip
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 8
    groups = weight_scale.shape[1]
    group = k // groups
    _check_groups(None, k, group)
    zp = None
    if weight_zero_point is not None:  # packed along the output, +8
        zp = nibbles(weight_zero_point.t().contiguous()).t()[:n] - 8  # [out, groups]

    def chunks() -> Iterator[Codes]:
        for start in range(0, n, CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            codes = nibbles(weight_packed[rows])  # [rows, in], +8 already: (q - 8) form
            scale = weight_scale[rows].float()
            zero = torch.zeros_like(scale) if zp is None else -zp[rows].float() * scale
            yield start, codes, scale.to(dtype), zero.to(dtype)

    return _build(chunks(), n, k, group, dtype)


class Int4Linears:
    """The packed Linears of an int4 checkpoint (``fmt``): which tensors make each, and its
    ``Int4Weight`` read through ``read`` (a tensor by checkpoint name, as stored)."""

    def __init__(self, fmt: Int4Format, read: Callable[[str], torch.Tensor]) -> None:
        self.fmt, self._read = fmt, read

    def path_of(self, name: str) -> str | None:
        """The Linear's path when ``name`` is a packed Linear's codes, else None."""
        suffix = "." + self.fmt.packed_suffix
        return name[: -len(suffix)] if name.endswith(suffix) else None

    def parts_of(self, path: str, present: set[str]) -> list[str]:
        """Every stored tensor of the packed Linear at ``path`` (its bias aside)."""
        return [n for n in (f"{path}.{part}" for part in self.fmt.parts) if n in present]

    def weight(self, path: str, dtype: torch.dtype, present: set[str]) -> Int4Weight:
        """The Linear at ``path`` as int4 in the checkpoint's group."""
        fmt, read = self.fmt, lambda part: self._read(f"{path}.{part}")
        has = lambda part: f"{path}.{part}" in present  # noqa: E731 - tiny local helper
        if fmt.method == "compressed-tensors":
            zero = read("weight_zero_point") if has("weight_zero_point") else None
            return compressed_int4(read("weight_packed"), read("weight_scale"), dtype, zero)
        if fmt.method == "awq":
            return awq_int4(read("qweight"), read("qzeros"), read("scales"), fmt.group, dtype)
        if not has("qzeros"):
            raise Int4CheckpointError(f"{path}: a GPTQ Linear without its qzeros")
        zeros = read("qzeros")
        g_idx = read("g_idx") if has("g_idx") else None
        return gptq_int4(read("qweight"), zeros, read("scales"), g_idx, fmt.group, dtype, v1=fmt.v1)

    def dequantized(
        self, tensors: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """A range's tensors with every packed Linear's parts replaced by its ``weight`` in
        ``dtype`` (for a node serving the checkpoint at another precision); floating
        tensors cast to ``dtype``."""
        present = set(tensors)
        reader = Int4Linears(self.fmt, tensors.__getitem__)
        paths = [p for p in map(self.path_of, tensors) if p is not None]
        parts = {n for p in paths for n in self.parts_of(p, present)}
        out = {
            name: tensor.to(dtype) if tensor.is_floating_point() else tensor
            for name, tensor in tensors.items()
            if name not in parts
        }
        for path in paths:
            out[f"{path}.weight"] = reader.weight(path, torch.float32, present).dequantize(dtype)
        return out

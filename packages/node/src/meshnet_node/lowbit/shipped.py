"""Weights in the formats checkpoints ship (FP8 with block scales, MXFP4, GGUF's Q8_0 and
Q6_K), kept in those bytes or values, and plain matrices where a format does not apply
(``DenseWeight``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from meshnet_node.kernels import intpack
from meshnet_node.kernels import packed as kernels
from meshnet_node.lowbit.packed import wide_call


class Fp8Weight:
    """float8 e4m3 bytes ``[out, in]`` and float32 ``weight_scale_inv`` per ``block`` tile
    (DeepSeek-V3, Kimi K2): ``W = fp8 * scale[n // bn, k // bk]``."""

    fmt = "fp8"

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
        self.weight = weight.view(torch.uint8)  # (N, K) the e4m3 bits
        self.scale_inv = scale_inv.float()  # (ceil(N / bn), ceil(K / bk))
        self.block = (int(block[0]), int(block[1]))
        self.out_features, self.in_features = self.weight.shape

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scale_inv": self.scale_inv}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # decode rows: always the fused kernel (each row its own, whatever the batch)
        fused = None if wide_call(x) else True
        return kernels.fp8_linear(x, self.weight, self.scale_inv, self.block, fused=fused)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        return kernels.fp8_dequantize(self.weight, self.scale_inv, self.block, out).to(dtype)


class Mxfp4Weight:
    """MXFP4 (gpt-oss experts): ``blocks`` ``[out, in / 32, 16]`` two E2M1 codes a byte, low
    nibble first, and E8M0 ``scales`` ``[out, in / 32]`` (exponent + 127)."""

    fmt = "mxfp4"

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        self.blocks, self.scales = blocks.contiguous(), scales.contiguous()
        self.out_features = blocks.shape[0]
        self.in_features = blocks.shape[1] * 32

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"blocks": self.blocks, "scales": self.scales}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        fused = None if wide_call(x) else True
        return kernels.mxfp4_linear(x, self.blocks, self.scales, fused=fused)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        return kernels.mxfp4_dequantize(self.blocks, self.scales, out).to(dtype)


class Q8Weight:
    """int8 codes ``q`` ``[out, in]`` with a float32 scale ``d`` per block of a row's inputs
    ``[out, in / block]``, ``W = q * d``, or with a float32 zero per block ``z``,
    ``W = q * d + z``: five GGUF block types as shipped (docs/adr/0043, 0049), each exact in
    this form.

    - Q8_0 (``from_q8_0``, block 32): an f16 scale, then 32 int8 codes.
    - Q6_K (``from_q6_k``, block 16): per 256 weights an f16 ``d``, sixteen int8 sub-scales
      ``sc`` and 6-bit codes ``c``, ``W = d * sc * (c - 32)``: codes ``c - 32`` in [-32, 31]
      and scale ``d * sc`` (11 by 7 significant bits: exact in float32).
    - Q5_0 (``from_q5_0``, block 32): an f16 ``d`` and 5-bit codes ``c``, ``W = d * (c - 16)``:
      codes ``c - 16`` in [-16, 15]. llama.cpp's fallback for Q4_K rows that are not whole
      256s (a Q4_K_M file of a model whose width is not: SmolLM2, Gemma 3 1B).
    - Q5_1 (``from_q5_1``, block 32): ``W = d * c + m``: codes ``c`` in [0, 31], zero ``m``.
    - Q5_K (``from_q5_k``, block 32): ``W = d sc c - dmin m``: scale ``d sc``, zero
      ``-dmin m`` (both exact in float32), as ggml computes it (one rounding, the sum).

    Half of bf16's bytes (Q6_K's 1.25 bytes a weight against its 0.82), and the file's own
    values rather than a rounding of them: a Q4_K_M file's Q6_K projections and output."""

    BLOCK_BYTES = 2 + intpack.Q8_BLOCK  # Q8_0: an f16 scale, then 32 int8 codes
    Q6_K_BYTES = 210  # per 256 weights: 128 bytes of low nibbles, 64 of high bits, 16, 2
    Q5_0_BYTES = 22  # per 32 weights: an f16, 4 bytes of fifth bits, 16 of nibbles
    Q5_1_BYTES = 24  # per 32 weights: two f16, 4 bytes of fifth bits, 16 of nibbles
    Q5_K_BYTES = 176  # per 256 weights: two f16, 12 of scales, 32 of fifth bits, 128 nibbles
    CHUNK_ROWS = 256  # rows decoded at once: a few MB of temporaries whatever the matrix

    def __init__(self, q: torch.Tensor, d: torch.Tensor, fmt: str | None = None,
                 z: torch.Tensor | None = None) -> None:  # fmt: skip
        self.q, self.d = q.contiguous(), d.float().contiguous()
        self.z = None if z is None else z.float().contiguous()  # zeros: W = q * d + z
        self.out_features, self.in_features = self.q.shape
        self.block = self.in_features // self.d.shape[1]
        if self.block not in (intpack.Q8_BLOCK, intpack.Q6_K_BLOCK) or self.d.shape[0] != len(q):
            raise ValueError(f"q {tuple(q.shape)} and d {tuple(d.shape)}: blocks of 16 or 32")
        if self.z is not None and self.z.shape != self.d.shape:
            raise ValueError(f"zeros {tuple(self.z.shape)}: not the scales' {tuple(self.d.shape)}")
        # the file's type, as a format name (a stack of several: "q8")
        self.fmt = fmt or ("q8_0" if self.block == intpack.Q8_BLOCK else "q6_k")

    @classmethod
    def from_q8_0(cls, raw: torch.Tensor) -> Q8Weight:
        """From a GGUF Q8_0 tensor's bytes ``[rows, bytes per row]``."""
        blocks = raw.reshape(raw.shape[0], -1, cls.BLOCK_BYTES)
        d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(raw.shape[0], -1)
        return cls(q, d.float())

    @classmethod
    def from_q6_k(cls, raw: torch.Tensor) -> Q8Weight:
        """From a GGUF Q6_K tensor's bytes ``[rows, bytes per row]``, ``CHUNK_ROWS`` rows at
        a time (ggml's ``dequantize_row_q6_K`` layout)."""
        rows, width = raw.shape
        if width % cls.Q6_K_BYTES:
            raise ValueError(f"Q6_K: a row of {width} bytes is not whole blocks of 210")
        k = width // cls.Q6_K_BYTES * 256
        q = torch.empty(rows, k, dtype=torch.int8)
        d = torch.empty(rows, k // intpack.Q6_K_BLOCK, dtype=torch.float32)
        for start in range(0, rows, cls.CHUNK_ROWS):
            part = raw[start : start + cls.CHUNK_ROWS]
            codes, scales = _q6_k(part.reshape(len(part), -1, cls.Q6_K_BYTES))
            q[start : start + len(part)] = codes.reshape(len(part), k)
            d[start : start + len(part)] = scales.reshape(len(part), -1)
        return cls(q, d)

    @classmethod
    def from_q5_0(cls, raw: torch.Tensor) -> Q8Weight:
        """From a GGUF Q5_0 tensor's bytes ``[rows, bytes per row]``: per 32 weights an f16
        ``d``, four bytes of the codes' fifth bits (little-endian, bit ``i`` for weight
        ``i``), then 16 bytes of low nibbles (weights 0-15 low, 16-31 high)."""
        rows, width = raw.shape
        if width % cls.Q5_0_BYTES:
            raise ValueError(f"Q5_0: a row of {width} bytes is not whole blocks of 22")
        blocks = raw.reshape(rows, -1, cls.Q5_0_BYTES)
        codes = _five_bits(blocks[..., 2:6], blocks[..., 6:22]) - 16
        return cls(codes.reshape(rows, -1), _f16(blocks, 0), "q5_0")

    @classmethod
    def from_q5_1(cls, raw: torch.Tensor) -> Q8Weight:
        """From a GGUF Q5_1 tensor's bytes: per 32 weights an f16 ``d`` and ``m``, the fifth
        bits and nibbles as Q5_0's; ``W = d * c + m``: codes ``c`` in [0, 31], zero ``m``."""
        rows, width = raw.shape
        if width % cls.Q5_1_BYTES:
            raise ValueError(f"Q5_1: a row of {width} bytes is not whole blocks of 24")
        blocks = raw.reshape(rows, -1, cls.Q5_1_BYTES)
        d, m = _f16(blocks, 0), _f16(blocks, 2)
        codes = _five_bits(blocks[..., 4:8], blocks[..., 8:24])
        return cls(codes.reshape(rows, -1), d, "q5_1", m)

    @classmethod
    def from_q5_k(cls, raw: torch.Tensor) -> Q8Weight:
        """From a GGUF Q5_K tensor's bytes: per 256 weights an f16 ``d`` and ``dmin``, eight
        6-bit scales ``sc`` and minimums ``m`` (Q4_K's packing), 32 bytes of fifth bits (bit
        ``g`` of byte ``l`` for weight ``l`` of group ``g``) and 128 of nibbles (each 32
        bytes two groups, the low nibbles the first); ``W = d sc c - dmin m``."""
        rows, width = raw.shape
        if width % cls.Q5_K_BYTES:
            raise ValueError(f"Q5_K: a row of {width} bytes is not whole blocks of 176")
        blocks = raw.reshape(rows, -1, cls.Q5_K_BYTES)
        n = blocks.shape[1]
        d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]  # [rows, n, 1]
        sc, mins = k_scales(blocks[..., 4:16])  # [rows, n, 8]
        high = blocks[..., 16:48].to(torch.int32)  # [rows, n, 32]
        fifth = torch.stack([(high >> g) & 1 for g in range(8)], dim=2)  # [rows, n, 8, 32]
        qs = blocks[..., 48:176].reshape(rows, n, 4, 32).to(torch.int32)
        low = torch.stack([qs & 15, qs >> 4], dim=3).reshape(rows, n, 8, 32)
        codes = (low | (fifth << 4)).reshape(rows, -1).to(torch.int8)
        scale, zero = d * sc.float(), -(dmin * mins.float())
        return cls(codes, scale.reshape(rows, -1), "q5_k", zero.reshape(rows, -1))

    @staticmethod
    def stack(weights: Sequence[Q8Weight]) -> Q8Weight | None:
        """Siblings of one block size as one matrix (``lowbit.packed.stacked``; Q5_0 and
        Q8_0 too): each output is its row's own sum, so the stack gives every part's outputs
        bit for bit."""
        if len({w.block for w in weights}) > 1 or len({w.z is None for w in weights}) > 1:
            return None
        fmts = {w.fmt for w in weights}
        q, d = torch.cat([w.q for w in weights]), torch.cat([w.d for w in weights])
        z = None if weights[0].z is None else torch.cat([w.z for w in weights])
        return Q8Weight(q, d, fmts.pop() if len(fmts) == 1 else "q8", z)

    def rows(self, start: int, end: int) -> Q8Weight:
        """Rows ``[start, end)``, over this weight's memory."""
        z = None if self.z is None else self.z[start:end]
        return Q8Weight(self.q[start:end], self.d[start:end], self.fmt, z)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"q": self.q, "d": self.d, **({} if self.z is None else {"z": self.z})}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return intpack.q8_linear(x, self.q, self.d, self.z)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().view(n, k // self.block, self.block) * self.d[..., None]
        if self.z is not None:
            w = w + self.z[..., None]
        return w.view(n, k).to(dtype)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte ``at`` of every block, as float32 ``[rows, blocks]``."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()


def _five_bits(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1 codes ``[rows, n, 32]`` (int8, 0-31): ``high`` ``[rows, n, 4]`` their fifth
    bits (bit ``i`` of byte ``j`` for weight ``8j + i``), ``low`` ``[rows, n, 16]`` their
    nibbles (weights 0-15 low, 16-31 high)."""
    rows = high.shape[0]
    bits = (high.to(torch.int32)[..., :, None] >> torch.arange(8, dtype=torch.int32)) & 1
    nibbles = torch.cat([low & 15, low >> 4], dim=-1).to(torch.int32)
    return (nibbles | (bits.reshape(rows, -1, 32) << 4)).to(torch.int8)


def k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's twelve bytes per 256 weights -> the eight 6-bit scales and minimums
    (int32 ``[..., 8]`` each), as ggml's ``get_scale_min_k4`` unpacks them."""
    p = packed.to(torch.int32)
    low, mid, high = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = torch.cat([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    return sc, mins


def _q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks ``[rows, n, 210]`` -> codes - 32 (int8 ``[rows, n, 256]``) and each 16
    weights' scale ``d * sc`` (float32 ``[rows, n, 16]``). In each half of 128 weights, the
    32 weights of group ``g`` take the low (g 0, 1) or high (g 2, 3) nibbles of ``ql`` bytes
    ``0..31`` (g 0, 2) or ``32..63`` (g 1, 3), and bits ``2g, 2g + 1`` of ``qh``; a half's
    scales are in the order of its 16-weight runs."""
    rows, n = blocks.shape[:2]
    ql = blocks[..., :128].reshape(rows, n, 2, 2, 32).to(torch.int16)  # half, first/second 32
    qh = blocks[..., 128:192].reshape(rows, n, 2, 32).to(torch.int16)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = blocks[..., 208:210].contiguous().view(torch.float16).float()  # [rows, n, 1]
    first, second = ql[:, :, :, 0], ql[:, :, :, 1]  # [rows, n, 2, 32] each
    low = torch.stack([first & 15, second & 15, first >> 4, second >> 4], dim=3)  # [.., 4, 32]
    high = torch.stack([(qh >> (2 * g)) & 3 for g in range(4)], dim=3)
    codes = (low | (high << 4)) - 32
    return codes.reshape(rows, n, 256).to(torch.int8), d * sc


class DenseWeight:
    """A matrix left at the compute dtype: an expert projection whose shape a format cannot
    pack (int4 needs out % 16 and in % group), beside packed ones."""

    fmt = "dense"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

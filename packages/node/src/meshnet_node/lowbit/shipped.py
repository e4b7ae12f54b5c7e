"""Weights in the formats checkpoints ship (FP8 with block scales, MXFP4, GGUF's Q8_0), kept
in those bytes, and plain matrices where a format does not apply (``DenseWeight``)."""

from __future__ import annotations

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
    """llama.cpp's Q8_0 blocks as shipped: ``q`` int8 ``[out, in]`` and each 32 inputs' f16
    scale ``d`` (float32, exact) ``[out, in / 32]``: ``W = q * d``. A GGUF's Q8_0 LM head
    (docs/adr/0043): half bf16's bytes, and the file's values rather than bf16's rounding."""

    fmt = "q8_0"
    BLOCK_BYTES = 2 + intpack.Q8_BLOCK  # an f16 scale, then 32 int8 codes

    def __init__(self, q: torch.Tensor, d: torch.Tensor) -> None:
        self.q, self.d = q.contiguous(), d.float().contiguous()
        self.out_features, self.in_features = self.q.shape

    @classmethod
    def from_blocks(cls, raw: torch.Tensor) -> Q8Weight:
        """From a GGUF Q8_0 tensor's bytes ``[rows, bytes per row]``."""
        blocks = raw.reshape(raw.shape[0], -1, cls.BLOCK_BYTES)
        d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(raw.shape[0], -1)
        return cls(q, d.float())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"q": self.q, "d": self.d}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return intpack.q8_0_linear(x, self.q, self.d)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().view(n, k // intpack.Q8_BLOCK, intpack.Q8_BLOCK) * self.d[..., None]
        return w.view(n, k).to(dtype)


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

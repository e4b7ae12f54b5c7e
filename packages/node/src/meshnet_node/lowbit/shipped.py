"""Weights in the formats checkpoints ship (FP8 with block scales, MXFP4), kept in those bytes,
and plain matrices where a format does not apply (``DenseWeight``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

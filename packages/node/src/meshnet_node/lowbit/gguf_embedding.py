"""A GGUF's token embedding held in the file's blocks, its rows dequantized when looked up.

A head stage looks up a few rows of its token embedding per pass, yet held it whole at the
compute dtype: a GGUF computes in float32 (docs/adr/0046), so Llama 3 8B's Q4_K_M embedding
(128256 x 4096, 0.28 GB in the file) took 2.1 GB, Gemma 3's (262144 rows) a gigabyte or
more, SmolLM2's 113 MB for a 30 MB Q8_0 tensor. ``GgufEmbedding`` keeps the block bytes and
dequantizes the rows a pass asks for with the ``gguf`` package, the function that made the
dense tensor: the same values bit for bit, cast to the compute dtype the same way. Gemma's
scaled embedding multiplies by its scale as its module does (docs/adr/0050).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import quants
from torch import nn

from meshnet_node.lowbit.gguf_blocks import FLOAT_TYPES, GgufTensors


def _scaled(module: nn.Module) -> bool:
    """A Gemma scaled word embedding: ``nn.Embedding``'s lookup times ``embed_scale``, by the
    same code as Gemma 3's (a family's copy of it has the same bytecode)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    ours = getattr(type(module).forward, "__code__", None)
    theirs = Gemma3TextScaledWordEmbedding.forward.__code__
    return (
        isinstance(module, nn.Embedding)
        and hasattr(module, "scalar_embed_scale")
        and ours is not None
        and (ours.co_code, ours.co_consts, ours.co_names)
        == (theirs.co_code, theirs.co_consts, theirs.co_names)
    )


def gguf_embedding(index, name: str, module: nn.Module, dtype: torch.dtype):
    """``module`` (the family's embedding, on meta) as a ``GgufEmbedding`` of checkpoint
    tensor ``name``, where that tensor is a GGUF block tensor and the module a plain or
    Gemma-scaled embedding; else None (it loads densely, as any tensor)."""
    info = index.tensors.get(name)
    if getattr(index, "gguf", None) is None or info is None or info.dtype in FLOAT_TYPES:
        return None
    if len(info.shape) != 2 or not (type(module) is nn.Embedding or _scaled(module)):
        return None
    scale = getattr(module, "scalar_embed_scale", None)
    raw = GgufTensors(index).raw(name)
    return GgufEmbedding(raw, info.dtype, info.shape[1], dtype, None if scale is None else float(scale))  # fmt: skip


Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _q8_0_rows(blocks: np.ndarray, count: int) -> np.ndarray:
    """Q8_0 rows as ``quants.Q8_0.dequantize_blocks`` makes them (its numpy operations: the
    f16 scale widened, times the int8 codes widened), without ``quants.dequantize``'s
    grouping around them: a decode step looks up one row, and the grouping took two thirds
    of its ~20 us (several times that when the layers' weights had just gone through the
    caches)."""
    flat = blocks.reshape(-1, 2 + 32)
    d = flat[:, :2].copy().view(np.float16).astype(np.float32)
    x = flat[:, 2:].copy().view(np.int8).astype(np.float32)
    return (x * d).reshape(count, -1)


class GgufEmbedding(nn.Module):
    """``input_ids`` -> their rows of a GGUF block tensor ``blocks`` (uint8, one row of
    blocks per token), as float32 by the ``gguf`` package, then in ``dtype``, times
    ``scale`` (Gemma's ``embed_scale``: None for families without one)."""

    def __init__(self, blocks: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype,
                 scale: float | None = None) -> None:  # fmt: skip
        super().__init__()
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.kind = gguf.GGMLQuantizationType[fmt]
        self.fmt, self.embedding_dim, self.dtype = fmt, dim, dtype
        self.num_embeddings = blocks.shape[0]
        # as Gemma3TextScaledWordEmbedding: a float32 tensor of the scale, cast to the dtype
        self.scale = None if scale is None else torch.tensor(scale).to(dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).cpu().numpy()
        blocks = self.blocks.numpy()[ids]
        if self.kind is Q8_0:
            rows = torch.from_numpy(_q8_0_rows(blocks, len(ids)))
        else:
            rows = torch.from_numpy(quants.dequantize(blocks, self.kind))
        out = rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)
        return out if self.scale is None else out * self.scale

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt} blocks"

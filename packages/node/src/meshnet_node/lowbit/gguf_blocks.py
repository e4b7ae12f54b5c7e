"""GGUF's block formats as meshnet's int4 / int8 weights, without a detour through 16 bits.

llama.cpp's Q4_0, Q4_1 and Q4_K hold every 32 weights of a row as 4-bit codes with a scale
and an offset of their own, which is exactly ``Int4Weight``'s form at group 32,
``W = (q - 8) * scale + zero``:

- Q4_0 (18 bytes per 32: f16 ``d``, 16 bytes of codes): ``W = d * (q - 8)``, so scale ``d``,
  zero 0. Exact.
- Q4_1 (20 bytes: f16 ``d``, f16 ``m``, codes): ``W = d * q + m``, so scale ``d``, zero
  ``m + 8 d``. Exact up to the rounding of the zero (one float32 rounding; in bf16 compute
  the scale and zero round to bf16's 8 bits, as every bf16 int4 weight's do).
- Q4_K (144 bytes per 256: f16 ``d`` and ``dmin``, twelve bytes of 6-bit sub-scales ``sc``
  and sub-minimums ``m`` for eight groups of 32, 128 bytes of codes): ``W = d sc q - dmin m``,
  so scale ``d sc`` (exact in float32) and zero ``8 d sc - dmin m``. Exact up to the zero's
  rounding, as Q4_1.

Codes sit two a byte: in Q4_0/Q4_1 the low nibbles are a block's first 16 values and the high
nibbles its last 16; in Q4_K each 32 bytes hold two groups, the low nibbles the first.
Rows are decoded 256 at a time, so the temporaries stay a few MB whatever the matrix.

Q8_0, Q6_K, Q5_0, Q5_1 and Q5_K are kept in their own values as ``Q8Weight`` (int8 codes, a
float32 scale per 32 or 16 weights and, for Q5_1 / Q5_K, a zero: exact, docs/adr/0049), and
4-bit blocks as ``Int4Weight`` as above, at int4 and int8 alike (``kept_weight``,
``int4_weight``): a Q4_K_M file's Q6_K projections, llama.cpp's Q5_0 / Q8_0 fallbacks for rows
that are not whole 256s, a Q5_K_M file's Q5_K ones, a Q8_0 or Q6_K file's every matrix.

The other block types (Q2_K, Q3_K, IQ*) are dequantized (by the ``gguf`` package, in float32:
its values exactly as llama.cpp computes them) 256 rows at a time and rounded to the node's
format (``requantized``), so no whole matrix is ever held in float: at int4 (``int4_weight``)
to 16 levels per group of 32, as any weight quantized at load (``Int4Weight.quantize``); at
int8 (``int8_weight``) to one symmetric scale per row (at most half a step of
``max |row| / 127``).
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import torch
from gguf import quants

from meshnet_node.lowbit.packed import Codes, Int4Weight, Int8Weight, quantized_chunks
from meshnet_node.lowbit.shipped import Q8Weight, k_scales

GROUP = 32  # every 4-bit GGUF format scales groups of 32 weights
# format name -> (weights per block, bytes per block), as ggml lays them out
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}
CHUNK_ROWS = 256
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
FLOAT_TYPES = tuple(_PLAIN)


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte ``at`` of every block, as float32 ``[rows, blocks]``."""
    return raw[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 16] -> codes [..., 32]: low nibbles first, then high."""
    return torch.cat([codes & 15, codes >> 4], dim=-1)


def _q4_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = _f16(raw, 0)
    return _nibbles(raw[..., 2:18]), d, torch.zeros_like(d)


def _q4_1(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, m = _f16(raw, 0), _f16(raw, 2)
    return _nibbles(raw[..., 4:20]), d, m + 8.0 * d


def _q4_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, dmin = _f16(raw, 0)[..., None], _f16(raw, 2)[..., None]  # [rows, blocks, 1]
    sc, mins = k_scales(raw[..., 4:16])  # ggml's 6-bit sub-scales and minimums
    qs = raw[..., 16:144].reshape(*raw.shape[:-1], 4, 32)  # two groups per 32 bytes
    codes = torch.stack([qs & 15, qs >> 4], dim=-2)  # [rows, blocks, 4, 2, 32]
    scale = d * sc.float()  # [rows, blocks, 8]
    zero = 8.0 * scale - dmin * mins.float()
    rows = raw.shape[0]
    return codes.reshape(rows, -1, 32), scale.reshape(rows, -1), zero.reshape(rows, -1)


DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}


def int4_chunks(raw: torch.Tensor, fmt: str, dtype: torch.dtype) -> Iterator[Codes]:
    """``raw`` uint8 ``[rows, bytes per row]`` of one tensor in ``fmt`` -> row chunks of
    (first row, codes int32 [rows, in], scale and zero [rows, in / 32] in ``dtype``)."""
    weights, size = BLOCKS[fmt]
    decode = DECODERS[fmt]
    rows, width = raw.shape
    if width % size:
        raise ValueError(f"{fmt}: a row of {width} bytes is not whole blocks of {size}")
    for start in range(0, rows, CHUNK_ROWS):
        block = raw[start : start + CHUNK_ROWS].reshape(-1, width // size, size)
        codes, scale, zero = decode(block)
        n = block.shape[0]
        yield (
            start, codes.reshape(n, -1).to(torch.int32),
            scale.reshape(n, -1).to(dtype), zero.reshape(n, -1).to(dtype),
        )  # fmt: skip


# kept in their own values (``KEPT_BLOCKS``: the weights per scale)
KEPT = {"Q8_0": Q8Weight.from_q8_0, "Q6_K": Q8Weight.from_q6_k, "Q5_0": Q8Weight.from_q5_0,
        "Q5_1": Q8Weight.from_q5_1, "Q5_K": Q8Weight.from_q5_k}  # fmt: skip


def kept_weight(raw: torch.Tensor, fmt: str) -> Q8Weight:
    """A Q8_0, Q6_K, Q5_0, Q5_1 or Q5_K tensor's bytes ``[out, bytes per row]`` as a ``Q8Weight`` (exact)."""
    return KEPT[fmt](raw)


def int4_weight(raw: torch.Tensor, fmt: str, dtype: torch.dtype) -> Int4Weight:
    """One GGUF tensor of ``fmt`` (``[out, bytes per row]``) as an ``Int4Weight`` at group 32:
    4-bit blocks as they are, any other type rounded to int4 from its values."""
    if fmt not in BLOCKS:
        return _requantized_int4(raw, fmt, dtype)
    weights, size = BLOCKS[fmt]
    shape = (raw.shape[0], raw.shape[1] // size * weights)
    chunks = int4_chunks(raw, fmt, dtype)
    weight = Int4Weight.from_codes(chunks, shape, GROUP, dtype, aligned=shape[0] % CHUNK_ROWS == 0)
    return weight.narrowed()  # float32 compute: f16 scales and zeros where exact


def dequantized_chunks(raw: torch.Tensor, fmt: str) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, float32 values ``[rows, in]``) of a block tensor, 256 rows at a time, as
    the ``gguf`` package dequantizes them."""
    kind = gguf.GGMLQuantizationType[fmt]
    data = raw.numpy()
    for start in range(0, raw.shape[0], CHUNK_ROWS):
        yield start, torch.from_numpy(quants.dequantize(data[start : start + CHUNK_ROWS], kind))


def _width(raw: torch.Tensor, fmt: str) -> int:
    weights, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]]
    if raw.shape[1] % size:
        raise ValueError(f"{fmt}: a row of {raw.shape[1]} bytes is not whole blocks of {size}")
    return raw.shape[1] // size * weights


def _requantized_int4(raw: torch.Tensor, fmt: str, dtype: torch.dtype) -> Int4Weight:
    """Any block type rounded to int4 at group 32, from its values 256 rows at a time."""
    shape = (raw.shape[0], _width(raw, fmt))

    def chunks() -> Iterator[Codes]:
        for start, values in dequantized_chunks(raw, fmt):
            for at, codes, scale, zero in quantized_chunks(values, GROUP, dtype):
                yield start + at, codes, scale, zero

    return Int4Weight.from_codes(chunks(), shape, GROUP, dtype, aligned=shape[0] % CHUNK_ROWS == 0)


def int8_weight(raw: torch.Tensor, fmt: str, dtype: torch.dtype) -> Int8Weight:
    """One GGUF block tensor as an ``Int8Weight``: its values rounded to a scale per row
    (as ``Int8Weight.quantize`` rounds any matrix), 256 rows at a time."""
    q = torch.empty(raw.shape[0], _width(raw, fmt), dtype=torch.int8)
    scale = torch.empty(raw.shape[0], dtype=dtype)
    for start, values in dequantized_chunks(raw, fmt):
        part = Int8Weight.quantize(values, dtype)
        q[start : start + len(values)], scale[start : start + len(values)] = part.q, part.scale
    return Int8Weight(q, scale)


class GgufTensors:
    """Tensors of a GGUF index read one at a time from the file's mapping: a block format's
    raw bytes (``raw``, for ``int4_weight``) or any tensor's values (``dense``), rows of
    Llama's query and key projections put back in HF's order either way."""

    def __init__(self, index) -> None:
        self.index, self.source = index, index.gguf
        self._maps: dict[str, np.memmap] = {}  # by file (llama.cpp's split sets have several)

    def fmt(self, name: str) -> str:
        return self.index.tensors[name].dtype

    def _bytes(self, name: str) -> np.ndarray:
        info = self.index.tensors[name]
        if info.file not in self._maps:
            path = self.index.root / info.file
            self._maps[info.file] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[info.file][info.offset : info.offset + info.nbytes]

    def raw(self, name: str) -> torch.Tensor:
        """A block-format tensor's bytes ``[out, bytes per row]`` (a copy: one tensor)."""
        rows = self.index.tensors[name].shape[0]
        return self._unpermute(name, torch.from_numpy(self._bytes(name).reshape(rows, -1).copy()))

    def dense(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor's values in ``dtype`` at its HF shape (block formats dequantized by the
        ``gguf`` package, in float32)."""
        info = self.index.tensors[name]
        data = self._bytes(name)
        if info.dtype in _PLAIN:
            values = torch.from_numpy(data.copy()).view(_PLAIN[info.dtype])
        else:
            kind = gguf.GGMLQuantizationType[info.dtype]
            rows = info.shape[0] if len(info.shape) > 1 else 1
            values = torch.from_numpy(quants.dequantize(data.reshape(rows, -1), kind).copy())
        values = self._unpermute(name, values.reshape(info.shape))
        shift = self.source.value_shift.get(name)
        if shift is not None:  # Gemma's norms, stored as 1 + w by llama.cpp's converter
            values = values.float() - shift
        return values.to(dtype)

    def _unpermute(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """llama.cpp interleaves each head's rotary halves (``permute`` in its converter);
        this is its inverse, on rows whatever they hold."""
        heads = self.source.row_permutation.get(name)
        if heads is None:
            return rows
        n = rows.shape[0]
        return rows.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1)


def kept_lm_head(index) -> Q8Weight | None:
    """The LM head of a GGUF checkpoint whose output (or tied embedding) is a kept type (Q8_0,
    Q6_K, Q5_*), in its values (docs/adr/0043, 0049); None for any other checkpoint or type."""
    if getattr(index, "gguf", None) is None:
        return None
    name = "lm_head.weight" if "lm_head.weight" in index.tensors else index.naming.tied_embedding
    info = index.tensors.get(name)
    if info is None or info.dtype not in KEPT or len(info.shape) != 2:
        return None
    return kept_weight(GgufTensors(index).raw(name), info.dtype)

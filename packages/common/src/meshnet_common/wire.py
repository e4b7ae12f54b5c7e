"""Binary activation frames: raw tensor bytes, byte-shuffled, zstd-compressed (ADR 0003).

Layout of a frame (little-endian)::

    magic  b"MSH1"  4 bytes
    dtype  u8       code from DTYPE_CODES
    flags  u8       bit 0: byte-shuffled, bit 1: zstd-compressed
    ndim   u8
    pad    u8
    dims   u32 * ndim
    body   raw (or zstd frame of) the tensor's bytes

Decoding is bounded: the declared shape fixes the exact byte count, a zstd frame must
declare that content size, and decompression never produces more than it.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from meshnet_common.errors import InvalidRequest, PayloadTooLarge

MAGIC = b"MSH1"
_HEADER = struct.Struct("<4sBBBB")
FLAG_SHUFFLED = 1
FLAG_ZSTD = 2
MAX_NDIM = 4
# Default cap on one decoded tensor: 256 MiB (a 128-token chunk of an 8192-wide bf16 model is 2 MiB).
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
CONTENT_TYPE = "application/x-meshnet-tensor"

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.bfloat16: 1,
    torch.float32: 2,
    torch.float16: 3,
    torch.int64: 4,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

_compressors: dict[int, zstandard.ZstdCompressor] = {}


@dataclass(frozen=True)
class WireOptions:
    """How tensors are packed: zstd level (0 = off) and byte shuffling."""

    zstd_level: int = 1
    shuffle: bool = True


def _compressor(level: int) -> zstandard.ZstdCompressor:
    comp = _compressors.get(level)
    if comp is None:
        comp = _compressors[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return comp


def _shuffle(raw: np.ndarray, itemsize: int) -> bytes:
    # Group byte k of every element together: exponent bytes of bf16 compress far better.
    return raw.reshape(-1, itemsize).T.tobytes()


def _unshuffle(raw: bytes, itemsize: int) -> bytes:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, -1)
    return planes.T.tobytes()


def encode_tensor(tensor: torch.Tensor, options: WireOptions = WireOptions()) -> bytes:
    """Pack a CPU tensor into one frame."""
    if tensor.dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {tensor.dtype} cannot travel on the wire")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"tensor has {tensor.dim()} dims; at most {MAX_NDIM}")
    tensor = tensor.detach().to("cpu").contiguous()
    itemsize = tensor.element_size()
    # reshape(-1) first: view() refuses 0-dim tensors and odd strides on size-1 dims.
    raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else np.empty(0, np.uint8)
    flags = 0
    if options.shuffle and itemsize > 1 and raw.size:
        body = _shuffle(raw, itemsize)
        flags |= FLAG_SHUFFLED
    else:
        body = raw.tobytes()
    if options.zstd_level > 0:
        body = _compressor(options.zstd_level).compress(body)
        flags |= FLAG_ZSTD
    header = _HEADER.pack(MAGIC, DTYPE_CODES[tensor.dtype], flags, tensor.dim(), 0)
    dims = struct.pack(f"<{tensor.dim()}I", *tensor.shape)
    return header + dims + body


def _decompress_exact(body: bytes, expected: int) -> bytes:
    try:
        params = zstandard.get_frame_parameters(body)
    except zstandard.ZstdError as exc:
        raise InvalidRequest(f"corrupt zstd frame: {exc}", code="bad_frame") from exc
    if params.content_size != expected:
        # Also rejects frames without a declared size (content_size is then a sentinel).
        raise InvalidRequest(
            f"zstd frame declares {params.content_size} bytes, shape needs {expected}",
            code="bad_frame",
        )
    reader = zstandard.ZstdDecompressor(max_window_size=1 << 27).stream_reader(io.BytesIO(body))
    try:
        out = reader.read(expected + 1)
        while len(out) < expected + 1:
            more = reader.read(expected + 1 - len(out))
            if not more:
                break
            out += more
    except zstandard.ZstdError as exc:
        raise InvalidRequest(f"corrupt zstd frame: {exc}", code="bad_frame") from exc
    if len(out) != expected:
        raise InvalidRequest(
            f"zstd frame decodes to {len(out)} bytes, shape needs {expected}", code="bad_frame"
        )
    return out


def decode_tensor(frame: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Unpack one frame; raise InvalidRequest/PayloadTooLarge on anything malformed."""
    if len(frame) < _HEADER.size:
        raise InvalidRequest("tensor frame shorter than its header", code="bad_frame")
    magic, dtype_code, flags, ndim, _pad = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise InvalidRequest("not a meshnet tensor frame (bad magic)", code="bad_frame")
    dtype = CODE_DTYPES.get(dtype_code)
    if dtype is None:
        raise InvalidRequest(f"unknown dtype code {dtype_code}", code="bad_frame")
    if ndim > MAX_NDIM or flags & ~(FLAG_SHUFFLED | FLAG_ZSTD):
        raise InvalidRequest("malformed tensor frame header", code="bad_frame")
    offset = _HEADER.size + 4 * ndim
    if len(frame) < offset:
        raise InvalidRequest("tensor frame truncated in its shape", code="bad_frame")
    shape = struct.unpack_from(f"<{ndim}I", frame, _HEADER.size)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    expected = itemsize
    for dim in shape:
        expected *= dim
    if expected > max_bytes:
        raise PayloadTooLarge(
            f"tensor of shape {list(shape)} needs {expected} bytes; limit is {max_bytes}",
            code="tensor_too_large",
        )
    body = frame[offset:]
    if flags & FLAG_ZSTD:
        body = _decompress_exact(body, expected)
    elif len(body) != expected:
        raise InvalidRequest(
            f"tensor body has {len(body)} bytes, shape needs {expected}", code="bad_frame"
        )
    if flags & FLAG_SHUFFLED and expected:
        body = _unshuffle(body, itemsize)
    if not expected:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype).reshape(shape)

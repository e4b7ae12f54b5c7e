"""Binary activation frames: raw tensor bytes, byte-shuffled, zstd-compressed (ADR 0003).

Layout of a frame (little-endian)::

    magic  b"MSH1"  4 bytes
    dtype  u8       code from DTYPE_CODES
    flags  u8       bit 0: byte-shuffled, bit 1: zstd-compressed, bit 2: split planes
    ndim   u8
    pad    u8
    dims   u32 * ndim
    body   raw (or zstd frame of) the tensor's bytes; with split planes (the default):
           u32 n + a zstd frame of n bytes holding the high half of the byte planes
           (sign and exponent: they compress) + the low half raw (mantissa bits: noise)

Zstd over the low mantissa bytes buys nothing and, on a 1-token frame, spoils the entropy
coding of the exponent bytes: splitting takes a decode token of SmolLM2 from 0.86 to 0.73
of raw bf16 and a 128-token chunk from 0.78 to 0.70 (bench/README.md, "Wire").

Decoding is bounded: the declared shape fixes the exact byte count, a zstd frame must
declare that content size, and decompression never produces more than it; past 1 MiB a
zstd part may expand at most ``MAX_RATIO`` times its size.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from array import array
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import zstandard

from meshnet_common.errors import InvalidRequest, PayloadTooLarge

MAGIC = b"MSH1"
_HEADER = struct.Struct("<4sBBBB")
FLAG_SHUFFLED = 1
FLAG_ZSTD = 2
FLAG_SPLIT = 4  # with FLAG_SHUFFLED and FLAG_ZSTD: only the high byte planes are compressed
_LEN = struct.Struct("<I")
MAX_NDIM = 4
# Default cap on one decoded tensor: 256 MiB (a 128-token chunk of an 8192-wide bf16 model is 2 MiB).
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
CONTENT_TYPE = "application/x-meshnet-tensor"
# A frame costs about its own size to decode (ADR-0008): past RATIO_FLOOR decoded bytes, a
# zstd part may expand at most MAX_RATIO times (activations' exponent planes compress 2-4x;
# a 1 KB frame of zeros declaring 64 MiB is refused before anything is allocated).
MAX_RATIO = 64
RATIO_FLOOR = 1 << 20

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.bfloat16: 1,
    torch.float32: 2,
    torch.float16: 3,
    torch.int64: 4,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

# zstd contexts are not thread-safe, and frames are packed on several threads at once
# (a pass's chunks are encoded in parallel): one set of contexts per thread.
_local = threading.local()


@dataclass(frozen=True)
class WireOptions:
    """How tensors are packed: zstd level (0 = off) and byte shuffling."""

    zstd_level: int = 1
    shuffle: bool = True


def _compressor(level: int) -> zstandard.ZstdCompressor:
    compressors = _local.__dict__.setdefault("compressors", {})
    comp = compressors.get(level)
    if comp is None:
        comp = compressors[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstandard.ZstdDecompressor(max_window_size=1 << 27)
    return dctx


# Below this many bytes (a decode step's frame), planes are split and joined by bytes
# slicing: CPython's own code, which stays in cache, where a numpy call costs tens of
# microseconds on a CPU whose caches emptied while the stage idled (docs/adr/0011).
# Above it numpy's copy is 3-4x faster.
_SMALL_FRAME = 16384


def _shuffle(raw: bytes | np.ndarray, itemsize: int) -> bytes:
    # Group byte k of every element together: exponent bytes of bf16 compress far better.
    if isinstance(raw, bytes):
        return b"".join(raw[k::itemsize] for k in range(itemsize))
    if raw.size <= _SMALL_FRAME:
        data = raw.tobytes()
        return b"".join(data[k::itemsize] for k in range(itemsize))
    return raw.reshape(-1, itemsize).T.tobytes()


def _unshuffle(raw: bytes, itemsize: int) -> bytes | bytearray:
    if len(raw) <= _SMALL_FRAME:
        out = bytearray(len(raw))
        plane = len(raw) // itemsize
        for k in range(itemsize):
            out[k::itemsize] = raw[k * plane : (k + 1) * plane]
        return out
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, -1)
    return planes.T.tobytes()


# A raw decode step's frame header, by (dtype, shape): with it a step's frame is the header
# and the tensor's bytes, read with three torch calls rather than a dozen (each costs tens of
# microseconds on a core whose caches the pass emptied).
_RAW_HEADS: dict[tuple, tuple[bytes, int]] = {}
_RAW_HEADS_MAX = 64


def encode_tensor(tensor: torch.Tensor, options: WireOptions = WireOptions()) -> bytes:
    """Pack a CPU tensor into one frame."""
    raw = not options.zstd_level and not options.shuffle
    known = _RAW_HEADS.get((tensor.dtype, tensor.shape)) if raw else None
    if known is not None and tensor.is_cpu and tensor.is_contiguous():
        header, nbytes = known
        return header + ctypes.string_at(tensor.data_ptr(), nbytes)
    frame = _encode(tensor, options)
    if raw and len(frame) <= _SMALL_FRAME and len(_RAW_HEADS) < _RAW_HEADS_MAX:
        nbytes = tensor.numel() * tensor.dtype.itemsize
        _RAW_HEADS[(tensor.dtype, tensor.shape)] = (frame[: len(frame) - nbytes], nbytes)
    return frame


def _encode(tensor: torch.Tensor, options: WireOptions) -> bytes:
    if tensor.dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {tensor.dtype} cannot travel on the wire")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"tensor has {tensor.dim()} dims; at most {MAX_NDIM}")
    itemsize = tensor.dtype.itemsize
    nbytes = tensor.numel() * itemsize
    if 0 < nbytes <= _SMALL_FRAME and tensor.is_cpu and tensor.is_contiguous():
        # A decode step's frame: read its bytes directly; each torch or numpy call costs
        # tens of microseconds on a CPU whose caches emptied while the stage idled.
        raw = ctypes.string_at(tensor.data_ptr(), nbytes)
    else:
        tensor = tensor.detach().to("cpu").contiguous()
        # reshape(-1) first: view() refuses 0-dim tensors and odd strides on size-1 dims.
        raw = tensor.reshape(-1).view(torch.uint8).numpy() if nbytes else np.empty(0, np.uint8)
    flags = 0
    if options.shuffle and itemsize > 1 and nbytes:
        body = _shuffle(raw, itemsize)
        flags |= FLAG_SHUFFLED
    else:
        body = raw if isinstance(raw, bytes) else raw.tobytes()
    if options.zstd_level > 0 and flags & FLAG_SHUFFLED:
        low = len(body) // 2  # little-endian: the first planes hold the low mantissa bytes
        high = _compressor(options.zstd_level).compress(body[low:])
        body = _LEN.pack(len(high)) + high + body[:low]
        flags |= FLAG_ZSTD | FLAG_SPLIT
    elif options.zstd_level > 0:
        body = _compressor(options.zstd_level).compress(body)
        flags |= FLAG_ZSTD
    header = _HEADER.pack(MAGIC, DTYPE_CODES[tensor.dtype], flags, tensor.dim(), 0)
    dims = struct.pack(f"<{tensor.dim()}I", *tensor.shape)
    return header + dims + body


def _decompress_exact(body: bytes, expected: int) -> bytes:
    if expected > max(RATIO_FLOOR, MAX_RATIO * len(body)):
        raise InvalidRequest(
            f"zstd frame of {len(body)} bytes would decode to {expected}: more than "
            f"{MAX_RATIO} times its size",
            code="bad_frame",
        )
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
    # One call: the output buffer is the declared size (verified above), so it stays
    # bounded; a truncated frame, or anything after the one frame, is an error.
    try:
        out = _decompressor().decompress(body, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise InvalidRequest(f"corrupt zstd frame: {exc}", code="bad_frame") from exc
    if len(out) != expected:
        raise InvalidRequest(
            f"zstd frame decodes to {len(out)} bytes, shape needs {expected}", code="bad_frame"
        )
    return out


def _join_planes(body: bytes, expected: int) -> bytes:
    """Split-plane body -> the shuffled bytes: low planes stored raw, high ones from zstd."""
    low = expected // 2
    if len(body) < _LEN.size:
        raise InvalidRequest("split tensor frame truncated", code="bad_frame")
    (size,) = _LEN.unpack_from(body)
    if len(body) != _LEN.size + size + low:
        raise InvalidRequest(
            f"split tensor body has {len(body)} bytes, its parts declare {_LEN.size + size + low}",
            code="bad_frame",
        )
    high = _decompress_exact(body[_LEN.size : _LEN.size + size], expected - low)
    return body[_LEN.size + size :] + high


class WireTensor(NamedTuple):
    """A frame read and checked (``read_frame``), its tensor not yet made: its dtype, shape
    and bytes (decompressed, in order). ``tensor()`` makes it. A decode step's input stays
    one of these on the event loop, which only checks its dtype and shape, and becomes a
    tensor on the compute thread: a torch call costs ~100 us on a core whose caches the
    last pass emptied, and ~5 us where torch has just run (docs/adr/0011)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes | bytearray

    @classmethod
    def of_ids(cls, ids: list[int] | tuple[int, ...]) -> WireTensor:
        """Token ids as a (1, T) int64 input, without a torch call."""
        return cls(torch.int64, (1, len(ids)), array("q", ids).tobytes())

    def tensor(self) -> torch.Tensor:
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype)
        # A writable buffer (torch warns on read-only ones).
        buffer = self.data if isinstance(self.data, bytearray) else bytearray(self.data)
        return torch.frombuffer(buffer, dtype=self.dtype).view(self.shape)


def body_at(frame: bytes, start: int = 0) -> tuple[int, bool]:
    """Where the body of the (checked: ``read_frame``) frame at ``start`` begins, and
    whether the frame is raw: neither shuffled nor compressed, its body the tensor's bytes
    as they are."""
    _, _, flags, ndim, _ = _HEADER.unpack_from(frame, start)
    return start + _HEADER.size + 4 * ndim, not flags


def decode_tensor(frame: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Unpack one frame; raise InvalidRequest/PayloadTooLarge on anything malformed."""
    return read_frame(frame, max_bytes=max_bytes).tensor()


def read_frame(frame: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> WireTensor:
    """Read and check one frame, without a torch call; raise InvalidRequest/PayloadTooLarge
    on anything malformed."""
    if len(frame) < _HEADER.size:
        raise InvalidRequest("tensor frame shorter than its header", code="bad_frame")
    magic, dtype_code, flags, ndim, _pad = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise InvalidRequest("not a meshnet tensor frame (bad magic)", code="bad_frame")
    dtype = CODE_DTYPES.get(dtype_code)
    if dtype is None:
        raise InvalidRequest(f"unknown dtype code {dtype_code}", code="bad_frame")
    split = FLAG_SHUFFLED | FLAG_ZSTD | FLAG_SPLIT
    if ndim > MAX_NDIM or flags & ~split or (flags & FLAG_SPLIT and flags != split):
        raise InvalidRequest("malformed tensor frame header", code="bad_frame")
    offset = _HEADER.size + 4 * ndim
    if len(frame) < offset:
        raise InvalidRequest("tensor frame truncated in its shape", code="bad_frame")
    shape = struct.unpack_from(f"<{ndim}I", frame, _HEADER.size)
    itemsize = dtype.itemsize
    expected = itemsize
    for dim in shape:
        expected *= dim
    if expected > max_bytes:
        raise PayloadTooLarge(
            f"tensor of shape {list(shape)} needs {expected} bytes; limit is {max_bytes}",
            code="tensor_too_large",
        )
    body = frame[offset:]
    if flags & FLAG_SPLIT:
        body = _join_planes(body, expected)
    elif flags & FLAG_ZSTD:
        body = _decompress_exact(body, expected)
    elif len(body) != expected:
        raise InvalidRequest(
            f"tensor body has {len(body)} bytes, shape needs {expected}", code="bad_frame"
        )
    if flags & FLAG_SHUFFLED and expected:
        body = _unshuffle(body, itemsize)
    return WireTensor(dtype, shape, body if expected else b"")

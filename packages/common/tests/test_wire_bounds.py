"""A frame costs about its own size to decode (issue #35, ADR-0008): a small zstd frame whose
shape and declared size agree on 64 MiB is refused before anything is decompressed, and a
frame whose declared size is not what its shape needs is refused too."""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard

from meshnet_common import wire
from meshnet_common.errors import InvalidRequest

F32 = wire.DTYPE_CODES[torch.float32]


def frame(shape: tuple[int, ...], body: bytes, flags: int = wire.FLAG_ZSTD) -> bytes:
    head = struct.pack("<4sBBBB", wire.MAGIC, F32, flags, len(shape), 0)
    return head + struct.pack(f"<{len(shape)}I", *shape) + body


def zeros_frame(size: int, *, declared: int | None = None) -> bytes:
    comp = zstandard.ZstdCompressor(level=3, write_content_size=True)
    obj = comp.compressobj(size=size if declared is None else declared)
    chunk = bytes(1 << 20)
    body = b"".join(obj.compress(chunk[: min(1 << 20, size - i)]) for i in range(0, size, 1 << 20))
    return body + obj.flush()


@pytest.fixture
def no_decompression(monkeypatch):
    def refuse():
        raise AssertionError("decompressed a frame that its bounds refuse")

    monkeypatch.setattr(wire, "_decompressor", refuse)


def test_a_small_frame_declaring_64_mib_is_refused_before_decompression(no_decompression):
    body = zeros_frame(64 << 20)
    assert len(body) < 64 << 10
    assert zstandard.get_frame_parameters(body).content_size == 64 << 20
    with pytest.raises(InvalidRequest, match="times its size"):
        wire.decode_tensor(frame((4096, 4096), body))  # 64 MiB of float32: shape agrees


def test_a_split_frame_bomb_is_refused_before_decompression(no_decompression):
    shape = (4096, 4096)  # shuffled planes: the high half (32 MiB) is the zstd part
    high = zeros_frame(32 << 20)
    low = bytes(32 << 20)
    body = struct.pack("<I", len(high)) + high + low
    flags = wire.FLAG_ZSTD | wire.FLAG_SHUFFLED | wire.FLAG_SPLIT
    with pytest.raises(InvalidRequest, match="times its size"):
        wire.decode_tensor(frame(shape, body, flags))


@pytest.mark.parametrize("declared", [8 * 4 * 4 - 4, 8 * 4 * 4 + 4])
def test_a_declared_size_other_than_the_shapes_is_refused(no_decompression, declared):
    with pytest.raises(InvalidRequest, match="shape needs 128"):
        wire.decode_tensor(frame((8, 4), zeros_frame(declared)))


def test_a_frame_without_a_declared_size_is_refused(no_decompression):
    body = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(128))
    with pytest.raises(InvalidRequest, match="shape needs 128"):
        wire.decode_tensor(frame((8, 4), body))


def test_zeros_within_the_floor_still_travel():
    zeros = torch.zeros(256, 1024)  # 1 MiB: compresses far past MAX_RATIO, under the floor
    assert torch.equal(wire.decode_tensor(wire.encode_tensor(zeros)), zeros)


def test_activations_decode_far_within_the_ratio():
    hidden = torch.randn(1, 512, 2048, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(wire.decode_tensor(wire.encode_tensor(hidden)), hidden)  # 2 MiB

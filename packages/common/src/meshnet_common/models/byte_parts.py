"""A file made of runs of bytes — literal, or read from a source file — served without
being written out: the layer subsets a tracker or peer sends (``shardfiles``,
``gguf_subset``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class Part:
    """A run of bytes of the file and where they come from."""

    source: Path | None  # None: the bytes are ``data``
    offset: int
    length: int
    data: bytes = b""


def iter_parts(parts: list[Part], start: int = 0, end: int | None = None) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of the file ``parts`` make, read in bounded chunks."""
    size = sum(p.length for p in parts)
    end = size if end is None else min(end, size)
    position = 0
    for part in parts:
        part_end = position + part.length
        lo, hi = max(start, position), min(end, part_end)
        if lo < hi:
            if part.source is None:
                yield part.data[lo - position : hi - position]
            else:
                yield from read_part(Part(part.source, part.offset + lo - position, hi - lo))
        position = part_end
        if position >= end:
            return


def read_part(part: Part) -> Iterator[bytes]:
    """A source part's bytes in chunks of at most ``READ_CHUNK``."""
    with open(part.source, "rb") as fh:
        fh.seek(part.offset)
        remaining = part.length
        while remaining:
            chunk = fh.read(min(READ_CHUNK, remaining))
            if not chunk:
                raise OSError(f"{part.source}: truncated")
            remaining -= len(chunk)
            yield chunk

"""A layer range of a GGUF file as a GGUF file of its own: what the tracker (or a peer)
sends a joining node, never written to disk on the sending side.

The subset keeps the source's version and its metadata entries byte for byte (config,
tokenizer, chat template: a head needs them), lists only the range's tensors — ``blk.N.*``
for N in the range, ``token_embd`` on the head (and on the tail when the output is tied to
it), ``output_norm`` and ``output`` on the tail, any other global tensor everywhere — with
offsets into its own data section, and carries their bytes as they are in the source (block
formats untouched). Of llama.cpp's split files, it takes the metadata of the first and each
tensor from its own file, so a node receives one GGUF whatever the source's split (the split
keys stay in the copied metadata; readers here ignore them). A node indexes it like any GGUF (``gguf_index``), so it serves the range
from exactly those bytes. Deterministic: the same source and range always give the same
bytes, so it is hashed once, served in HTTP ranges and resumed.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from meshnet_common.layers import LayerRange
from meshnet_common.models.byte_parts import Part
from meshnet_common.models.gguf_header import MAGIC, GgufTensor, read_header
from meshnet_common.models.gguf_index import split_files

SUBSET_GGUF = "model.gguf"
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_HEAD_ONLY, _TAIL_ONLY = ("token_embd.weight",), ("output_norm.weight", "output.weight")


def _wanted(tensor: GgufTensor, layers: LayerRange, num_layers: int, tied: bool) -> bool:
    if m := _BLOCK.match(tensor.name):
        return layers.start <= int(m[1]) < layers.end
    head, tail = layers.is_head(), layers.is_tail(num_layers)
    if tensor.name in _HEAD_ONLY:
        return head or (tail and tied)
    if tensor.name in _TAIL_ONLY:
        return tail
    return True  # rope frequencies and the like: small, and any stage may need them


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


class GgufSubset:
    """The GGUF of ``layers`` of the GGUF at ``path``: ``parts`` (byte runs of the file,
    literal or from the source), its ``size`` and the GGUF ``names`` of its tensors."""

    def __init__(self, path: Path, layers: LayerRange, num_layers: int) -> None:
        files = split_files(path)
        self.path = path = files[0]
        headers = [read_header(f) for f in files]
        header = headers[0]  # the metadata (of a split set: the first file's)
        placed = [(f, t) for f, h in zip(files, headers, strict=True) for t in h.tensors]
        tied = all(t.name != "output.weight" for _, t in placed)
        chosen_from = [(f, t) for f, t in placed if _wanted(t, layers, num_layers, tied)]
        chosen = [t for _, t in chosen_from]
        align = header.alignment
        infos, offsets, cursor = b"", [], 0
        for t in chosen:
            cursor += -cursor % align
            offsets.append(cursor)
            infos += _string(t.name) + struct.pack("<I", len(t.dims))
            infos += b"".join(struct.pack("<Q", d) for d in t.dims)
            infos += struct.pack("<IQ", t.type_id, cursor)
            cursor += t.nbytes
        start, end = header.metadata_span
        count = struct.pack("<IQQ", header.version, len(chosen), _entries(path, start))
        before_data = 4 + len(count) + (end - start) + len(infos)
        infos += b"\0" * (-before_data % align)
        self.parts: list[Part] = [
            Part(None, 0, 4 + len(count), MAGIC + count),
            Part(path, start, end - start),
            Part(None, 0, len(infos), infos),
        ]
        position = 0
        for (file, t), offset in zip(chosen_from, offsets, strict=True):
            if offset > position:
                self.parts.append(Part(None, 0, offset - position, b"\0" * (offset - position)))
            self.parts.append(Part(file, t.offset, t.nbytes))
            position = offset + t.nbytes
        self.size = sum(p.length for p in self.parts)
        self.names = [t.name for t in chosen]
        self.tensors = chosen
        self.sources = [file for file, _ in chosen_from]  # where each tensor's bytes lie


def _entries(path: Path, metadata_start: int) -> int:
    """The source's metadata entry count (the u64 just before its first entry)."""
    with open(path, "rb") as fh:
        fh.seek(metadata_start - 8)
        return struct.unpack("<Q", fh.read(8))[0]

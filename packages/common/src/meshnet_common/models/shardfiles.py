"""Layer subsets of a snapshot as files: one safetensors file holding only a shard's tensors,
generated on the fly from the source files, plus a manifest of sizes and sha256 digests.

A node that joins receives exactly what its layer range needs (ADR 0005). The subset file is
deterministic, so it can be hashed once, served in pieces (HTTP ranges) and resumed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import INDEX_FILE, CheckpointIndex

SUBSET_FILE = "model.safetensors"
H_MANIFEST_SIGNATURE = "x-meshnet-manifest-signature"
MANIFEST_FILE = "meshnet-manifest.json"
READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class Part:
    """A run of bytes of the subset file and where they come from."""

    source: Path | None  # None: the bytes are ``data``
    offset: int
    length: int
    data: bytes = b""


class SubsetFile:
    """A safetensors file of some of a snapshot's tensors, never materialized on disk."""

    def __init__(self, index: CheckpointIndex, names: list[str]) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        parts: list[Part] = []
        cursor = 0
        for name in names:
            info = index.tensors[name]
            header[name] = {
                "dtype": info.dtype,
                "shape": list(info.shape),
                "data_offsets": [cursor, cursor + info.nbytes],
            }
            parts.append(Part(index.root / info.file, info.offset, info.nbytes))
            cursor += info.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
        prefix = struct.pack("<Q", len(raw)) + raw
        self.parts = [Part(None, 0, len(prefix), prefix), *parts]
        self.size = len(prefix) + cursor
        self.names = names

    def iter_bytes(self, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of the file, read from the sources in bounded chunks."""
        end = self.size if end is None else min(end, self.size)
        position = 0
        for part in self.parts:
            part_end = position + part.length
            lo, hi = max(start, position), min(end, part_end)
            if lo < hi:
                if part.source is None:
                    yield part.data[lo - position : hi - position]
                else:
                    with open(part.source, "rb") as fh:
                        fh.seek(part.offset + lo - position)
                        remaining = hi - lo
                        while remaining:
                            chunk = fh.read(min(READ_CHUNK, remaining))
                            if not chunk:
                                raise OSError(f"{part.source}: truncated")
                            remaining -= len(chunk)
                            yield chunk
            position = part_end
            if position >= end:
                return


def canonical_json(manifest: dict) -> bytes:
    """The exact bytes a manifest is signed and sent as."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def sign_manifest(body: bytes, key: str) -> str:
    """HMAC-SHA256 of a manifest under the swarm's manifest key (the root of trust)."""
    return hmac.new(key.encode(), body, hashlib.sha256).hexdigest()


def check_signature(body: bytes, key: str, signature: str | None) -> bool:
    return signature is not None and hmac.compare_digest(sign_manifest(body, key), signature)


def subset_index_json(subset: SubsetFile) -> bytes:
    """The ``model.safetensors.index.json`` of a subset snapshot."""
    index = {
        "metadata": {"total_size": subset.size},
        "weight_map": dict.fromkeys(subset.names, SUBSET_FILE),
    }
    return json.dumps(index, indent=2, sort_keys=True).encode()


def _sha256_iter(chunks) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    for chunk in chunks:
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(READ_CHUNK):
            yield chunk


class ShardSource:
    """Everything needed to serve one layer range of one snapshot: files and manifest."""

    def __init__(self, index: CheckpointIndex, model_id: str, layers: LayerRange, revision: str):
        self.index = index
        self.model_id = model_id
        self.layers = layers
        self.revision = revision
        self.subset = SubsetFile(index, index.tensors_for(layers))
        self.index_json = subset_index_json(self.subset)
        self._manifest: dict | None = None

    def files(self) -> list[str]:
        return [SUBSET_FILE, INDEX_FILE, *self.index.auxiliary_files()]

    def size_of(self, name: str) -> int:
        if name == SUBSET_FILE:
            return self.subset.size
        if name == INDEX_FILE:
            return len(self.index_json)
        return (self.index.root / name).stat().st_size

    def iter_file(self, name: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        if name == SUBSET_FILE:
            yield from self.subset.iter_bytes(start, end)
        elif name == INDEX_FILE:
            yield self.index_json[start:end]
        else:
            with open(self.index.root / name, "rb") as fh:
                fh.seek(start)
                remaining = (self.size_of(name) if end is None else end) - start
                while remaining > 0 and (chunk := fh.read(min(READ_CHUNK, remaining))):
                    remaining -= len(chunk)
                    yield chunk

    def manifest(self) -> dict:
        """Sizes and sha256 of every file and tensor (computed once: one pass over the shard)."""
        if self._manifest is None:
            files = []
            for name in self.files():
                sha, size = _sha256_iter(self.iter_file(name))
                files.append({"name": name, "size": size, "sha256": sha})
            tensors = []
            for name, part in zip(self.subset.names, self.subset.parts[1:], strict=True):
                info = self.index.tensors[name]
                sha, _ = _sha256_iter(_read_part(part))
                tensors.append(
                    {"name": name, "dtype": info.dtype, "shape": list(info.shape),
                     "size": info.nbytes, "sha256": sha}
                )  # fmt: skip
            self._manifest = {
                "model_id": self.model_id,
                "revision": self.revision,
                "shard_start": self.layers.start,
                "shard_end": self.layers.end,
                "files": files,
                "tensors": tensors,
                "tensor_bytes": sum(t["size"] for t in tensors),
            }
        return self._manifest


def _read_part(part: Part) -> Iterator[bytes]:
    with open(part.source, "rb") as fh:
        fh.seek(part.offset)
        remaining = part.length
        while remaining:
            chunk = fh.read(min(READ_CHUNK, remaining))
            if not chunk:
                raise OSError(f"{part.source}: truncated")
            remaining -= len(chunk)
            yield chunk

"""Layer subsets of a snapshot as files: one safetensors file holding only a shard's tensors,
generated on the fly from the source files, plus a manifest of sizes and sha256 digests.

A node that joins receives exactly what its layer range needs (ADR 0005). The subset file is
deterministic, so it can be hashed once, served in pieces (HTTP ranges) and resumed.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections.abc import Iterator

from meshnet_common.layers import LayerRange
from meshnet_common.models.byte_parts import READ_CHUNK, Part, iter_parts, read_part
from meshnet_common.models.checkpoint import INDEX_FILE, CheckpointIndex
from meshnet_common.models.gguf_subset import SUBSET_GGUF, GgufSubset

SUBSET_FILE = "model.safetensors"
MANIFEST_FILE = "meshnet-manifest.json"


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
        return iter_parts(self.parts, start, end)


def canonical_json(manifest: dict) -> bytes:
    """The exact bytes a manifest is signed and sent as."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


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


class ShardSource:
    """Everything needed to serve one layer range of one snapshot: files and manifest.
    A safetensors snapshot's range is one safetensors file, its index and the snapshot's
    config and tokenizer files; a GGUF's is one GGUF (``gguf_subset``: config and tokenizer
    ride in its metadata)."""

    def __init__(self, index: CheckpointIndex, model_id: str, layers: LayerRange, revision: str):
        self.index = index
        self.model_id = model_id
        self.layers = layers
        self.revision = revision
        self.gguf = None
        if index.gguf is not None:
            self.gguf = GgufSubset(index.root / index.gguf.file, layers, index.num_layers)
            self.subset_name = SUBSET_GGUF
        else:
            self.subset = SubsetFile(index, index.tensors_for(layers))
            self.index_json = subset_index_json(self.subset)
            self.subset_name = SUBSET_FILE
        self._manifest: dict | None = None
        self._hashing = threading.Lock()  # concurrent requests wait for one hashing pass

    def files(self) -> list[str]:
        if self.gguf is not None:
            return [SUBSET_GGUF]
        return [SUBSET_FILE, INDEX_FILE, *self.index.auxiliary_files()]

    def size_of(self, name: str) -> int:
        if name == SUBSET_GGUF and self.gguf is not None:
            return self.gguf.size
        if name == SUBSET_FILE:
            return self.subset.size
        if name == INDEX_FILE:
            return len(self.index_json)
        return (self.index.root / name).stat().st_size

    def iter_file(self, name: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        if name == SUBSET_GGUF and self.gguf is not None:
            yield from iter_parts(self.gguf.parts, start, end)
        elif name == SUBSET_FILE:
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
        """Sizes and sha256 of every file and tensor, computed once per range: concurrent
        callers wait for the first one's pass over the shard."""
        with self._hashing:
            if self._manifest is None:
                self._manifest = self._compute_manifest()
        return self._manifest

    def _compute_manifest(self) -> dict:
        files = []
        for name in self.files():
            sha, size = _sha256_iter(self.iter_file(name))
            files.append({"name": name, "size": size, "sha256": sha})
        tensors = []
        for name, dtype, shape, part in self._tensor_parts():
            sha, _ = _sha256_iter(read_part(part))
            tensors.append(
                {"name": name, "dtype": dtype, "shape": shape, "size": part.length, "sha256": sha}
            )
        return {
            "model_id": self.model_id,
            "revision": self.revision,
            "shard_start": self.layers.start,
            "shard_end": self.layers.end,
            "files": files,
            "tensors": tensors,
            "tensor_bytes": sum(t["size"] for t in tensors),
        }

    def _tensor_parts(self) -> Iterator[tuple[str, str, list[int], Part]]:
        """(name, dtype, shape, bytes) of each tensor of the range, as the subset names it."""
        if self.gguf is not None:
            for t, file in zip(self.gguf.tensors, self.gguf.sources, strict=True):
                yield t.name, t.type_name, list(reversed(t.dims)), Part(file, t.offset, t.nbytes)
            return
        for name, part in zip(self.subset.names, self.subset.parts[1:], strict=True):
            info = self.index.tensors[name]
            yield name, info.dtype, list(info.shape), part

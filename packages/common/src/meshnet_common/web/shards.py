"""Serving layer subsets of model files (``GET /v1/shards/...``), on the tracker and on nodes.

A joining node asks for the manifest of ``model`` + ``[start, end)`` (optionally at
``revision``: a source holding another one answers 404), then downloads each file it lists; the weights arrive as one safetensors file holding only that range's tensors.
Downloads stream from disk (no whole-file buffering), honour HTTP ranges (resume), and at
most ``max_concurrent`` run at once per source: the rest wait their turn (``download_slots``:
a bounded wait, then 503; at most two per address; a slot is kept while its reader keeps a
floor rate). On the tracker, every
manifest is signed with its key (``meshnet_common.trust.manifest_keys``), the root of trust for weights.
A manifest is hashed once per (model, revision, range) and kept (``MANIFESTS_KEPT``); a fresh
one is hashed inside a download slot, one at a time per peer (the next waits), and a peer
gets ``FRESH_PER_WINDOW`` per ``FRESH_WINDOW_S`` (429 beyond): asking for many fresh ranges
costs the asker, not the server (docs/adr/0032).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from meshnet_common.errors import (
    CapacityExceeded,
    InvalidRequest,
    ModelError,
    NotFound,
    RangeNotSatisfiable,
    RateLimited,
)
from meshnet_common.layers import LayerRange
from meshnet_common.logs import event
from meshnet_common.metrics import Metrics
from meshnet_common.models.byte_parts import Part, read_part
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.gguf_header import read_header
from meshnet_common.models.models_dir import snapshot_fingerprint, validate_model_id
from meshnet_common.models.shardfiles import (
    MANIFEST_FILE,
    SUBSET_FILE,
    ShardSource,
    canonical_json,
)
from meshnet_common.trust.manifest_keys import H_MANIFEST_SIGNATURE, ManifestSigner
from meshnet_common.web.download_slots import DownloadSlots

logger = logging.getLogger(__name__)

Resolver = Callable[[str], Path]  # model id -> snapshot folder (NotFound if unknown)
FAULTS = ("corrupt", "truncate")
MANIFESTS_KEPT = 256  # hashed manifests kept (a few KB each)
FRESH_PER_WINDOW = 8  # fresh manifests one peer may have hashed per window...
FRESH_WINDOW_S = 60.0  # ...of this many seconds (one at a time)
PEERS_TRACKED = 1024  # peers whose fresh manifests are counted (the least recent go)


def snapshot_revision(index: CheckpointIndex) -> str:
    """A cheap revision id: the hub revision folder name (an HF cache's commit), else the
    revision a fetched shard's manifest names (a peer serves it as the tracker's), else a
    digest of index + config (of a GGUF: of its metadata, which a subset of it keeps byte
    for byte)."""
    if index.root.parent.name == "snapshots":
        return index.root.name
    fetched = _manifest_revision(index.root / MANIFEST_FILE)
    if fetched is not None:
        return fetched
    if index.gguf is not None:
        path = index.root / index.gguf.file
        stat = path.stat()
        return _gguf_revision(path, stat.st_size, stat.st_mtime_ns)
    digest = hashlib.sha256()
    for name in ("model.safetensors.index.json", "config.json"):
        path = index.root / name
        if path.exists():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _manifest_revision(path: Path) -> str | None:
    try:
        revision = json.loads(path.read_text())["revision"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return revision if isinstance(revision, str) and revision else None


def one_model(model_id: str, snapshot: Path) -> Resolver:
    """A ``Resolver`` serving one model from one snapshot (the tracker's model from the HF
    cache); NotFound for any other id."""

    def resolve(asked: str) -> Path:
        if asked != model_id:
            raise NotFound(f"model {asked!r} not found; this tracker serves {model_id}")
        return snapshot

    return resolve


@functools.lru_cache(maxsize=64)
def _gguf_revision(path: Path, _size: int, _mtime_ns: int) -> str:
    start, end = read_header(path).metadata_span
    digest = hashlib.sha256()
    for chunk in read_part(Part(path, start, end - start)):
        digest.update(chunk)
    return digest.hexdigest()[:16]


class FreshManifests:
    """Fresh manifest hashes by peer: ``FRESH_PER_WINDOW`` per ``FRESH_WINDOW_S``
    (RateLimited beyond), one at a time (the next waits its turn). The event loop's."""

    def __init__(self, *, clock=time.monotonic) -> None:
        self.clock = clock
        self._started: OrderedDict[str, list[float]] = OrderedDict()  # peer -> start times
        self._turns: dict[str, tuple[asyncio.Lock, int]] = {}  # peer -> its lock, users

    def queued(self, peer: str) -> int:
        """``peer``'s fresh manifests hashing or waiting their turn."""
        return self._turns[peer][1] if peer in self._turns else 0

    @contextlib.asynccontextmanager
    async def turn(self, peer: str):
        """Count a fresh manifest against ``peer`` and hold its turn while it hashes."""
        now = self.clock()
        recent = [t for t in self._started.pop(peer, []) if now - t < FRESH_WINDOW_S]
        self._started[peer] = recent  # the most recent peer last
        while len(self._started) > PEERS_TRACKED:
            self._started.popitem(last=False)
        if len(recent) >= FRESH_PER_WINDOW:
            raise RateLimited(
                f"{len(recent)} manifests of new layer ranges were hashed for you in the last "
                f"{FRESH_WINDOW_S:.0f} s: ask again later", code="manifest_busy",
            )  # fmt: skip
        recent.append(now)
        lock, users = self._turns.get(peer) or (asyncio.Lock(), 0)
        self._turns[peer] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._turns[peer]
            if users > 1:
                self._turns[peer] = (lock, users - 1)
            else:
                del self._turns[peer]


class ShardServer:
    """Resolves, caches and streams shard sources."""

    def __init__(
        self,
        resolve: Resolver,
        *,
        max_concurrent: int = 4,
        fault: str | None = None,
        signer: ManifestSigner | None = None,
    ):
        self.resolve = resolve
        self.slots = DownloadSlots(max_concurrent)
        self.fault = fault
        self.signer = signer  # the tracker's: the root of trust for weights (ADR-0032)
        self._sources: OrderedDict[tuple, ShardSource] = OrderedDict()
        self._manifests: OrderedDict[tuple, dict] = OrderedDict()  # by the sources' key
        self.fresh = FreshManifests()  # fresh manifests hashed, by peer
        self.bytes_sent = 0
        self.downloads = 0  # file downloads started (resumed ones count again)

    def source(
        self, model_id: str, start: int, end: int, revision: str | None = None
    ) -> ShardSource:
        """The range's source; ``revision``: the one the caller wants (NotFound when the
        snapshot here is another: two revisions never mix in one shard)."""
        return self._source(model_id, start, end, revision)[1]

    async def manifest(
        self, model_id: str, start: int, end: int, revision: str | None, peer: str
    ) -> dict:  # fmt: skip
        """The range's manifest, hashed once per (model, revision, range, files). A fresh
        one is hashed in ``peer``'s turn (``FreshManifests``: RateLimited past its
        bound) and inside a download slot (CapacityExceeded when none frees up)."""
        key, src = self._source(model_id, start, end, revision)
        found = self._manifests.get(key)
        if found is not None:
            self._manifests.move_to_end(key)
            return found
        async with self.fresh.turn(peer):
            if key in self._manifests:  # hashed while this request waited its turn
                return self._manifests[key]
            lease = await self.slots.acquire(sum(src.size_of(f) for f in src.files()))
            if lease is None:
                raise CapacityExceeded("every download slot is busy; retry shortly")
            self.slots.begin(lease)
            try:
                found = await asyncio.to_thread(src.manifest)
            finally:
                self.slots.release(lease)
        self._manifests[key] = found
        while len(self._manifests) > MANIFESTS_KEPT:
            self._manifests.popitem(last=False)
        return found

    def _source(
        self, model_id: str, start: int, end: int, revision: str | None
    ) -> tuple[tuple, ShardSource]:
        """``source`` and the key it is cached by."""
        validate_model_id(model_id)
        try:
            layers = LayerRange(start, end)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"bad layer range: {exc}", param="start") from exc
        try:
            index = CheckpointIndex.load(self.resolve(model_id))
        except NotFound as exc:  # the message names the models folder: keep that local
            raise NotFound(f"model {model_id!r} is not served here", param="model") from exc
        except ModelError as exc:
            logger.error("cannot serve files of %s: %s", model_id, exc)
            raise ModelError(f"the files of {model_id!r} are unusable here") from exc
        if layers.end > index.num_layers:
            raise InvalidRequest(f"{model_id} has {index.num_layers} layers", param="end")
        held = {index.layer_of(n) for n in index.tensors} - {None}
        missing = [layer for layer in layers if layer not in held]
        if missing:
            raise NotFound(f"layers {missing[0]}.. of {model_id} are not held here", param="start")
        # The fingerprint: a snapshot whose files changed in place is hashed anew.
        key = (model_id, snapshot_revision(index), start, end, snapshot_fingerprint(index.root))
        if revision is not None and revision != key[1]:
            raise NotFound(
                f"{model_id} is served here at revision {key[1]}, not {revision}",
                param="revision",
            )
        cached = self._sources.get(key)
        if cached is None:
            cached = self._sources[key] = ShardSource(index, model_id, layers, key[1])
            while len(self._sources) > 16:
                self._sources.popitem(last=False)
        return key, cached

    def faulty(self, chunks: Iterator[bytes], size: int) -> Iterator[bytes]:
        """Fault injection for tests: flip a byte mid-file, or stop halfway."""
        sent = 0
        for chunk in chunks:
            if self.fault == "truncate" and sent + len(chunk) > size // 2:
                yield chunk[: size // 2 - sent]
                return
            if self.fault == "corrupt" and sent <= size // 2 < sent + len(chunk):
                i = size // 2 - sent
                chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1 :]
            sent += len(chunk)
            yield chunk


_RANGE = re.compile(r"bytes=(\d{1,19})?-(\d{1,19})?")


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """One RFC 9110 byte range (``a-b``, ``a-`` or suffix ``-n``) as a half-open span."""
    if not header:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None or match.groups() == (None, None):
        raise InvalidRequest(
            "malformed range header: expected one 'bytes=START-END' range", param="range"
        )
    first, last = match.groups()
    if first is None:  # the last n bytes
        start, end = max(0, size - int(last)), size
        if int(last) == 0:
            raise RangeNotSatisfiable(f"empty suffix range of a {size}-byte file", size=size)
    else:
        start = int(first)
        end = size if last is None else min(int(last) + 1, size)
        if last is not None and int(last) < start:
            raise InvalidRequest("malformed range header: end before start", param="range")
    if start >= size:
        raise RangeNotSatisfiable(f"range starts past the file's {size} bytes", size=size)
    return start, end


def watch_shard_server(metrics: Metrics, app) -> None:
    """Expose the downloads an app's ``ShardServer`` (set later, maybe never) has served."""

    def read(field: str) -> float:
        shard_server = getattr(app.state, "shards", None)
        return getattr(shard_server, field, 0)

    metrics.watch(
        "shard_downloads_served", "Shard file downloads served to peers",
        lambda: read("downloads"), kind="counter",
    )  # fmt: skip
    metrics.watch(
        "shard_served_bytes", "Shard file bytes served to peers",
        lambda: read("bytes_sent"), kind="counter",
    )  # fmt: skip


def shards_router() -> APIRouter:
    router = APIRouter()

    def server(request: Request) -> ShardServer:
        shard_server = getattr(request.app.state, "shards", None)
        if shard_server is None:
            raise NotFound("this service serves no model files")
        return shard_server

    @router.get("/v1/shards/manifest")
    async def manifest(
        request: Request, model: str, start: int = Query(ge=0), end: int = Query(gt=0),
        revision: str | None = None,
    ):  # fmt: skip
        shard_server = server(request)
        peer = request.client.host if request.client else ""
        body = canonical_json(await shard_server.manifest(model, start, end, revision, peer))
        headers = {}
        if shard_server.signer is not None:
            headers[H_MANIFEST_SIGNATURE] = shard_server.signer.sign_manifest(body)
        return Response(body, media_type="application/json", headers=headers)

    @router.get("/v1/shards/download")
    async def download(
        request: Request, model: str, file: str, start: int = Query(ge=0), end: int = Query(gt=0),
        revision: str | None = None,
    ):  # fmt: skip
        shard_server = server(request)
        src = shard_server.source(model, start, end, revision)
        if file not in src.files():
            raise NotFound(f"{file!r} is not part of this shard", param="file")
        size = src.size_of(file)
        byte_range = _parse_range(request.headers.get("range"), size)
        lo, hi = byte_range or (0, size)
        peer = request.client.host if request.client else None
        lease = await shard_server.slots.acquire(hi - lo, peer=peer)  # queue behind others
        if lease is None:
            raise CapacityExceeded(
                "no download slot is free (at most "
                f"{shard_server.slots.per_peer} per address); retry shortly"
            )
        shard_server.downloads += 1
        event(logger, logging.INFO, "shard download", model=model, layers=f"[{start}, {end})",
              file=file, bytes=hi - lo, resumed_at=lo)  # fmt: skip

        def body() -> Iterator[bytes]:
            shard_server.slots.begin(lease)
            try:
                chunks = src.iter_file(file, lo, hi)
                if shard_server.fault and file == SUBSET_FILE:
                    chunks = shard_server.faulty(chunks, size)
                for chunk in chunks:
                    if shard_server.slots.overdue(lease):  # behind the floor rate: the reader
                        logger.warning("shard download of %s overran its slot", file)
                        return  # resumes from here with a range request
                    shard_server.bytes_sent += len(chunk)
                    yield chunk  # returns once the reader took it (the send's backpressure)
                    shard_server.slots.sent(lease, len(chunk))
            finally:
                shard_server.slots.release(lease)

        headers = {"accept-ranges": "bytes", "content-length": str(hi - lo)}
        if byte_range:
            headers["content-range"] = f"bytes {lo}-{hi - 1}/{size}"
        status = 206 if byte_range else 200
        return StreamingResponse(
            body(), status_code=status, media_type="application/octet-stream", headers=headers
        )

    return router

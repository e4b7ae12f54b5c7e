"""Getting a shard's files onto a node: from peers or the tracker (layer subsets, verified
against a manifest), then the HF hub (``hub``).

The root of trust (docs/adr/0032) is the tracker: with one, the manifest comes from it
alone, signed with its key (pinned with ``--tracker-key``, else asked of the tracker), and
every byte from a peer, every cached shard and every hub file is checked against it. A peer's
own manifest is never taken instead. Without a tracker, the source named on the command line
is trusted.

Cache layout of shards from peers and the tracker (meshnet's own)::

    CACHE/ORG/NAME/layers-START-END/        verified shard (manifest written last)
    CACHE/ORG/NAME/.partial-START-END/      an unfinished download (resumable)

A file whose size or sha256 disagrees with the manifest is deleted and the source is
abandoned; nothing unverified is ever moved into place. A cached shard is hashed again
before each use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from meshnet_common.errors import InvalidRequest, ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.metrics import Metrics
from meshnet_common.models.models_dir import validate_model_id
from meshnet_common.models.shardfiles import MANIFEST_FILE
from meshnet_common.trust.identity import Identity
from meshnet_common.trust.manifest_keys import H_MANIFEST_SIGNATURE, KEY_PATH, ManifestKey
from meshnet_common.web import tls
from meshnet_common.web.auth import swarm_headers
from meshnet_common.web.swarm_client import limit, swarm_client
from meshnet_node.retry import RetryPolicy
from meshnet_node.swarm import FetchError
from meshnet_node.swarm.hub import COMMIT, check_against, fetch_from_hub
from meshnet_node.swarm.trackers import Trackers

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 2.0
# A file's transfer: 3 attempts in all (a broken one resumes where it stopped), no waiting.
RESUME_RETRY = RetryPolicy(max_attempts=3)


def shard_dir(cache_dir: Path, model_id: str, layers: LayerRange) -> Path:
    org, name = validate_model_id(model_id)
    return Path(cache_dir) / org / name / f"layers-{layers.start}-{layers.end}"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cached_shard(
    cache_dir: Path, model_id: str, layers: LayerRange, expected: dict | None = None
) -> Path | None:
    """A previously verified shard whose files still hash to its manifest (read again in
    full: a disk can rot, a file be edited), and, given the trusted ``expected`` manifest,
    list the very same files; None otherwise."""
    target = shard_dir(cache_dir, model_id, layers)
    manifest_path = target / MANIFEST_FILE
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return None
    if expected is not None and _file_digests(files) != _file_digests(expected["files"]):
        logger.info("cached %s layers %s is not the tracker's revision", model_id, layers)
        return None
    for entry in files:
        path = target / entry["name"]
        if not path.is_file() or path.stat().st_size != entry["size"]:
            return None
        if _sha256_file(path) != entry["sha256"]:
            logger.warning("cached %s: %s no longer matches its sha256", target, entry["name"])
            return None
    return target


def _file_digests(files: list[dict]) -> dict[str, tuple[int, str]]:
    return {f["name"]: (f["size"], f["sha256"]) for f in files}


class Progress:
    """Logs bytes, rate and ETA of a download every few seconds."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.done = 0
        self.started = self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S or self.done >= self.total:
            self.last = now
            rate = self.done / max(now - self.started, 1e-6)
            eta = (self.total - self.done) / rate if rate else float("inf")
            logger.info(
                "%s: %.1f/%.1f MiB (%.1f MiB/s, ETA %.0fs)",
                self.label, self.done / 2**20, self.total / 2**20, rate / 2**20, eta,
            )  # fmt: skip


def _download_file(
    client: httpx.Client, url: str, params: dict, entry: dict, dest: Path, progress: Progress
) -> None:
    """Download one file (resuming a partial one), then check its size and sha256."""
    budget = RESUME_RETRY.start()
    while True:
        have = dest.stat().st_size if dest.exists() else 0
        if have > entry["size"]:
            dest.unlink()
            have = 0
        if have < entry["size"]:
            headers = {"range": f"bytes={have}-"} if have else {}
            try:
                with client.stream("GET", url, params={**params, "file": entry["name"]},
                                   headers=headers, extensions=limit(entry["size"] - have),
                                   ) as resp:  # fmt: skip
                    if resp.status_code not in (200, 206):
                        raise FetchError(f"{entry['name']}: HTTP {resp.status_code}")
                    mode = "ab" if resp.status_code == 206 else "wb"
                    written = have if mode == "ab" else 0
                    with open(dest, mode) as fh:
                        for chunk in resp.iter_bytes():  # identity: the client refused others
                            written += len(chunk)
                            if written > entry["size"]:  # never let a source fill the disk
                                raise FetchError(f"{entry['name']}: more bytes than the manifest")
                            fh.write(chunk)
                            progress.add(len(chunk))
            except httpx.HTTPError as exc:
                logger.warning("%s: transfer broke (%s); resuming", entry["name"], exc)
                if budget.failed():
                    if pause := budget.backoff():
                        time.sleep(pause)
                    continue
        break
    if not dest.exists() or dest.stat().st_size != entry["size"]:
        size = dest.stat().st_size if dest.exists() else 0
        dest.unlink(missing_ok=True)
        raise FetchError(f"{entry['name']}: got {size} bytes, manifest says {entry['size']}")
    if _sha256_file(dest) != entry["sha256"]:
        dest.unlink()
        raise FetchError(f"{entry['name']}: sha256 mismatch (corrupted in transfer)")


@dataclass(frozen=True)
class Trust:
    """Where manifests come from and how they are checked (docs/adr/0032).

    ``tracker``: the tracker(s) the node was told to trust (a URL, or the swarm's trackers:
    the current one is asked, the next when it does not answer); with one, manifests come
    from the trackers only, and must carry their signature (the trackers of one swarm share
    one key). ``tracker_key``: its public key (base64) pinned by the operator; without it
    the key is asked of the tracker itself (as trustworthy as the tracker URL: TLS makes it
    so).
    """

    tracker: Trackers | str | None = None
    tracker_key: str | None = None
    swarm_token: str | None = None
    identity: Identity | None = None  # signs the downloads, once certified (docs/adr/0032)

    def __post_init__(self) -> None:
        if isinstance(self.tracker, str):
            object.__setattr__(self, "tracker", Trackers.of(self.tracker) if self.tracker else None)

    @property
    def trackers(self) -> Trackers | None:
        return self.tracker if isinstance(self.tracker, Trackers) else None

    def client(self, timeout: float = 60.0) -> httpx.Client:
        hooks = {"request": [self.identity.sign_request]} if self.identity is not None else None
        return swarm_client(  # manifests; a download sets its file's size (limit)
            timeout=httpx.Timeout(timeout, connect=5.0), headers=swarm_headers(self.swarm_token),
            verify=tls.client_context(), event_hooks=hooks,
        )  # fmt: skip


def tracker_key(client: httpx.Client, trust: Trust) -> ManifestKey | None:
    """The key manifests must be signed with: the pinned one, else the tracker's; None
    without either (no tracker: the command line's source is trusted)."""
    try:
        if trust.tracker_key:
            return ManifestKey.from_text(trust.tracker_key)
        if trust.trackers is None:
            return None
        resp = trust.trackers.send(lambda base: client.get(f"{base}{KEY_PATH}"))
        resp.raise_for_status()
        return ManifestKey.from_text(str(resp.json()["public_key"]))
    except (httpx.HTTPError, InvalidRequest, ValueError, KeyError, TypeError) as exc:
        raise FetchError(f"no key to check manifests with: {exc}") from exc


def get_manifest(
    client: httpx.Client, source: str, params: dict, trust: Trust, key: ManifestKey | None
) -> dict:
    """The shard's manifest: the tracker's when there is one (a peer's is never taken in
    its place), signed under ``key`` when there is one."""

    def ask(base: str) -> httpx.Response:
        return client.get(f"{base.rstrip('/')}/v1/shards/manifest", params=params)

    trackers = trust.trackers
    try:
        resp = ask(source) if trackers is None else trackers.send(ask)
    except httpx.HTTPError as exc:
        where = source if trackers is None else trackers.describe()
        raise FetchError(f"{where} unreachable for the manifest: {exc}") from exc
    origin = source if trackers is None else trackers.current
    if resp.status_code != 200:
        raise FetchError(f"{origin} has no manifest for it (HTTP {resp.status_code})")
    if key is not None:
        problem = key.manifest_problem(resp.content, resp.headers.get(H_MANIFEST_SIGNATURE))
        if problem is not None:
            raise FetchError(f"{origin}: {problem}")
    manifest = resp.json()
    wanted = (params["model"], params["start"], params["end"])
    if (manifest.get("model_id"), manifest.get("shard_start"), manifest.get("shard_end")) != wanted:
        raise FetchError(f"{origin} answered a manifest for another shard")
    return manifest


def trusted_manifest(model_id: str, layers: LayerRange, trust: Trust) -> dict | None:
    """The tracker's signed manifest of the range (None without a tracker); FetchError when
    the tracker cannot give one: then no peer can be trusted either."""
    if trust.trackers is None:
        return None
    params = {"model": model_id, "start": layers.start, "end": layers.end}
    with trust.client() as client:
        key = tracker_key(client, trust)
        return get_manifest(client, trust.trackers.current, params, trust, key)


def fetch_from(
    source: str,
    model_id: str,
    layers: LayerRange,
    cache_dir: Path,
    trust: Trust = Trust(),
    manifest: dict | None = None,
    revision: str | None = None,
) -> Path:
    """Fetch the shard's subset from one peer or tracker, checked against ``manifest`` (the
    trusted one; without: the source's own, which only a tracker-less node accepts, of
    ``revision`` when that names a commit); FetchError on any defect."""
    target = shard_dir(cache_dir, model_id, layers)
    staging = target.parent / f".partial-{layers.start}-{layers.end}"
    params = {"model": model_id, "start": layers.start, "end": layers.end}
    if manifest is None and revision is not None and COMMIT.fullmatch(revision):
        params["revision"] = revision
    base = source.rstrip("/")
    with trust.client() as client:
        if manifest is None:
            if trust.tracker:
                raise FetchError("no manifest from the tracker: a peer's own is not trusted")
            manifest = get_manifest(client, source, params, trust, tracker_key(client, trust))
        staging.mkdir(parents=True, exist_ok=True)
        stamp = staging / "revision"
        if stamp.exists() and stamp.read_text() != manifest["revision"]:
            shutil.rmtree(staging)  # partial files of another revision cannot be resumed
            staging.mkdir(parents=True)
        stamp.write_text(manifest["revision"])
        total = sum(f["size"] for f in manifest["files"])
        # Each download names the revision: a source holding another one answers 404 and
        # sends no byte (rather than bytes that fail the manifest's hashes).
        params["revision"] = manifest["revision"]
        progress = Progress(f"{model_id} layers {layers} from {source}", total)
        for entry in manifest["files"]:
            name = entry["name"]
            if "/" in name or name.startswith("."):
                raise FetchError(f"{source} listed an unsafe file name {name!r}")
            _download_file(
                client, f"{base}/v1/shards/download", params, entry, staging / name, progress
            )
    stamp.unlink()
    (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)  # the manifest inside marks it verified
    logger.info("fetched %s layers %s: %.1f MiB verified", model_id, layers, total / 2**20)
    return target


def fetch_shard(
    model_id: str,
    layers: LayerRange,
    sources: Sequence[str],
    cache_dir: Path,
    *,
    trust: Trust = Trust(),
    hub: bool = True,
    revision: str | None = None,
    metrics: Metrics | None = None,
) -> Path:
    """Try each source in order (peers, tracker), then the hub (at ``revision``, else the
    tracker's commit when its snapshot names one, else the hub's main branch, pinned to one
    commit); ModelError if all fail. With a tracker, everything is checked against its
    signed manifest, a cached shard included. ``metrics``: counts the outcome in
    ``meshnet_shard_fetches_total{result}`` and ``meshnet_shard_fetched_bytes_total``."""
    try:
        path, cached = _first_good(model_id, layers, sources, cache_dir, trust, hub, revision)
    except ModelError:
        if metrics is not None:
            metrics.shard_fetches.labels("failed").inc()
        raise
    if metrics is not None:
        metrics.shard_fetches.labels("cached" if cached else "ok").inc()
        if not cached:
            files = (f for f in path.iterdir() if f.is_file())
            metrics.fetched_bytes.inc(sum(f.stat().st_size for f in files))
    return path


def _first_good(model_id, layers, sources, cache_dir, trust, hub, revision) -> tuple[Path, bool]:
    """The shard's path from the first source that delivers it, and whether it was the
    cache."""
    failures = []
    try:
        expected = trusted_manifest(model_id, layers, trust)
    except FetchError as exc:
        logger.warning("tracker manifest: %s", exc)
        failures.append(f"tracker: {exc}")
        expected = None
    cached = cached_shard(cache_dir, model_id, layers, expected)
    if cached is not None:
        logger.info("using cached %s layers %s (hashes checked)", model_id, layers)
        return cached, True
    if expected is not None or not trust.tracker:  # without the tracker's, no peer is trusted
        for source in sources:
            try:
                got = fetch_from(source, model_id, layers, cache_dir, trust, expected, revision)
                return got, False
            except (FetchError, OSError, ValueError) as exc:
                logger.warning("source %s failed: %s", source, exc)
                failures.append(f"{source}: {exc}")
    if hub:
        commit = (expected or {}).get("revision", "")
        pin = revision or (commit if COMMIT.fullmatch(commit) else None)
        try:
            path = fetch_from_hub(model_id, layers, cache_dir, revision=pin)
            if expected is not None:
                check_against(path, model_id, layers, expected)
            return path, False
        except FetchError as exc:
            logger.warning("HF hub failed: %s", exc)
            failures.append(f"hub: {exc}")
    raise ModelError(
        f"could not get {model_id} layers {layers} from any source: " + "; ".join(failures)
    )


def fetch_shard_counted(
    model_id: str,
    layers: LayerRange,
    sources: Sequence[str],
    cache_dir: Path,
    *,
    metrics: Metrics,
    trust: Trust = Trust(),
    revision: str | None = None,
) -> Path:
    """``fetch_shard``, counted in ``metrics``."""
    return fetch_shard(
        model_id, layers, sources, cache_dir, trust=trust, revision=revision, metrics=metrics
    )

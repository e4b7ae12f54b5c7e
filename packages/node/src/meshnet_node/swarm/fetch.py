"""Getting a shard's files onto a node: from peers or the tracker (layer subsets, verified
against a manifest), then the HF hub with ``allow_patterns``, then a filtered full snapshot.

Cache layout of shards from peers and the tracker (meshnet's own)::

    CACHE/ORG/NAME/layers-START-END/        verified shard (manifest written last)
    CACHE/ORG/NAME/.partial-START-END/      an unfinished download (resumable)

A file whose size or sha256 disagrees with the manifest is deleted and the source is
abandoned; nothing unverified is ever moved into place.

The HF hub fallback uses huggingface_hub's standard cache (``HF_HUB_CACHE`` / ``HF_HOME``),
so a model already fetched by ``hf download`` or vLLM is not downloaded again.
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

from meshnet_common.errors import ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.metrics import Metrics
from meshnet_common.models.checkpoint import (
    INDEX_FILE,
    CheckpointIndex,
    TensorInfo,
    architecture_of,
    num_layers_of,
    read_config,
)
from meshnet_common.models.models_dir import validate_model_id
from meshnet_common.models.shardfiles import H_MANIFEST_SIGNATURE, MANIFEST_FILE, check_signature
from meshnet_common.web import tls
from meshnet_common.web.auth import swarm_headers
from meshnet_node.retry import RetryPolicy

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 2.0
# A file's transfer: 3 attempts in all (a broken one resumes where it stopped), no waiting.
RESUME_RETRY = RetryPolicy(max_attempts=3)

# Hub files a node loads besides weights: config, tokenizer (incl. sentencepiece), template.
HUB_SMALL_FILE_PATTERNS = ("*.json", "*.txt", "*.jinja", "tokenizer*", "*.model")
# A full snapshot fetches the safetensors weights and those small files, nothing else.
HUB_SNAPSHOT_PATTERNS = ("*.safetensors", *HUB_SMALL_FILE_PATTERNS)
# Other formats and duplicate checkpoints (original/, consolidated.*) no node loads; ``*/*``
# drops every subfolder (onnx/, original/, ...) since patterns' ``*`` also matches "/".
HUB_IGNORE_PATTERNS = (
    "original/*", "*.gguf", "*.bin", "*.pth", "*.pt", "*.onnx", "*.msgpack", "*.h5",
    "consolidated*", "*/*",
)  # fmt: skip


class FetchError(Exception):
    """One source failed; the caller moves on to the next."""


def shard_dir(cache_dir: Path, model_id: str, layers: LayerRange) -> Path:
    org, name = validate_model_id(model_id)
    return Path(cache_dir) / org / name / f"layers-{layers.start}-{layers.end}"


def cached_shard(cache_dir: Path, model_id: str, layers: LayerRange) -> Path | None:
    """A previously verified shard, if its files still match the manifest's sizes."""
    target = shard_dir(cache_dir, model_id, layers)
    manifest_path = target / MANIFEST_FILE
    if not manifest_path.exists():
        return None
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        path = target / entry["name"]
        if not path.exists() or path.stat().st_size != entry["size"]:
            return None
    return target


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
                                   headers=headers) as resp:  # fmt: skip
                    if resp.status_code not in (200, 206):
                        raise FetchError(f"{entry['name']}: HTTP {resp.status_code}")
                    mode = "ab" if resp.status_code == 206 else "wb"
                    written = have if mode == "ab" else 0
                    with open(dest, mode) as fh:
                        for chunk in resp.iter_bytes():
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
    digest = hashlib.sha256()
    with open(dest, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != entry["sha256"]:
        dest.unlink()
        raise FetchError(f"{entry['name']}: sha256 mismatch (corrupted in transfer)")


@dataclass(frozen=True)
class Trust:
    """Where manifests come from and how they are checked.

    ``tracker``: the URL the node was told to trust; manifests are taken from it whenever it
    has the model, so a peer can only ever deliver bytes that match the tracker's digests.
    ``manifest_key``: when set, a manifest must carry a valid HMAC signature under it.
    """

    tracker: str | None = None
    manifest_key: str | None = None
    swarm_token: str | None = None


def get_manifest(client: httpx.Client, source: str, params: dict, trust: Trust) -> dict:
    """The shard's manifest, preferring the trusted tracker over the data source."""
    origins = [trust.tracker, source] if trust.tracker and trust.tracker != source else [source]
    last = ""
    for origin in origins:
        try:
            resp = client.get(f"{origin.rstrip('/')}/v1/shards/manifest", params=params)
        except httpx.HTTPError as exc:
            last = f"{origin} unreachable: {exc}"
            continue
        if resp.status_code != 200:
            last = f"{origin} has no manifest for it (HTTP {resp.status_code})"
            continue
        if trust.manifest_key and not check_signature(
            resp.content, trust.manifest_key, resp.headers.get(H_MANIFEST_SIGNATURE)
        ):
            raise FetchError(f"{origin}: manifest signature missing or wrong")
        if origin != trust.tracker and trust.tracker:
            logger.warning("the tracker has no manifest for this shard; trusting %s", origin)
        return resp.json()
    raise FetchError(last)


def fetch_from(
    source: str, model_id: str, layers: LayerRange, cache_dir: Path, trust: Trust = Trust()
) -> Path:
    """Fetch the shard's subset from one peer or tracker; FetchError on any defect."""
    target = shard_dir(cache_dir, model_id, layers)
    staging = target.parent / f".partial-{layers.start}-{layers.end}"
    params = {"model": model_id, "start": layers.start, "end": layers.end}
    base = source.rstrip("/")
    timeout = httpx.Timeout(60.0, connect=5.0)
    with httpx.Client(
        timeout=timeout, headers=swarm_headers(trust.swarm_token), verify=tls.client_context()
    ) as client:
        manifest = get_manifest(client, source, params, trust)
        if (manifest.get("model_id"), manifest.get("shard_start"), manifest.get("shard_end")) != (
            model_id, layers.start, layers.end,
        ):  # fmt: skip
            raise FetchError(f"{source} answered a manifest for another shard")
        staging.mkdir(parents=True, exist_ok=True)
        stamp = staging / "revision"
        if stamp.exists() and stamp.read_text() != manifest["revision"]:
            shutil.rmtree(staging)  # partial files of another revision cannot be resumed
            staging.mkdir(parents=True)
        stamp.write_text(manifest["revision"])
        total = sum(f["size"] for f in manifest["files"])
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


def _hub_files_for(index_file: Path, config_file: Path, layers: LayerRange) -> list[str]:
    """Weight files holding ``layers``, read from the index's weight_map alone (the weight
    files are not downloaded yet, so their headers cannot be read)."""
    config = read_config(Path(config_file).parent)
    architecture = architecture_of(config, config_file)
    weight_map = json.loads(Path(index_file).read_text())["weight_map"]
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelError(f"{index_file}: empty or malformed weight_map")
    index = CheckpointIndex(
        root=Path(index_file).parent,
        config=config,
        architecture=architecture,
        num_layers=num_layers_of(config),
        tensors={name: TensorInfo(name, str(file), "", (), 0) for name, file in weight_map.items()},
    )
    return index.files_for(layers)


def hub_view(snapshot: Path, cache_dir: Path, model_id: str, layers: LayerRange) -> Path:
    """A loadable folder for a partial hub snapshot: links to the files it holds and an index
    naming only their tensors (the hub's index lists every weight file, and the HF cache's
    own files must not be rewritten)."""
    org, name = validate_model_id(model_id)
    label = f"hub-{snapshot.name}-layers-{layers.start}-{layers.end}"
    view = Path(cache_dir) / org / name / label
    staging = view.parent / f".partial-{label}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    index = json.loads((snapshot / INDEX_FILE).read_text())
    held = set()
    for path in sorted(snapshot.rglob("*")):
        rel = path.relative_to(snapshot)
        if path.is_dir() or rel.as_posix() == INDEX_FILE:
            continue
        held.add(rel.as_posix())
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).symlink_to(path.resolve())
    index["weight_map"] = {t: f for t, f in index["weight_map"].items() if f in held}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))
    if view.exists():
        shutil.rmtree(view)
    os.replace(staging, view)
    return view


def fetch_from_hub(
    model_id: str,
    layers: LayerRange,
    cache_dir: Path,
    *,
    revision: str | None = None,
    hub_cache: Path | None = None,
) -> Path:
    """HF hub: the index first, then only the files holding the range (``allow_patterns``),
    presented through ``hub_view`` under ``cache_dir``; without a readable index (e.g. a
    single ``model.safetensors``), a snapshot filtered to what a node loads. Downloads go to
    the standard HF cache unless ``hub_cache`` overrides it."""
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
    except ImportError as exc:  # pragma: no cover - a dependency
        raise FetchError("huggingface_hub is not installed") from exc
    where: dict = {"revision": revision}
    if hub_cache is not None:  # otherwise HF_HUB_CACHE / HF_HOME decide, as for `hf download`
        where["cache_dir"] = hub_cache
    try:
        index_file = hf_hub_download(model_id, "model.safetensors.index.json", **where)
        config_file = hf_hub_download(model_id, "config.json", **where)
        wanted = _hub_files_for(Path(index_file), Path(config_file), layers)
    except Exception as first:  # noqa: BLE001 - any hub failure means: try the next way
        logger.warning("hub subset for %s failed (%s); trying the full snapshot", model_id, first)
        try:
            return Path(
                snapshot_download(
                    model_id,
                    allow_patterns=list(HUB_SNAPSHOT_PATTERNS),
                    ignore_patterns=list(HUB_IGNORE_PATTERNS),
                    **where,
                )
            )
        except Exception as exc:  # noqa: BLE001
            raise FetchError(f"HF hub: {exc}") from exc
    ignore = list(HUB_IGNORE_PATTERNS)
    if any("/" in name for name in wanted):  # weights in a subfolder: keep that folder
        ignore.remove("*/*")
    logger.info("fetching %s layers %s from the HF hub: %s", model_id, layers, ", ".join(wanted))
    try:
        snapshot = snapshot_download(
            model_id, allow_patterns=[*wanted, *HUB_SMALL_FILE_PATTERNS], ignore_patterns=ignore,
            **where,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        raise FetchError(f"HF hub: {exc}") from exc
    try:
        return hub_view(Path(snapshot), cache_dir, model_id, layers)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FetchError(f"HF hub snapshot {snapshot}: {exc}") from exc


def fetch_shard(
    model_id: str,
    layers: LayerRange,
    sources: Sequence[str],
    cache_dir: Path,
    *,
    trust: Trust = Trust(),
    hub: bool = True,
    revision: str | None = None,
) -> Path:
    """Try each source in order (peers, tracker), then the hub (at ``revision``, default: its
    main branch); ModelError if all fail."""
    cached = cached_shard(cache_dir, model_id, layers)
    if cached is not None:
        logger.info("using cached %s layers %s", model_id, layers)
        return cached
    failures = []
    for source in sources:
        try:
            return fetch_from(source, model_id, layers, cache_dir, trust)
        except (FetchError, OSError, ValueError) as exc:
            logger.warning("source %s failed: %s", source, exc)
            failures.append(f"{source}: {exc}")
    if hub:
        try:
            return fetch_from_hub(model_id, layers, cache_dir, revision=revision)
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
    """``fetch_shard``, counted in ``meshnet_shard_fetches_total{result}`` and
    ``meshnet_shard_fetched_bytes_total``."""
    if cached_shard(cache_dir, model_id, layers) is not None:
        metrics.shard_fetches.labels("cached").inc()
        return fetch_shard(model_id, layers, sources, cache_dir, trust=trust, revision=revision)
    try:
        path = fetch_shard(model_id, layers, sources, cache_dir, trust=trust, revision=revision)
    except ModelError:
        metrics.shard_fetches.labels("failed").inc()
        raise
    metrics.shard_fetches.labels("ok").inc()
    metrics.fetched_bytes.inc(sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
    return path

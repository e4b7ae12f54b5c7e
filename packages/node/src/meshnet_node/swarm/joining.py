"""Joining a swarm: where the shard comes from, what the tracker assigns, and the joining
announcement made while the shard loads."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import psutil

from meshnet_common.errors import ModelError, NotFound
from meshnet_common.layers import LayerRange
from meshnet_common.metrics import Metrics
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.gguf_index import is_gguf
from meshnet_common.models.hub.cache import (
    COMMIT,
    cached_revisions,
    cached_snapshot,
    missing_files,
)
from meshnet_common.models.models_dir import resolve_snapshot, scan_models_dir
from meshnet_common.precision import Precision
from meshnet_common.protocol import (
    AssignRequest,
    AssignResponse,
    Heartbeat,
    NodeAnnouncement,
    NodeState,
    ShardSpec,
)
from meshnet_common.trust.identity import CallChecker, Identity
from meshnet_common.web import swarm_client, tls
from meshnet_common.web.auth import swarm_headers
from meshnet_node.engine.preflight import resolve_device
from meshnet_node.retry import Clock, RetryPolicy
from meshnet_node.settings import NodeSettings
from meshnet_node.swarm import FetchError
from meshnet_node.swarm.fetch import Trust, fetch_shard_counted, trusted_manifest
from meshnet_node.swarm.host_memory import Offer
from meshnet_node.swarm.hub import check_against, hub_view
from meshnet_node.swarm.membership import Membership, RegistrationRefused, error_message

logger = logging.getLogger(__name__)

_SAFE_REVISION = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a revision as a folder name


def local_snapshot(
    settings: NodeSettings, model_id: str, layers: LayerRange | None = None
) -> Path | None:
    """The snapshot on this machine (--model-path, else --models-dir, else, with neither
    given, the standard HF cache's copy of ``layers`` at the swarm's revision), or None."""
    if settings.model_path:
        path = Path(settings.model_path)
        if is_gguf(path):
            return path  # a GGUF file: its metadata is the config
        if not (path / "config.json").exists() and not _holds_gguf(path):
            raise ValueError(f"--model-path {path}: no config.json (nor a .gguf file) there")
        return path
    if settings.models_dir:
        try:
            return resolve_snapshot(settings.models_dir, model_id)
        except NotFound:
            return None
    if layers is not None:
        return hub_cache_shard(settings, model_id, layers)
    return None


def hub_cache_shard(settings: NodeSettings, model_id: str, layers: LayerRange) -> Path | None:
    """The HF cache's copy of ``layers`` (``hf download``, vLLM, ``meshnet-models
    download``): its snapshot when it holds every file, else a view of the files it holds
    when they cover the range; None when it holds no such revision or not the range's files.

    The revision is the swarm's: ``--revision`` (default main), unless the tracker's signed
    manifest names another commit, which wins (a ``--revision`` commit that differs is an
    error); a tracker whose revision is no commit (a models dir) must see the same bytes:
    the range's tensors are hashed against its manifest. Two revisions never mix."""
    asked = settings.revision
    try:
        snapshot = cached_snapshot(model_id, asked)
        if snapshot is None and (asked is not None or not cached_revisions(model_id)):
            return None  # not here: fetched
        expected = _tracker_manifest(settings, model_id, layers)
        served = str((expected or {}).get("revision", ""))
        if COMMIT.fullmatch(served) and (snapshot is None or snapshot.name != served):
            if asked is not None:
                raise ValueError(
                    f"--revision {asked} of {model_id} is commit {snapshot.name} in the HF "
                    f"cache, but the swarm serves commit {served}"
                )
            snapshot = cached_snapshot(model_id, served)  # e.g. downloaded by its commit
        if snapshot is None:
            logger.info("the HF cache holds no revision of %s the swarm serves", model_id)
            return None
        if not missing_files(snapshot):
            path = snapshot
        elif not missing_files(snapshot, layers):
            path = hub_view(snapshot, settings.cache_dir, model_id, layers)
        else:
            logger.info("the HF cache's %s lacks files of layers %s", model_id, layers)
            return None
    except (ModelError, OSError) as exc:  # no huggingface_hub, an unreadable cache
        logger.info("HF cache not used: %s", exc)
        return None
    if expected is not None and not COMMIT.fullmatch(served):
        try:
            check_against(path, model_id, layers, expected)
        except FetchError as exc:
            logger.info("HF cache not used: %s", exc)
            return None
    logger.info("%s layers %s from the HF cache: %s", model_id, layers, snapshot)
    return path


def _tracker_manifest(settings: NodeSettings, model_id: str, layers: LayerRange) -> dict | None:
    """The tracker's signed manifest of the range; None without a tracker, or when it has
    none (a model only nodes bring)."""
    if not settings.tracker_url:
        return None
    try:
        return trusted_manifest(model_id, layers, _trust(settings))
    except FetchError as exc:
        logger.info("no manifest of %s layers %s from the tracker (%s)", model_id, layers, exc)
        return None


def _trust(
    settings: NodeSettings, identity: Identity | None = None, peers: CallChecker | None = None
) -> Trust:
    """Manifests checked with --tracker-key, else the key the tracker answered the node's
    registration with (``peers``: kept since), else the key the tracker serves now."""
    known = peers.tracker_key.text if peers is not None and peers.tracker_key else None
    return Trust(
        tracker=settings.tracker_url,
        tracker_key=settings.tracker_key or known,
        swarm_token=settings.swarm_token,
        identity=identity,
    )


def revision_cache_dir(settings: NodeSettings, model_id: str, layers: LayerRange) -> Path:
    """Where fetched shards of the tracker's revision are kept: ``--cache-dir/revisions/REV``
    (the shards of each revision apart: one never replaces or mixes with another's);
    ``--cache-dir`` itself when no tracker names the revision."""
    revision = str((_tracker_manifest(settings, model_id, layers) or {}).get("revision", ""))
    if not _SAFE_REVISION.fullmatch(revision) or revision.strip(".") == "":
        return settings.cache_dir
    return Path(settings.cache_dir) / "revisions" / revision


def _holds_gguf(folder: Path) -> bool:
    return folder.is_dir() and any(p.suffix == ".gguf" for p in folder.iterdir())


def resolve_model_path(
    settings: NodeSettings,
    model_id: str,
    layers: LayerRange,
    sources: tuple[str, ...] = (),
    metrics: Metrics | None = None,
    local: Path | None = None,
    identity: Identity | None = None,
    peers: CallChecker | None = None,
) -> Path:
    """A local snapshot (``local``: what ``local_snapshot`` found, the HF cache included;
    else --model-path / --models-dir), else the shard fetched from sources into the
    revision's folder of --cache-dir (the downloads signed by ``identity`` once the tracker
    certified it, the manifest checked with the tracker key ``peers`` hold: docs/adr/0032)."""
    local = local or local_snapshot(settings, model_id)
    if local is not None:
        return local
    tracker = (settings.tracker_url,) if settings.tracker_url else ()
    sources = (*settings.shard_sources, *(sources or tracker))
    if not sources:
        raise ValueError(f"no local snapshot of {model_id} and no tracker to fetch it from")
    return fetch_shard_counted(
        model_id,
        layers,
        sources,
        revision_cache_dir(settings, model_id, layers),
        trust=_trust(settings, identity, peers),
        metrics=metrics or Metrics(),
        revision=settings.revision,
    )


# Waiting for the tracker at start: once a second until --tracker-wait has passed.
TRACKER_WAIT_RETRY = RetryPolicy(max_attempts=None, backoff_base_s=1.0, backoff_cap_s=1.0)


def wait_for_tracker(
    url: str,
    wait_s: float,
    *,
    clock: Clock = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    get: Callable[..., object] = swarm_client.get,
) -> None:
    """Return once the tracker answers HTTP at all; OSError after ``wait_s`` seconds."""
    budget = replace(TRACKER_WAIT_RETRY, deadline_s=max(0.0, wait_s)).start(clock)
    while True:
        try:
            get(f"{url.rstrip('/')}/health", timeout=2.0, verify=tls.client_context())
            return
        except httpx.HTTPError as exc:
            if not budget.failed():
                raise OSError(
                    f"tracker {url} unreachable after {wait_s:g}s ({type(exc).__name__}); "
                    "is it running, and is --tracker right?"
                ) from exc
            logger.info("waiting for tracker %s (%s)", url, type(exc).__name__)
            sleep(min(budget.backoff(), budget.remaining()))


def tracker_models(tracker_url: str) -> dict[str, int] | None:
    """Models the tracker knows -> their layer counts; None when it cannot be asked."""
    try:
        resp = swarm_client.get(f"{tracker_url.rstrip('/')}/v1/coverage", timeout=10.0,
                                 verify=tls.client_context())  # fmt: skip
        return {m["id"]: int(m["num_layers"]) for m in resp.json()["models"]}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None  # an old or odd tracker: let the fetch report what goes wrong


def model_layers(settings: NodeSettings, model_id: str, local: Path | None) -> int | None:
    """The model's layer count, checked before any heavy work: from the local snapshot's
    config, else from the tracker (which also refuses a model it has never heard of)."""
    if local is not None:
        return CheckpointIndex.load(local).num_layers
    if not settings.tracker_url:
        return None
    known = tracker_models(settings.tracker_url)
    if known is None:
        return None
    if model_id not in known:
        if settings.shard_sources:
            return None  # peers may have it even if the tracker does not
        raise ValueError(
            f"unknown model {model_id!r}: not on this node and the tracker knows "
            f"{', '.join(known) or 'no model'}"
        )
    return known[model_id]


def ask_assignment(settings: NodeSettings, node_id: str, offer: Offer) -> AssignResponse:
    """Ask the tracker which shard to serve (coverage first): its answer, with where the
    weights can be fetched (peers first, then it)."""
    held: tuple[str, ...] = ()
    if settings.models_dir:
        held = tuple(e.model_id for e in scan_models_dir(settings.models_dir).entries)
    if offer.bytes <= 0:
        raise ValueError(f"no memory to offer: {offer.describe()}")
    ask = AssignRequest(
        node_id=node_id,
        memory_bytes=offer.bytes,
        device=resolve_device(settings.device),
        quantization=settings.quantization,
        dtype=settings.dtype,
        quant_group_size=settings.quant_group_size,
        kv_tokens=settings.kv_budget_tokens,
        held_models=held,
    )
    try:
        resp = swarm_client.post(
            f"{settings.tracker_url.rstrip('/')}/v1/nodes/assign",
            content=ask.model_dump_json(),
            headers=swarm_headers(settings.swarm_token),
            timeout=30,
            verify=tls.client_context(),
        )
    except httpx.HTTPError as exc:
        raise OSError(f"tracker {settings.tracker_url} unreachable: {exc}") from exc
    if resp.status_code != 200:
        raise ValueError(f"the tracker refused to assign a shard: {error_message(resp)}")
    assignment = AssignResponse.model_validate_json(resp.content)
    logger.info(
        "tracker assigned %s layers %s (%s)",
        assignment.shard.model_id, assignment.shard.layers, assignment.reason,
    )  # fmt: skip
    return assignment


def announce_joining(
    settings: NodeSettings, *, node_id: str, url: str, model_id: str, num_layers: int,
    layers: LayerRange, declared: int, movable: bool, precision: Precision | None = None,
) -> Membership:  # fmt: skip
    """Tell the tracker this node is loading ``layers`` (state joining) and keep heartbeating
    while it loads: placement counts the range as on its way, routing ignores it.
    ``precision``: what it will serve at (default: --quantization resolved for a plain
    checkpoint)."""
    if precision is None:
        precision = settings.precision_for(None)
    announcement = NodeAnnouncement(
        node_id=node_id,
        url=url,
        url_explicit=settings.advertise_url is not None,
        movable=movable,
        shard=ShardSpec(model_id=model_id, shard_start=layers.start, shard_end=layers.end),
        num_layers=num_layers,
        **settings.precision_fields(precision),
        device=resolve_device(settings.device),
        memory_declared_bytes=declared,
        memory_free_bytes=int(psutil.virtual_memory().available),
        kv_budget_tokens=settings.kv_budget_tokens,
        state=NodeState.JOINING,
    )

    def heartbeat() -> Heartbeat:
        return Heartbeat(
            node_id=node_id,
            state=NodeState.JOINING,
            active_sessions=0,
            kv_tokens=0,
            memory_free_bytes=int(psutil.virtual_memory().available),
        )

    membership = Membership(
        settings.tracker_url, lambda: announcement, heartbeat, settings.heartbeat_interval_s,
        swarm_token=settings.swarm_token, peers=CallChecker.pinned(settings.tracker_key),
    )  # fmt: skip
    try:
        membership.register_once()
    except RegistrationRefused as exc:
        raise ValueError(f"the tracker refused this node: {exc}") from exc
    except (httpx.HTTPError, ValueError) as exc:
        logger.info("could not announce the range yet (%s); the heartbeat thread retries", exc)
    membership.start()
    return membership

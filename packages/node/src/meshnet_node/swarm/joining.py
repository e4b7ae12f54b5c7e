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
from meshnet_node.swarm.trackers import Trackers

logger = logging.getLogger(__name__)

_SAFE_REVISION = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a revision as a folder name


def swarm_trackers(settings: NodeSettings, trackers: Trackers | None = None) -> Trackers | None:
    """``trackers`` (the process's, shared by its calls), else the ones --tracker names."""
    if trackers is not None or not settings.tracker_url:
        return trackers
    return Trackers(settings.tracker_urls)


def local_snapshot(
    settings: NodeSettings, model_id: str, layers: LayerRange | None = None,
    trackers: Trackers | None = None,
) -> Path | None:  # fmt: skip
    """The snapshot on this machine (--model-path, else --models-dir, else, with neither
    given, the standard HF cache's copy of ``layers`` at the swarm's revision, as
    ``trackers`` serve it), or None."""
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
        return hub_cache_shard(settings, model_id, layers, trackers)
    return None


def hub_cache_shard(
    settings: NodeSettings, model_id: str, layers: LayerRange, trackers: Trackers | None = None
) -> Path | None:
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
        expected = _tracker_manifest(settings, model_id, layers, trackers)
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


def _tracker_manifest(
    settings: NodeSettings, model_id: str, layers: LayerRange, trackers: Trackers | None = None
) -> dict | None:
    """The tracker's signed manifest of the range; None without a tracker, or when it has
    none (a model only nodes bring)."""
    if not settings.tracker_url:
        return None
    try:
        return trusted_manifest(model_id, layers, _trust(settings, trackers=trackers))
    except FetchError as exc:
        logger.info("no manifest of %s layers %s from the tracker (%s)", model_id, layers, exc)
        return None


def _trust(
    settings: NodeSettings, identity: Identity | None = None, peers: CallChecker | None = None,
    trackers: Trackers | None = None,
) -> Trust:  # fmt: skip
    """Manifests checked with --tracker-key, else the key the tracker answered the node's
    registration with (``peers``: kept since), else the key the tracker serves now."""
    known = peers.tracker_key.text if peers is not None and peers.tracker_key else None
    return Trust(
        tracker=swarm_trackers(settings, trackers),
        tracker_key=settings.tracker_key or known,
        swarm_token=settings.swarm_token,
        identity=identity,
    )


def revision_cache_dir(
    settings: NodeSettings, model_id: str, layers: LayerRange, trackers: Trackers | None = None
) -> Path:
    """Where fetched shards of the tracker's revision are kept: ``--cache-dir/revisions/REV``
    (the shards of each revision apart: one never replaces or mixes with another's);
    ``--cache-dir`` itself when no tracker names the revision."""
    revision = str(
        (_tracker_manifest(settings, model_id, layers, trackers) or {}).get("revision", "")
    )
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
    trackers: Trackers | None = None,
) -> Path:
    """A local snapshot (``local``: what ``local_snapshot`` found, the HF cache included;
    else --model-path / --models-dir), else the shard fetched from sources into the
    revision's folder of --cache-dir (the downloads signed by ``identity`` once the tracker
    certified it, the manifest checked with the tracker key ``peers`` hold: docs/adr/0032).
    ``trackers``: the process's (the current one asked first), else --tracker's."""
    local = local or local_snapshot(settings, model_id)
    if local is not None:
        return local
    trackers = swarm_trackers(settings, trackers)
    tracker = trackers.in_order() if trackers is not None else ()
    sources = (*settings.shard_sources, *(sources or tracker))
    if not sources:
        raise ValueError(f"no local snapshot of {model_id} and no tracker to fetch it from")
    return fetch_shard_counted(
        model_id,
        layers,
        sources,
        revision_cache_dir(settings, model_id, layers, trackers),
        trust=_trust(settings, identity, peers, trackers),
        metrics=metrics or Metrics(),
        revision=settings.revision,
    )


# Waiting for the tracker at start: once a second until --tracker-wait has passed.
TRACKER_WAIT_RETRY = RetryPolicy(max_attempts=None, backoff_base_s=1.0, backoff_cap_s=1.0)
ANY_ANSWER = frozenset(range(500, 600))  # a tracker answering HTTP at all is up


def wait_for_tracker(
    trackers: Trackers | str,
    wait_s: float,
    *,
    clock: Clock = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    get: Callable[..., httpx.Response] = swarm_client.get,
) -> None:
    """Return once any of the trackers answers HTTP at all (it becomes the current one);
    OSError after ``wait_s`` seconds."""
    trackers = Trackers.of(trackers)
    budget = replace(TRACKER_WAIT_RETRY, deadline_s=max(0.0, wait_s)).start(clock)
    while True:
        try:
            trackers.send(lambda base: get(f"{base}/health", timeout=2.0,
                                           verify=tls.client_context()),
                          answers=ANY_ANSWER)  # fmt: skip
            return
        except httpx.HTTPError as exc:
            which = "tracker" if len(trackers) == 1 else "trackers"
            if not budget.failed():
                raise OSError(
                    f"{which} {trackers.describe()} unreachable after {wait_s:g}s "
                    f"({type(exc).__name__}); is {'it' if len(trackers) == 1 else 'one'} "
                    "running, and is --tracker right?"
                ) from exc
            logger.info("waiting for %s %s (%s)", which, trackers.describe(), type(exc).__name__)
            sleep(min(budget.backoff(), budget.remaining()))


def tracker_models(trackers: Trackers | str) -> dict[str, int] | None:
    """Models the tracker knows -> their layer counts; None when it cannot be asked."""
    try:
        resp = Trackers.of(trackers).send(lambda base: swarm_client.get(
            f"{base}/v1/coverage", timeout=10.0, verify=tls.client_context()
        ))  # fmt: skip
        return {m["id"]: int(m["num_layers"]) for m in resp.json()["models"]}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None  # an old or odd tracker: let the fetch report what goes wrong


def model_layers(
    settings: NodeSettings, model_id: str, local: Path | None, trackers: Trackers | None = None
) -> int | None:
    """The model's layer count, checked before any heavy work: from the local snapshot's
    config, else from the tracker (which also refuses a model it has never heard of)."""
    if local is not None:
        return CheckpointIndex.load(local).num_layers
    trackers = swarm_trackers(settings, trackers)
    if trackers is None:
        return None
    known = tracker_models(trackers)
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


def ask_assignment(
    settings: NodeSettings, node_id: str, offer: Offer, trackers: Trackers | None = None
) -> AssignResponse:
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
    trackers = swarm_trackers(settings, trackers)
    if trackers is None:
        raise ValueError("without --tracker no shard can be assigned")
    try:
        resp = trackers.send(lambda base: swarm_client.post(
            f"{base}/v1/nodes/assign", content=ask.model_dump_json(),
            headers=swarm_headers(settings.swarm_token), timeout=30, verify=tls.client_context(),
        ))  # fmt: skip
    except httpx.HTTPError as exc:
        raise OSError(f"tracker {trackers.describe()} unreachable: {exc}") from exc
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
    dtype: str | None = None, trackers: Trackers | None = None,
) -> Membership:  # fmt: skip
    """Tell the tracker this node is loading ``layers`` (state joining) and keep heartbeating
    while it loads: placement counts the range as on its way, routing ignores it.
    ``precision``, ``dtype``: what it will serve at and compute in (default: --quantization
    and --dtype resolved for a plain checkpoint)."""
    if precision is None:
        precision = settings.precision_for(None)
    if dtype is None:
        dtype = settings.compute_dtype_for(precision)
    announcement = NodeAnnouncement(
        node_id=node_id,
        url=url,
        url_explicit=settings.advertise_url is not None,
        movable=movable,
        shard=ShardSpec(model_id=model_id, shard_start=layers.start, shard_end=layers.end),
        num_layers=num_layers,
        **settings.precision_fields(precision, dtype),
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
        swarm_trackers(settings, trackers), lambda: announcement, heartbeat, settings.heartbeat_interval_s,
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

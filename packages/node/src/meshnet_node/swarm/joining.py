"""Joining a swarm: where the shard comes from, what the tracker assigns, and the joining
announcement made while the shard loads."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import psutil

from meshnet_common.errors import NotFound
from meshnet_common.layers import LayerRange
from meshnet_common.metrics import Metrics
from meshnet_common.models.checkpoint import CheckpointIndex
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
from meshnet_common.web.auth import swarm_headers
from meshnet_node.engine.preflight import resolve_device
from meshnet_node.retry import Clock, RetryPolicy
from meshnet_node.swarm.fetch import Trust, fetch_shard_counted
from meshnet_node.swarm.host_memory import Offer
from meshnet_node.swarm.membership import Membership, RegistrationRefused, error_message

logger = logging.getLogger(__name__)


def local_snapshot(args) -> Path | None:
    """The snapshot on this machine (--model-path, else --models-dir), or None."""
    if args.model_path:
        path = Path(args.model_path)
        if not (path / "config.json").exists():
            raise ValueError(f"--model-path {path}: no config.json there")
        return path
    if getattr(args, "models_dir", None):
        try:
            return resolve_snapshot(args.models_dir, args.model_id)
        except NotFound:
            return None
    return None


def resolve_model_path(
    args, sources: tuple[str, ...] = (), metrics: Metrics | None = None, local: Path | None = None
) -> Path:
    """A local snapshot (--model-path / --models-dir), else the shard fetched from sources."""
    local = local or local_snapshot(args)
    if local is not None:
        return local
    tracker = (args.tracker,) if getattr(args, "tracker", None) else ()
    sources = (*getattr(args, "shard_source", ()), *(sources or tracker))
    if not sources:
        raise ValueError(f"no local snapshot of {args.model_id} and no tracker to fetch it from")
    trust = Trust(
        tracker=getattr(args, "tracker", None),
        manifest_key=args.manifest_key,
        swarm_token=args.swarm_token,
    )
    return fetch_shard_counted(
        args.model_id,
        LayerRange(args.shard_start, args.shard_end),
        sources,
        Path(args.cache_dir),
        trust=trust,
        metrics=metrics or Metrics(),
        revision=getattr(args, "revision", None),
    )


# Waiting for the tracker at start: once a second until --tracker-wait has passed.
TRACKER_WAIT_RETRY = RetryPolicy(max_attempts=None, backoff_base_s=1.0, backoff_cap_s=1.0)


def wait_for_tracker(
    url: str,
    wait_s: float,
    *,
    clock: Clock = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    get: Callable[..., object] = httpx.get,
) -> None:
    """Return once the tracker answers HTTP at all; OSError after ``wait_s`` seconds."""
    budget = replace(TRACKER_WAIT_RETRY, deadline_s=max(0.0, wait_s)).start(clock)
    while True:
        try:
            get(f"{url.rstrip('/')}/health", timeout=2.0)
            return
        except httpx.HTTPError as exc:
            if not budget.failed():
                raise OSError(
                    f"tracker {url} unreachable after {wait_s:g}s ({type(exc).__name__}); "
                    "is it running, and is --tracker right?"
                ) from exc
            logger.info("waiting for tracker %s (%s)", url, type(exc).__name__)
            sleep(min(budget.backoff(), budget.remaining()))


def tracker_models(args) -> dict[str, int] | None:
    """Models the tracker knows -> their layer counts; None when it cannot be asked."""
    try:
        resp = httpx.get(f"{args.tracker.rstrip('/')}/v1/coverage", timeout=10.0)
        return {m["id"]: int(m["num_layers"]) for m in resp.json()["models"]}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None  # an old or odd tracker: let the fetch report what goes wrong


def model_layers(args, local: Path | None) -> int | None:
    """The model's layer count, checked before any heavy work: from the local snapshot's
    config, else from the tracker (which also refuses a model it has never heard of)."""
    if local is not None:
        return CheckpointIndex.load(local).num_layers
    if not getattr(args, "tracker", None):
        return None
    known = tracker_models(args)
    if known is None:
        return None
    if args.model_id not in known:
        if args.shard_source:
            return None  # peers may have it even if the tracker does not
        raise ValueError(
            f"unknown model {args.model_id!r}: not on this node and the tracker knows "
            f"{', '.join(known) or 'no model'}"
        )
    return known[args.model_id]


def ask_assignment(args, offer: Offer) -> AssignResponse:
    """Ask the tracker which shard to serve (coverage first); fills args in place and
    returns its answer (with where the weights can be fetched: peers first, then it)."""
    held: tuple[str, ...] = ()
    if args.models_dir:
        held = tuple(e.model_id for e in scan_models_dir(args.models_dir).entries)
    if offer.bytes <= 0:
        raise ValueError(f"no memory to offer: {offer.describe()}")
    ask = AssignRequest(
        node_id=args.node_id,
        memory_bytes=offer.bytes,
        device=resolve_device(args.device),
        quantization=Precision(args.quantization),
        kv_tokens=args.kv_budget_tokens,
        held_models=held,
    )
    try:
        resp = httpx.post(
            f"{args.tracker.rstrip('/')}/v1/nodes/assign",
            content=ask.model_dump_json(),
            headers=swarm_headers(args.swarm_token),
            timeout=30,
        )
    except httpx.HTTPError as exc:
        raise OSError(f"tracker {args.tracker} unreachable: {exc}") from exc
    if resp.status_code != 200:
        raise ValueError(f"the tracker refused to assign a shard: {error_message(resp)}")
    assignment = AssignResponse.model_validate_json(resp.content)
    args.model_id = assignment.shard.model_id
    args.shard_start, args.shard_end = assignment.shard.shard_start, assignment.shard.shard_end
    logger.info(
        "tracker assigned %s layers %s (%s)",
        args.model_id, assignment.shard.layers, assignment.reason,
    )  # fmt: skip
    return assignment


def announce_joining(
    args, *, url: str, num_layers: int, layers: LayerRange, declared: int, movable: bool
) -> Membership:
    """Tell the tracker this node is loading ``layers`` (state joining) and keep heartbeating
    while it loads: placement counts the range as on its way, routing ignores it."""
    precision = Precision(args.quantization)
    announcement = NodeAnnouncement(
        node_id=args.node_id,
        url=url,
        url_explicit=args.advertise_url is not None,
        movable=movable,
        shard=ShardSpec(model_id=args.model_id, shard_start=layers.start, shard_end=layers.end),
        num_layers=num_layers,
        quantization=precision,
        device=resolve_device(args.device),
        memory_declared_bytes=declared,
        memory_free_bytes=int(psutil.virtual_memory().available),
        kv_budget_tokens=args.kv_budget_tokens,
        state=NodeState.JOINING,
    )

    def heartbeat() -> Heartbeat:
        return Heartbeat(
            node_id=args.node_id,
            state=NodeState.JOINING,
            active_sessions=0,
            kv_tokens=0,
            memory_free_bytes=int(psutil.virtual_memory().available),
        )

    membership = Membership(
        args.tracker, lambda: announcement, heartbeat, args.heartbeat_interval,
        swarm_token=args.swarm_token,
    )  # fmt: skip
    try:
        membership.register_once()
    except RegistrationRefused as exc:
        raise ValueError(f"the tracker refused this node: {exc}") from exc
    except (httpx.HTTPError, ValueError) as exc:
        logger.info("could not announce the range yet (%s); the heartbeat thread retries", exc)
    membership.start()
    return membership

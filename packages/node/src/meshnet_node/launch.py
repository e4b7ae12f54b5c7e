"""Start a node from parsed flags: the cheap checks, the joining announcement, the shard
(fetched if needed), the app, and the server."""

from __future__ import annotations

import logging
import sys
import time
import uuid
from pathlib import Path

from meshnet_common.config.cli import fail, setup_logging
from meshnet_common.config.node_flags import check_advertise_url, check_range
from meshnet_common.errors import MeshnetError
from meshnet_common.layers import LayerRange
from meshnet_common.memory import ModelCosts
from meshnet_common.metrics import Metrics
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.precision import Precision
from meshnet_common.protocol import NodeAnnouncement, NodeState
from meshnet_common.web.shards import ShardServer
from meshnet_node.engine.preflight import resolve_device
from meshnet_node.settings import HopTimeouts, NodeSettings
from meshnet_node.swarm.host_memory import HostClaims
from meshnet_node.swarm.joining import (
    announce_joining,
    ask_assignment,
    local_snapshot,
    model_layers,
    resolve_model_path,
    wait_for_tracker,
)
from meshnet_node.swarm.membership import Membership

PROG = "meshnet-node"
logger = logging.getLogger("meshnet_node.cli")


def shard_settings(args, *, model_path: Path, host: str, port: int, **extra) -> NodeSettings:
    """NodeSettings from parsed shard flags (validates the range against the model)."""
    try:
        layers = LayerRange(args.shard_start, args.shard_end)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--shard-start/--shard-end: {exc}") from exc
    return NodeSettings(
        model_id=args.model_id,
        model_path=model_path,
        layers=layers,
        host=host,
        port=port,
        quantization=Precision(args.quantization),
        device=resolve_device(args.device),
        memory_gb=args.memory_gb,
        kv_budget_tokens=args.kv_budget_tokens,
        chunk_tokens=args.chunk_tokens,
        max_decode_batch=args.max_decode_batch,
        inline_decode=args.inline_decode,
        inline_decode_max_ms=args.inline_decode_max_ms,
        step_delay_ms=args.step_delay_ms,
        threads=args.threads,
        zstd_level=args.zstd_level,
        timeouts=HopTimeouts(args.connect_timeout, args.chunk_timeout, args.step_timeout),
        swarm_token=args.swarm_token,
        api_key=args.api_key,
        max_request_bytes=int(args.max_request_mb * 2**20),
        **extra,
    )


def launch(args) -> None:
    """Start a node from its parsed flags; one error line and a non-zero exit on failure."""
    setup_logging(args.log_level, args.log_format)
    explicit = (args.model_id, args.shard_start, args.shard_end)
    if any(v is None for v in explicit) and any(v is not None for v in explicit):
        fail(PROG, "give all of --model-id, --shard-start, --shard-end, or none of them "
                   "(then the tracker assigns a shard)")  # fmt: skip
    if args.model_id is None and not args.tracker:
        fail(PROG, "without --model-id the node needs --tracker to be assigned a shard")
    if args.models_dir and not Path(args.models_dir).is_dir():
        fail(PROG, f"--models-dir {args.models_dir}: no such directory", code=1)
    try:
        check_advertise_url(args.advertise_url)
        if args.shard_start is not None:
            check_range(args, None)
    except ValueError as exc:
        fail(PROG, str(exc))
    from meshnet_common.web.serve import check_port, free_port, run

    try:  # the cheap checks first: a typo should not wait for torch to import
        port = args.port or free_port(args.host)
        check_port(args.host, port)
    except OSError as exc:
        fail(PROG, str(exc), code=1)
    if args.advertise_url is None and args.host in ("0.0.0.0", "::"):
        logger.info(
            "listening on every interface: the tracker tells which address it reaches this "
            "node at (--advertise-url sets it)"
        )
    from meshnet_node.dataplane.hop_server import protocol_factory
    from meshnet_node.runtime import bind_url, build_runtime, create_app

    metrics = Metrics()  # this node's registry: counts the shard fetch below too
    claims = HostClaims()
    membership: Membership | None = None
    try:
        if args.tracker:
            wait_for_tracker(args.tracker, args.tracker_wait)
        args.node_id = args.node_id or f"node-{uuid.uuid4().hex[:12]}"
        offer = claims.offer(args.memory_gb)
        claims.claim(offer.bytes)  # until the range is known, the whole offer is claimed
        sources: tuple[str, ...] = ()
        need: int | None = None
        if args.model_id is None:
            logger.info("offering the tracker %s", offer.describe())
            assignment = ask_assignment(args, offer)
            sources, need = assignment.sources, assignment.memory_bytes or None
        local = local_snapshot(args)
        num_layers = model_layers(args, local)
        layers = check_range(args, num_layers)
        if local is not None and need is None:
            need = ModelCosts.from_index(CheckpointIndex.load(local)).shard_bytes(
                layers, Precision(args.quantization), args.kv_budget_tokens
            )
        declared = offer.bytes if offer.explicit or need is None else need
        claims.claim(declared)
        if declared == offer.bytes:
            logger.info("declaring %s to the tracker", offer.describe())
        else:
            logger.info(
                "declaring %.2f GiB to the tracker: what layers %s need at %s with a %d-token "
                "KV budget (offered %s)", declared / 2**30, layers, args.quantization,
                args.kv_budget_tokens, offer.describe(),
            )  # fmt: skip
        movable = args.model_id is not None and (args.allow_rebalance or explicit[0] is None)
        if args.tracker and num_layers is not None:
            url = (args.advertise_url or bind_url(args.host, port)).rstrip("/")
            membership = announce_joining(
                args, url=url, num_layers=num_layers, layers=layers, declared=declared,
                movable=movable,
            )  # fmt: skip
        if args.load_delay_ms:
            time.sleep(args.load_delay_ms / 1000)
        settings = shard_settings(
            args,
            model_path=resolve_model_path(args, sources, metrics, local),
            host=args.host,
            port=port,
            tracker_url=args.tracker,
            advertise_url=args.advertise_url,
            node_id=args.node_id,
            heartbeat_interval_s=args.heartbeat_interval,
            models_dir=Path(args.models_dir) if args.models_dir else None,
            movable=movable,
        )
        runtime = build_runtime(
            settings, metrics=metrics, membership=membership, memory_declared_bytes=declared
        )
        runtime.cache_dir = Path(args.cache_dir)
    except (MeshnetError, ValueError, OSError) as exc:
        if membership is not None:
            membership.stop(node_id=args.node_id)
        claims.release()
        fail(PROG, str(exc), code=1)
    app = create_app(runtime)
    app.state.shards = ShardServer(
        runtime.own_snapshot,
        max_concurrent=args.max_concurrent_downloads,
        fault=args.fault_inject,
        manifest_key=args.manifest_key,
    )
    runtime.listening_at_start = False  # registers as serving once the socket listens

    def refused(message: str) -> None:
        print(f"{PROG}: error: the tracker refused this node: {message}", file=sys.stderr)
        app.state.request_exit(1)

    runtime.on_refused = refused
    shard = runtime.service.stage.shard
    printed = []

    def ready_line() -> str:
        return (
            f"meshnet-node ready: {runtime.url} serving {args.model_id} layers {shard.layers} "
            f"({shard.precision.value})"
        )

    def registered(announcement: NodeAnnouncement) -> None:
        # Ready means on the map: printed once the tracker accepted the serving node.
        if announcement.state == NodeState.SERVING and not printed:
            printed.append(True)
            print(ready_line(), flush=True)

    if membership is not None:
        membership.on_registered = registered
    try:
        run(
            app,
            args.host,
            port,
            None if membership is not None else ready_line(),
            log_level="warning",
            on_started=runtime.serving,
            http=protocol_factory(app),  # hops' steps skip uvicorn's request cycle (ADR-0011)
        )
    finally:
        claims.release()

"""Start a node from its settings: the cheap checks, the joining announcement, the shard
(fetched if needed), the app, and the server."""

from __future__ import annotations

import logging
import sys
import time
import uuid

from meshnet_common.config.cli import fail, setup_logging
from meshnet_common.config.shard import check_advertise_url, check_exposure, check_range
from meshnet_common.errors import InvalidRequest, MeshnetError
from meshnet_common.memory import ModelCosts
from meshnet_common.metrics import Metrics
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.hub.cache import split_model_ref
from meshnet_common.precision import Precision, describe_precision, native_format_name
from meshnet_common.protocol import NodeAnnouncement, NodeState
from meshnet_common.trust.manifest_keys import ManifestKey
from meshnet_common.web import tls
from meshnet_common.web.auth import check_api_key_file
from meshnet_common.web.hosts import require_https
from meshnet_common.web.shards import ShardServer
from meshnet_node.dataplane.lane_wait import spin_window_s
from meshnet_node.settings import NodeSettings
from meshnet_node.swarm.host_memory import HostClaims
from meshnet_node.swarm.host_turns import host_cpus, node_turns
from meshnet_node.swarm.joining import (
    announce_joining,
    ask_assignment,
    local_snapshot,
    model_layers,
    resolve_model_path,
    wait_for_tracker,
)
from meshnet_node.swarm.membership import Membership
from meshnet_node.swarm.trackers import Trackers

PROG = "meshnet-node"
logger = logging.getLogger("meshnet_node.cli")


def expected_precision(
    settings: NodeSettings, index: CheckpointIndex | None, assigned: Precision | None = None
) -> Precision:
    """The precision this node will serve at, before the shard is loaded: --quantization
    and --dtype resolved with the local snapshot's shipped format, else as the tracker
    resolved them for the model it assigned, else (weights still to fetch) as asked (auto:
    plain weights; loading resolves it again with the checkpoint in hand)."""
    if index is not None:
        return settings.precision_for(native_format_name(index.config))
    if assigned is not None:
        return assigned
    if settings.quantization in ("fp8", "mxfp4"):
        return Precision(settings.quantization)
    return settings.precision_for(None)


def launch(settings: NodeSettings, spin: str = "") -> None:
    """Start a node from its settings; one error line and a non-zero exit on failure.
    ``spin``: how OpenMP waits in this process (``meshnet_common.config.openmp``), logged."""
    setup_logging(settings.log_level, settings.log_format)
    if settings.model_id is not None:  # ORG/NAME@REV: the id, and --revision
        try:
            model_id, revision = split_model_ref(settings.model_id, settings.revision)
        except InvalidRequest as exc:
            fail(PROG, f"--model-id: {exc}")
        settings = settings.replace(model_id=model_id, revision=revision)
    explicit = (settings.model_id, settings.shard_start, settings.shard_end)
    if any(v is None for v in explicit) and any(v is not None for v in explicit):
        fail(PROG, "give all of --model-id, --shard-start, --shard-end, or none of them "
                   "(then the tracker assigns a shard)")  # fmt: skip
    if settings.model_id is None and not settings.tracker_url:
        fail(PROG, "without --model-id the node needs --tracker to be assigned a shard")
    if settings.models_dir and not settings.models_dir.is_dir():
        fail(PROG, f"--models-dir {settings.models_dir}: no such directory", code=1)
    check_api_key_file(PROG, settings.api_key_file)  # one line and exit 2 when it is no use
    try:
        check_advertise_url(settings.advertise_url)
        check_exposure(settings.host, settings.swarm_token, settings.insecure)
        if settings.shard_start is not None:
            check_range(settings.shard_start, settings.shard_end, None)
        tls.check(settings.tls_cert, settings.tls_key, settings.tls_ca)
        for url in settings.tracker_urls:
            require_https(url, "--tracker", tls=settings.tls_cert is not None)
        if settings.tracker_key is not None:
            ManifestKey.from_text(settings.tracker_key)
    except (ValueError, InvalidRequest) as exc:
        fail(PROG, f"--tracker-key: {exc}" if isinstance(exc, InvalidRequest) else str(exc))
    tls.configure(settings.tls_ca)  # every swarm client verifies peers with it
    from meshnet_common.web.serve import announce_port, bind, run

    host = settings.host
    try:  # the cheap checks first: a typo should not wait for torch to import
        sock = bind(host, settings.port or 0)  # held from here: the port reported is ours
    except OSError as exc:
        fail(PROG, str(exc), code=1)
    port = announce_port(PROG, sock)
    if settings.advertise_url is None and host in ("0.0.0.0", "::"):
        logger.info(
            "listening on every interface: the tracker tells which address it reaches this "
            "node at (--advertise-url sets it)"
        )
    from meshnet_node.cpu_threads import apart, dedicate
    from meshnet_node.cpu_threads import describe as describe_threads
    from meshnet_node.dataplane.stream_server import max_message_bytes
    from meshnet_node.runtime import bind_url, build_runtime, create_app
    from meshnet_node.swarm.drain import Drain

    metrics = Metrics()  # this node's registry: counts the shard fetch below too
    claims = HostClaims()
    membership: Membership | None = None
    # The swarm's trackers, shared by every call of this process: a tracker that stops
    # answering makes the next one current for all of them.
    trackers = Trackers(settings.tracker_urls) if settings.tracker_url else None
    node_id = settings.node_id or f"node-{uuid.uuid4().hex[:12]}"
    try:
        if trackers is not None:
            wait_for_tracker(trackers, settings.tracker_wait_s)  # any of them
        offer = claims.offer(settings.memory_gb)
        claims.claim(offer.bytes)  # until the range is known, the whole offer is claimed
        sources: tuple[str, ...] = ()
        need: int | None = None
        assigned: Precision | None = None
        assigned_dtype: str | None = None  # the tracker's resolution of --dtype auto
        model_id = settings.model_id
        if model_id is None:
            logger.info("offering the tracker %s", offer.describe())
            assignment = ask_assignment(settings, node_id, offer, trackers)
            sources, need = assignment.sources, assignment.memory_bytes or None
            model_id = assignment.shard.model_id
            start, end = assignment.shard.shard_start, assignment.shard.shard_end
            assigned, assigned_dtype = assignment.quantization, assignment.dtype
        else:
            start, end = settings.shard_start, settings.shard_end
        local = local_snapshot(settings, model_id, check_range(start, end, None), trackers)
        num_layers = model_layers(settings, model_id, local, trackers)
        layers = check_range(start, end, num_layers)
        index = CheckpointIndex.load(local) if local is not None else None
        precision = expected_precision(settings, index, assigned)
        if index is not None or assigned_dtype is None:
            dtype = settings.compute_dtype_for(
                precision, gguf=index is not None and index.gguf is not None
            )
        else:
            dtype = assigned_dtype
        if index is not None and need is None:
            need = ModelCosts.from_index(index).shard_bytes(
                layers, precision, settings.kv_budget_tokens,
                dtype=dtype,
                group_size=settings.quant_group_size,
            )  # fmt: skip
        declared = offer.bytes if offer.explicit or need is None else need
        claims.claim(declared)
        if declared == offer.bytes:
            logger.info("declaring %s to the tracker", offer.describe())
        else:
            logger.info(
                "declaring %.2f GiB to the tracker: what layers %s need at %s with a %d-token "
                "KV budget (offered %s)", declared / 2**30, layers,
                describe_precision(precision, dtype, settings.quant_group_size),
                settings.kv_budget_tokens, offer.describe(),
            )  # fmt: skip
        movable = settings.allow_rebalance or explicit[0] is None
        if settings.tracker_url and num_layers is not None:
            url = (settings.advertise_url or bind_url(host, port, settings.tls_cert)).rstrip("/")
            membership = announce_joining(
                settings, node_id=node_id, url=url, model_id=model_id, num_layers=num_layers,
                layers=layers, declared=declared, movable=movable, precision=precision,
                dtype=dtype, trackers=trackers,
            )  # fmt: skip
        if settings.load_delay_ms:
            time.sleep(settings.load_delay_ms / 1000)
        model_path = resolve_model_path(
            settings, model_id, layers, sources, metrics, local,
            identity=membership.identity if membership is not None else None,
            peers=membership.peers if membership is not None else None, trackers=trackers,
        )  # fmt: skip
        settings = settings.with_shard(model_id, layers, model_path).replace(
            port=port, node_id=node_id, movable=movable
        )
        runtime = apart(  # the load's OpenMP team ends with it (docs/adr/0036)
            lambda: build_runtime(
                settings, metrics=metrics, membership=membership, memory_declared_bytes=declared
            )
        )
        scheduler = runtime.service.scheduler
        threads = dedicate(scheduler, settings.threads)
        runtime.service.links.lane_spin_s = spin_window_s(
            settings.lane_spin_ms, threads, host_cpus()
        )
        turns = node_turns(settings, threads, runtime.service.stage.shard.device.type)
        scheduler.turns = turns
        logger.info("%s", describe_threads(threads, offer.others, spin, turns))
    except (MeshnetError, ValueError, OSError) as exc:
        if membership is not None:
            membership.stop(node_id=node_id)
        claims.release()
        fail(PROG, str(exc), code=1)
    app = create_app(runtime)
    app.state.shards = ShardServer(
        runtime.own_snapshot,
        max_concurrent=settings.max_concurrent_downloads,
        fault=settings.fault_inject,
    )
    runtime.listening_at_start = False  # registers as serving once the socket listens

    def refused(message: str) -> None:
        print(f"{PROG}: error: the tracker refused this node: {message}", file=sys.stderr)
        app.state.request_exit(1)

    runtime.on_refused = refused
    # Graceful drain (docs/adr/0024): SIGTERM or POST /v1/node/drain; exits 0 once drained.
    runtime.drain = Drain(runtime, settings.drain_timeout_s, lambda c: app.state.request_exit(c))
    app.state.drain = runtime.drain.start
    shard = runtime.service.stage.shard
    printed = []

    declared = settings.precision_fields(shard.precision, shard.dtype_name)
    weights = describe_precision(shard.precision, declared["dtype"], declared["quant_group_size"])

    def ready_line() -> str:
        return (
            f"meshnet-node ready: {runtime.url} serving {model_id} layers {shard.layers} "
            f"({weights})"
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
            sock,
            None if membership is not None else ready_line(),
            log_level="warning",
            on_started=runtime.serving,
            ws_max_size=max_message_bytes(settings.max_body_bytes),  # hop streams (ADR-0022)
            tls=tls.server_options(settings.tls_cert, settings.tls_key),
        )
    finally:
        claims.release()

"""``meshnet-node``: serve one layer range of a model and join a swarm."""

from __future__ import annotations

import argparse
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

from meshnet_common.checkpoint import CheckpointIndex
from meshnet_common.errors import MeshnetError, NotFound
from meshnet_common.layers import LayerRange
from meshnet_common.memory import ModelCosts
from meshnet_common.metrics import Metrics
from meshnet_common.models_dir import resolve_snapshot, scan_models_dir
from meshnet_common.precision import Precision
from meshnet_common.protocol import (
    AssignRequest,
    AssignResponse,
    Heartbeat,
    NodeAnnouncement,
    NodeState,
    ShardSpec,
)
from meshnet_common.settings import (
    EnvArgumentParser,
    add_logging_flags,
    add_version_flag,
    fail,
    setup_logging,
)
from meshnet_common.web.auth import swarm_headers
from meshnet_common.web.shards import FAULTS, ShardServer
from meshnet_node.engine.preflight import resolve_device
from meshnet_node.settings import HopTimeouts, NodeSettings
from meshnet_node.swarm.fetch import Trust, fetch_shard_counted
from meshnet_node.swarm.host_memory import HostClaims, Offer
from meshnet_node.swarm.membership import Membership, RegistrationRefused, error_message

PROG = "meshnet-node"
logger = logging.getLogger("meshnet_node.cli")  # also when run as __main__


def add_shard_flags(parser: EnvArgumentParser, *, tracker_node: bool = False) -> None:
    """Flags shared by meshnet-node and the tracker node."""
    if tracker_node:
        model = parser.add_argument_group(
            "tracker node (optional)",
            "Also serve the first layers [0, K) of a model in the tracker process: give all "
            "of --model-id, --shard-start 0 and --shard-end K.",
        )
    else:
        model = parser.add_argument_group(
            "model and layer range",
            "Give all of --model-id, --shard-start and --shard-end, or none of them: then the "
            "tracker assigns a shard (coverage first) and the weights are fetched if needed.",
        )
    model.add_argument("--model-id", help="model id ORG/NAME")
    model.add_argument("--shard-start", type=int, help="first layer served (inclusive)")
    model.add_argument("--shard-end", type=int, help="end of the layer range (exclusive)")
    model.add_argument(
        "--quantization",
        default="bfloat16",
        choices=[p.value for p in Precision],
        help="weight precision (float32 for exactness checks on CPU)",
    )
    model.add_argument(
        "--memory-gb", type=float,
        help="memory this node offers, GiB (default: what is available on the host, less what "
        "other meshnet nodes there claimed; once the range is known, what it needs)",
    )  # fmt: skip
    model.add_argument("--device", default="auto", help="auto, cpu or cuda")
    model.add_argument("--threads", type=int, help="torch compute threads (default: torch's)")
    model.add_argument(
        "--kv-budget-tokens", type=int, default=32768,
        help="most tokens held in KV caches across sessions (beyond: 503)",
    )  # fmt: skip
    data = parser.add_argument_group("data path")
    data.add_argument("--chunk-tokens", type=int, default=128, help="prefill chunk size, tokens")
    data.add_argument(
        "--max-decode-batch", type=int, default=32,
        help="decode steps of concurrent sessions merged into one pass (1: no batching)",
    )  # fmt: skip
    data.add_argument(
        "--inline-decode", action=argparse.BooleanOptionalAction, default=True,
        help="run a lone decode step on the event loop's thread (no thread hand-off) while "
        "decode steps take under --inline-decode-max-ms",
    )  # fmt: skip
    data.add_argument(
        "--inline-decode-max-ms", type=float, default=250.0,
        help="longest decode step run on the event loop's thread; slower shards always use "
        "the compute thread, so /health and the other connections never wait long",
    )  # fmt: skip
    # Tests only: a slow shard (every compute pass) and a slow load, as on a big model.
    data.add_argument("--step-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    data.add_argument("--load-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    data.add_argument("--zstd-level", type=int, default=1, help="activation compression level")
    data.add_argument(
        "--connect-timeout", type=float, default=5.0, help="per-hop connect timeout, seconds"
    )
    data.add_argument(
        "--chunk-timeout", type=float, default=120.0, help="per-hop prefill chunk timeout, seconds"
    )
    data.add_argument(
        "--step-timeout", type=float, default=60.0, help="per-hop decode step timeout, seconds"
    )
    security = parser.add_argument_group(
        "security", "Prefer the env vars for secrets: process arguments are visible to others."
    )
    security.add_argument("--swarm-token", help="shared secret required between tracker and nodes")
    security.add_argument("--api-key", help="clients must send it as 'Authorization: Bearer KEY'")
    security.add_argument(
        "--max-request-mb", type=float, default=8.0, help="largest OpenAI JSON body (413 above)"
    )


EPILOG = """examples:
  # serve layers [10, 20) of a model found in ./models, joining the tracker at A
  meshnet-node --tracker http://A:8080 --models-dir ./models \\
    --model-id HuggingFaceTB/SmolLM2-135M-Instruct --shard-start 10 --shard-end 20

  # join with no model: the tracker assigns a range, its weights are fetched from the swarm
  meshnet-node --tracker http://A:8080 --memory-gb 8 --quantization int8

Every node serves GET /health, GET /metrics (Prometheus) and the internal /v1/... \
routes; a node holding the first layers also answers the OpenAI endpoints.
"""


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog=PROG,
        description="Serve a layer range of a model and join a meshnet swarm.",
        epilog=EPILOG,
    )
    swarm = parser.add_argument_group("swarm")
    swarm.add_argument("--tracker", help="tracker URL, e.g. http://127.0.0.1:8080")
    swarm.add_argument(
        "--tracker-wait", type=float, default=60.0,
        help="seconds to wait at start-up for the tracker to answer (it may still be loading)",
    )  # fmt: skip
    swarm.add_argument(
        "--host", default="127.0.0.1",
        help="address to listen on (0.0.0.0: every interface, for a swarm across machines)",
    )  # fmt: skip
    swarm.add_argument("--port", type=int, default=0, help="port (0: pick a free one)")
    swarm.add_argument(
        "--advertise-url",
        help="URL the tracker and other nodes reach this one at (default: the address the "
        "tracker sees this node's registration come from, with --port; the tracker calls it "
        "back before routing to it)",
    )
    swarm.add_argument(
        "--allow-rebalance", action="store_true",
        help="let the tracker move this node to another layer range to close a gap (a node "
        "started with no range is always movable)",
    )  # fmt: skip
    swarm.add_argument("--node-id", help="stable node id (default: random)")
    swarm.add_argument(
        "--heartbeat-interval", type=float, default=2.0,
        help="seconds between heartbeats (the tracker's own interval wins once registered)",
    )  # fmt: skip
    add_shard_flags(parser)
    weights = parser.add_argument_group(
        "weights",
        "Where the shard comes from: --model-path, else --models-dir, else fetched (only its "
        "layers) from --shard-source peers, the tracker, then the HF hub.",
    )
    weights.add_argument("--model-path", help="local snapshot folder (holding config.json)")
    weights.add_argument("--models-dir", help="models dir to find --model-id in (both layouts)")
    weights.add_argument(
        "--cache-dir", default=str(Path.home() / ".cache" / "meshnet"),
        help="where fetched shards are kept",
    )  # fmt: skip
    weights.add_argument(
        "--shard-source", action="append", default=[],
        help="peer or tracker URL to fetch weights from, tried in order before the tracker "
        "(repeatable)",
    )  # fmt: skip
    weights.add_argument(
        "--revision", help="HF hub revision (branch, tag or commit) when the hub is the source"
    )
    weights.add_argument(
        "--manifest-key", help="shared key: weight manifests must be signed with it (HMAC)"
    )
    weights.add_argument(
        "--max-concurrent-downloads", type=int, default=4, help="peers fetching from us at once"
    )
    weights.add_argument("--fault-inject", choices=FAULTS, help=argparse.SUPPRESS)
    add_logging_flags(parser)
    add_version_flag(parser, "meshnet-node")
    return parser


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


def wait_for_tracker(url: str, wait_s: float) -> None:
    """Return once the tracker answers HTTP at all; OSError after ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            httpx.get(f"{url.rstrip('/')}/health", timeout=2.0)
            return
        except httpx.HTTPError as exc:
            if time.monotonic() >= deadline:
                raise OSError(
                    f"tracker {url} unreachable after {wait_s:g}s ({type(exc).__name__}); "
                    "is it running, and is --tracker right?"
                ) from exc
            logger.info("waiting for tracker %s (%s)", url, type(exc).__name__)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


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


def check_range(args, num_layers: int | None) -> LayerRange:
    """The range from the flags, refused in one line when the model has no such layers."""
    try:
        layers = LayerRange(args.shard_start, args.shard_end)
        if num_layers is not None:
            layers.check_within(num_layers)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--shard-start/--shard-end: {exc}") from exc
    return layers


def check_advertise_url(url: str | None) -> None:
    """A URL other machines could dial: http(s), a host that is not a wildcard, a port."""
    if url is None:
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--advertise-url {url}: expected http://HOST:PORT")
    if parts.hostname in ("0.0.0.0", "::") or parts.path not in ("", "/"):
        raise ValueError(
            f"--advertise-url {url}: give this machine's address as other machines dial it "
            "(e.g. http://192.168.1.20:8000), not a wildcard or a path"
        )


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


def main(argv: Sequence[str] | None = None) -> None:
    try:
        _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while loading: no traceback
        raise SystemExit(130) from None


def _main(argv: Sequence[str] | None) -> None:
    args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
    main()

"""``meshnet-node``: serve one layer range of a model and join a swarm."""

from __future__ import annotations

import argparse
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

from meshnet_common.errors import MeshnetError, NotFound
from meshnet_common.layers import LayerRange
from meshnet_common.models_dir import resolve_snapshot, scan_models_dir
from meshnet_common.precision import Precision
from meshnet_common.protocol import AssignRequest, AssignResponse
from meshnet_common.settings import EnvArgumentParser, fail, setup_logging
from meshnet_node.auth import swarm_headers
from meshnet_node.fetch import Trust, fetch_shard
from meshnet_node.preflight import resolve_device
from meshnet_node.settings import HopTimeouts, NodeSettings
from meshnet_node.shards_api import FAULTS, ShardServer

PROG = "meshnet-node"
logger = logging.getLogger(__name__)


def add_shard_flags(parser: EnvArgumentParser, *, tracker_node: bool = False) -> None:
    """Flags shared by meshnet-node and the tracker node."""
    parser.add_argument("--model-id", help="model id ORG/NAME")
    parser.add_argument("--shard-start", type=int, help="first layer served (inclusive)")
    parser.add_argument("--shard-end", type=int, help="end of the layer range (exclusive)")
    parser.add_argument(
        "--quantization",
        default="bfloat16",
        choices=[p.value for p in Precision],
        help="weight precision (float32 for exactness checks on CPU)",
    )
    parser.add_argument("--memory-gb", type=float, help="memory this node offers (default: all)")
    parser.add_argument("--swarm-token", help="shared secret required between tracker and nodes")
    parser.add_argument(
        "--max-request-mb", type=float, default=8.0, help="largest OpenAI JSON body (413 above)"
    )
    parser.add_argument("--api-key", help="clients must send it as 'Authorization: Bearer KEY'")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--kv-budget-tokens", type=int, default=32768, help="KV tokens held, max")
    parser.add_argument("--chunk-tokens", type=int, default=128, help="prefill chunk size")
    parser.add_argument(
        "--max-decode-batch", type=int, default=32,
        help="decode steps of concurrent sessions merged into one pass (1: no batching)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch compute threads")
    parser.add_argument("--zstd-level", type=int, default=1, help="activation compression")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="per-hop connect (s)")
    parser.add_argument(
        "--chunk-timeout", type=float, default=120.0, help="per-hop prefill chunk timeout (s)"
    )
    parser.add_argument(
        "--step-timeout", type=float, default=60.0, help="per-hop decode step timeout (s)"
    )


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(prog=PROG, description="Serve a layer range of a model.")
    parser.add_argument("--tracker", help="tracker URL, e.g. http://127.0.0.1:8080")
    add_shard_flags(parser)
    parser.add_argument("--model-path", help="local snapshot folder (holding config.json)")
    parser.add_argument("--models-dir", help="models dir to find --model-id in")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="port (0: pick a free one)")
    parser.add_argument("--advertise-url", help="URL other nodes use to reach this one")
    parser.add_argument("--node-id", help="stable node id (default: random)")
    parser.add_argument(
        "--cache-dir", default=str(Path.home() / ".cache" / "meshnet"),
        help="where fetched shards are kept",
    )  # fmt: skip
    parser.add_argument(
        "--max-concurrent-downloads", type=int, default=4, help="peers fetching from us at once"
    )
    parser.add_argument(
        "--shard-source", action="append", default=[],
        help="peer or tracker URL to fetch weights from, tried in order before the tracker",
    )  # fmt: skip
    parser.add_argument(
        "--manifest-key", help="shared key: weight manifests must be signed with it (HMAC)"
    )
    parser.add_argument("--fault-inject", choices=FAULTS, help=argparse.SUPPRESS)
    parser.add_argument("--heartbeat-interval", type=float, default=2.0, help="seconds")
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
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
        threads=args.threads,
        zstd_level=args.zstd_level,
        timeouts=HopTimeouts(args.connect_timeout, args.chunk_timeout, args.step_timeout),
        swarm_token=args.swarm_token,
        api_key=args.api_key,
        max_request_bytes=int(args.max_request_mb * 2**20),
        **extra,
    )


def resolve_model_path(args, sources: tuple[str, ...] = ()) -> Path:
    """A local snapshot (--model-path / --models-dir), else the shard fetched from sources."""
    if args.model_path:
        path = Path(args.model_path)
        if not (path / "config.json").exists():
            raise ValueError(f"--model-path {path}: no config.json there")
        return path
    if getattr(args, "models_dir", None):
        try:
            return resolve_snapshot(args.models_dir, args.model_id)
        except NotFound:
            pass
    tracker = (args.tracker,) if getattr(args, "tracker", None) else ()
    sources = (*getattr(args, "shard_source", ()), *(sources or tracker))
    if not sources:
        raise ValueError(f"no local snapshot of {args.model_id} and no tracker to fetch it from")
    trust = Trust(
        tracker=getattr(args, "tracker", None),
        manifest_key=args.manifest_key,
        swarm_token=args.swarm_token,
    )
    return fetch_shard(
        args.model_id,
        LayerRange(args.shard_start, args.shard_end),
        sources,
        Path(args.cache_dir),
        trust=trust,
    )


def ask_assignment(args) -> tuple[str, ...]:
    """Ask the tracker which shard to serve (coverage first); fills args in place and
    returns where the weights can be fetched (peers first, then the tracker)."""
    held: tuple[str, ...] = ()
    if args.models_dir:
        held = tuple(e.model_id for e in scan_models_dir(args.models_dir).entries)
    memory = (
        int(args.memory_gb * 1024**3)
        if args.memory_gb is not None
        else int(psutil.virtual_memory().available)
    )
    ask = AssignRequest(
        node_id=args.node_id,
        memory_bytes=memory,
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
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200]
        raise ValueError(f"the tracker refused to assign a shard: {message}")
    assignment = AssignResponse.model_validate_json(resp.content)
    args.model_id = assignment.shard.model_id
    args.shard_start, args.shard_end = assignment.shard.shard_start, assignment.shard.shard_end
    logger.info(
        "tracker assigned %s layers %s (%s)",
        args.model_id, assignment.shard.layers, assignment.reason,
    )  # fmt: skip
    return assignment.sources


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    explicit = (args.model_id, args.shard_start, args.shard_end)
    if any(v is None for v in explicit) and any(v is not None for v in explicit):
        fail(PROG, "give all of --model-id, --shard-start, --shard-end, or none of them "
                   "(then the tracker assigns a shard)")  # fmt: skip
    if args.model_id is None and not args.tracker:
        fail(PROG, "without --model-id the node needs --tracker to be assigned a shard")
    from meshnet_node.runtime import build_runtime, create_app
    from meshnet_node.serve import check_port, free_port, run

    try:
        port = args.port or free_port(args.host)
        check_port(args.host, port)
        args.node_id = args.node_id or f"node-{uuid.uuid4().hex[:12]}"
        sources: tuple[str, ...] = ()
        if args.model_id is None:
            sources = ask_assignment(args)
        settings = shard_settings(
            args,
            model_path=resolve_model_path(args, sources),
            host=args.host,
            port=port,
            tracker_url=args.tracker,
            advertise_url=args.advertise_url,
            node_id=args.node_id,
            heartbeat_interval_s=args.heartbeat_interval,
            models_dir=Path(args.models_dir) if args.models_dir else None,
        )
        runtime = build_runtime(settings)
        runtime.cache_dir = Path(args.cache_dir)
    except (MeshnetError, ValueError, OSError) as exc:
        fail(PROG, str(exc), code=1)
    app = create_app(runtime)
    app.state.shards = ShardServer(
        runtime.own_snapshot,
        max_concurrent=args.max_concurrent_downloads,
        fault=args.fault_inject,
        manifest_key=args.manifest_key,
    )
    shard = runtime.service.stage.shard
    run(
        app,
        args.host,
        port,
        f"meshnet-node ready: {runtime.url} serving {args.model_id} layers {shard.layers} "
        f"({shard.precision.value})",
        log_level="warning",
    )


if __name__ == "__main__":
    main()

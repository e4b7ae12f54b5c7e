"""``meshnet-tracker``: the coverage map, routing and OpenAI entry point of a swarm."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from meshnet_common.errors import MeshnetError
from meshnet_common.models_dir import resolve_snapshot
from meshnet_common.settings import EnvArgumentParser, add_logging_flags, fail, setup_logging
from meshnet_node.cli import add_shard_flags, shard_settings
from meshnet_node.shards_api import FAULTS

PROG = "meshnet-tracker"
logger = logging.getLogger("meshnet_tracker.cli")  # also when run as __main__


EPILOG = """examples:
  # a tracker node: the coverage map, the OpenAI endpoint and layers [0, 10) of SmolLM2
  meshnet-tracker --models-dir ./models --host 0.0.0.0 --port 8080 \\
    --model-id HuggingFaceTB/SmolLM2-135M-Instruct --shard-start 0 --shard-end 10

  # a tracker only (nodes bring the layers; it still serves ./models to joining nodes)
  meshnet-tracker --models-dir ./models --port 8080

Open http://HOST:PORT/ for the live dashboard; GET /metrics for Prometheus.
"""


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog=PROG,
        description="Track which nodes serve which layers, route requests, and (with "
        "--model-id) serve the first layers itself.",
        epilog=EPILOG,
    )
    tracker = parser.add_argument_group("tracker")
    tracker.add_argument(
        "--models-dir",
        help="folder of HF snapshots (both layouts): models known to placement, and the "
        "weights served to joining nodes",
    )
    tracker.add_argument("--host", default="127.0.0.1", help="address to listen on")
    tracker.add_argument("--port", type=int, default=8080, help="port")
    tracker.add_argument(
        "--heartbeat-interval", type=float, default=2.0,
        help="seconds between node heartbeats; 3 missed ones drop a node from the map",
    )  # fmt: skip
    tracker.add_argument(
        "--max-concurrent-downloads", type=int, default=4, help="shard downloads served at once"
    )
    tracker.add_argument("--manifest-key", help="sign weight manifests with this shared key (HMAC)")
    tracker.add_argument("--fault-inject", choices=FAULTS, help=argparse.SUPPRESS)
    add_shard_flags(parser, tracker_node=True)
    add_logging_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    try:
        _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while loading: no traceback
        raise SystemExit(130) from None


def _main(argv: Sequence[str] | None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    models_dir = Path(args.models_dir) if args.models_dir else None
    if models_dir is not None and not models_dir.is_dir():  # before the slow imports
        fail(PROG, f"--models-dir {models_dir}: no such directory", code=1)
    from meshnet_node.serve import check_port, run

    try:
        check_port(args.host, args.port)
    except OSError as exc:
        fail(PROG, str(exc), code=1)
    from meshnet_node.runtime import build_runtime
    from meshnet_tracker.app import _local_route_provider, create_app
    from meshnet_tracker.settings import TrackerSettings

    try:
        url = f"http://{args.host}:{args.port}"
        node = None
        state_ref: list = []
        if args.model_id:
            if models_dir is None:
                raise ValueError("--model-id needs --models-dir to find the snapshot")
            if args.shard_start is None or args.shard_end is None:
                raise ValueError("--model-id needs --shard-start and --shard-end")
            node_settings = shard_settings(
                args,
                model_path=resolve_snapshot(models_dir, args.model_id),
                host=args.host,
                port=args.port,
                advertise_url=url,
                node_id="tracker-node",
            )
            node = build_runtime(node_settings, route_provider=_local_route_provider(state_ref))
            if not node.service.stage.shard.is_head:
                raise ValueError("the tracker node serves the first layers: use --shard-start 0")
        settings = TrackerSettings(
            models_dir=models_dir,
            host=args.host,
            port=args.port,
            heartbeat_interval_s=args.heartbeat_interval,
            max_concurrent_downloads=args.max_concurrent_downloads,
            fault_inject=args.fault_inject,
            manifest_key=args.manifest_key,
            swarm_token=args.swarm_token,
            api_key=args.api_key,
            max_request_bytes=int(args.max_request_mb * 2**20),
        )
        app = create_app(settings, node)
        state_ref.append(app.state.tracker)
    except (MeshnetError, ValueError, OSError) as exc:
        fail(PROG, str(exc), code=1)
    extra = ""
    if node is not None:
        extra = f" (tracker node: {args.model_id} layers {node.service.stage.shard.layers})"
    run(
        app, args.host, args.port,
        f"meshnet-tracker ready: {url}{extra}; dashboard: {url}/",
        log_level="warning",
    )  # fmt: skip


if __name__ == "__main__":
    main()

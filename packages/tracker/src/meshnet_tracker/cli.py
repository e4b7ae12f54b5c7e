"""``meshnet-tracker``: the coverage map, routing and OpenAI entry point of a swarm."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from meshnet_common.config import defaults
from meshnet_common.config.cli import (
    EnvArgumentParser,
    add_logging_flags,
    add_version_flag,
    fail,
    setup_logging,
)
from meshnet_common.config.node_flags import add_shard_flags, check_advertise_url, check_range
from meshnet_common.errors import MeshnetError
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.models_dir import resolve_snapshot
from meshnet_common.web.shards import FAULTS

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
    tracker.add_argument(
        "--host", default="127.0.0.1",
        help="address to listen on (0.0.0.0: every interface, for nodes on other machines)",
    )  # fmt: skip
    tracker.add_argument("--port", type=int, default=8080, help="port")
    tracker.add_argument(
        "--advertise-url",
        help="URL nodes and clients reach the tracker at, given to joining nodes as a weight "
        "source and in routes through the tracker node (default: the address each caller "
        "dialed)",
    )
    tracker.add_argument(
        "--models-rescan", type=float, default=10.0,
        help="seconds between scans of --models-dir for added, changed or removed models "
        "(also scanned whenever a node asks for an assignment; 0: only then)",
    )  # fmt: skip
    tracker.add_argument(
        "--move-grace", type=float, default=10.0,
        help="seconds a coverage gap must last before the tracker moves a redundant node "
        "into it (nodes still loading count as coverage)",
    )  # fmt: skip
    tracker.add_argument(
        "--verify-nodes", action=argparse.BooleanOptionalAction, default=True,
        help="call a registering node back on /health at its address before routing to it",
    )  # fmt: skip
    tracker.add_argument(
        "--heartbeat-interval", type=float, default=defaults.HEARTBEAT_INTERVAL_S,
        help="seconds between node heartbeats; 3 missed ones drop a node from the map",
    )  # fmt: skip
    tracker.add_argument(
        "--max-concurrent-downloads", type=int, default=4, help="shard downloads served at once"
    )
    tracker.add_argument("--manifest-key", help="sign weight manifests with this shared key (HMAC)")
    tracker.add_argument("--fault-inject", choices=FAULTS, help=argparse.SUPPRESS)
    add_shard_flags(parser, tracker_node=True)
    add_logging_flags(parser)
    add_version_flag(parser, "meshnet-tracker")
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
    snapshot = None
    try:  # every argument is checked before the weights load
        check_advertise_url(args.advertise_url)
        if args.model_id:
            if models_dir is None:
                raise ValueError("--model-id needs --models-dir to find the snapshot")
            if args.shard_start is None or args.shard_end is None:
                raise ValueError("--model-id needs --shard-start and --shard-end")
            if args.shard_start != 0:
                raise ValueError(
                    "the tracker node serves the first layers: use --shard-start 0 "
                    f"(not {args.shard_start}); start other ranges with meshnet-node"
                )
            snapshot = resolve_snapshot(models_dir, args.model_id)
            check_range(args, CheckpointIndex.load(snapshot).num_layers)
        elif args.shard_start is not None or args.shard_end is not None:
            raise ValueError("--shard-start/--shard-end need --model-id")
    except (MeshnetError, ValueError) as exc:
        fail(PROG, str(exc), code=1)
    from meshnet_common.web.serve import check_port, run

    try:
        check_port(args.host, args.port)
    except OSError as exc:
        fail(PROG, str(exc), code=1)
    from meshnet_tracker.app import create_app
    from meshnet_tracker.settings import TrackerSettings

    try:
        url = (args.advertise_url or f"http://{args.host}:{args.port}").rstrip("/")
        node = None
        if snapshot is not None:
            try:  # the only place the tracker imports the node package
                from meshnet_tracker.tracker_node import TrackerNode
            except ImportError as exc:
                raise ValueError(
                    f"serving layers in the tracker needs the node package ({exc.name} is "
                    "missing): pip install 'meshnet-tracker[node]'"
                ) from exc
            node = TrackerNode.build(args, snapshot, url)
        settings = TrackerSettings(
            models_dir=models_dir,
            host=args.host,
            port=args.port,
            advertise_url=args.advertise_url,
            models_rescan_s=args.models_rescan,
            move_grace_s=args.move_grace,
            verify_nodes=args.verify_nodes,
            heartbeat_interval_s=args.heartbeat_interval,
            max_concurrent_downloads=args.max_concurrent_downloads,
            fault_inject=args.fault_inject,
            manifest_key=args.manifest_key,
            swarm_token=args.swarm_token,
            api_key=args.api_key,
            max_request_bytes=int(args.max_request_mb * 2**20),
        )
        app = create_app(settings, node)
    except (MeshnetError, ValueError, OSError) as exc:
        fail(PROG, str(exc), code=1)
    extra = "" if node is None else f" (tracker node: {args.model_id} layers {node.layers})"
    run(
        app, args.host, args.port,
        f"meshnet-tracker ready: {url}{extra}; dashboard: {url}/",
        log_level="warning", http=None if node is None else node.http_protocol(app),
    )  # fmt: skip


if __name__ == "__main__":
    main()

"""``meshnet-node``: serve one layer range of a model and join a swarm.

Arguments are parsed before anything heavy is imported: ``--help``, ``--version`` and
argument errors answer at once; the start-up itself is ``meshnet_node.launch``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from meshnet_common.config import defaults
from meshnet_common.config.cli import EnvArgumentParser, add_logging_flags, add_version_flag
from meshnet_common.config.node_flags import add_shard_flags
from meshnet_common.web.shards import FAULTS

PROG = "meshnet-node"


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
        "--heartbeat-interval", type=float, default=defaults.HEARTBEAT_INTERVAL_S,
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


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        from meshnet_node.launch import launch

        launch(args)
    except KeyboardInterrupt:  # Ctrl-C while loading: no traceback
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()

"""``meshnet-node``: serve one layer range of a model and join a swarm.

Arguments are parsed before anything heavy is imported: ``--help``, ``--version`` and
argument errors answer at once; the start-up itself is ``meshnet_node.launch``."""

from __future__ import annotations

import os
from collections.abc import Sequence

from meshnet_common.config.cli import FlagParser, add_version_flag
from meshnet_common.config.openmp import short_spin
from meshnet_node.settings import NodeSettings

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


def build_parser() -> FlagParser:
    parser = FlagParser(
        prog=PROG,
        description="Serve a layer range of a model and join a meshnet swarm.",
        epilog=EPILOG,
    )
    NodeSettings.add_flags(parser)
    add_version_flag(parser, "meshnet-node")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = NodeSettings.from_args(args)
    except ValueError as exc:  # a bad env value: one line, as a bad flag
        parser.error(str(exc))
    spin = short_spin(os.environ)  # before torch loads (docs/adr/0036)
    try:
        from meshnet_node.launch import launch

        launch(settings, spin)
    except KeyboardInterrupt:  # Ctrl-C while loading: no traceback
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()

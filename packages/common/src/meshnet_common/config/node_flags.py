"""The flags of a process that serves layers (meshnet-node, and the tracker node), and the
checks on them that need no model: argparse only, so ``--help`` stays fast and the tracker
can offer them without the node package."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

from meshnet_common.config import defaults
from meshnet_common.config.cli import EnvArgumentParser
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision


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
        "--kv-budget-tokens", type=int, default=defaults.KV_BUDGET_TOKENS,
        help="most tokens held in KV caches across sessions (beyond: 503)",
    )  # fmt: skip
    data = parser.add_argument_group("data path")
    data.add_argument(
        "--chunk-tokens", type=int, default=defaults.CHUNK_TOKENS, help="prefill chunk size, tokens"
    )
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

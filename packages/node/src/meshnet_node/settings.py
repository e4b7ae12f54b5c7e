"""Node settings: one frozen object built once from flags + ``MESHNET_*`` env at start-up
(ADR-0014). The shard the tracker assigns completes a copy (``with_shard``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar
from urllib.parse import urlsplit

from pydantic import field_validator
from pydantic_settings import NoDecode

from meshnet_common.config import defaults
from meshnet_common.config.settings import internal, knob
from meshnet_common.config.shard import DATA, LOGGING, MODEL, SECURITY, ShardSettings
from meshnet_common.layers import LayerRange
from meshnet_common.web.shards import FAULTS

SWARM = "swarm"
WEIGHTS = "weights"


def check_tracker_urls(value: str | list | tuple) -> tuple[str, ...]:
    """The tracker URLs of ``--tracker`` (comma-separated, or a list), without a trailing
    slash; ValueError naming the first that is no http(s)://HOST[:PORT] URL, or a repeat."""
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    urls = tuple(item.strip().rstrip("/") for item in items if item.strip())
    for url in urls:
        parts = urlsplit(url)
        try:
            parts.port  # noqa: B018 - raises on a port that is no number in range
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"tracker URL {url!r}: expected http(s)://HOST[:PORT]")
        if parts.query or parts.fragment or parts.username is not None:
            raise ValueError(f"tracker URL {url!r}: no query, fragment or user name")
    if len(set(urls)) != len(urls):
        raise ValueError(f"a tracker URL is given twice in {','.join(urls)}")
    return urls


@dataclass(frozen=True)
class HopTimeouts:
    """Per-hop HTTP timeouts in seconds (--connect-timeout, --chunk-timeout, --step-timeout)."""

    connect: float
    prefill_chunk: float
    decode_step: float


class NodeSettings(ShardSettings):
    """Everything a node process needs to know, fixed at start-up."""

    GROUPS: ClassVar[dict[str, str | None]] = {
        SWARM: None,
        MODEL: ShardSettings.GROUPS[MODEL],
        DATA: None,
        WEIGHTS: "Where the shard comes from: --model-path, else --models-dir, else fetched "
        "(only its layers) from --shard-source peers, the tracker, then the HF hub.",
        SECURITY: ShardSettings.GROUPS[SECURITY],
        LOGGING: None,
    }

    # -- swarm --
    tracker_url: str | None = knob(
        None, "tracker URL, e.g. http://127.0.0.1:8080; the trackers of one swarm "
        "comma-separated (URL1,URL2,...): the node registers with the first that answers and "
        "moves to the next when it stops answering", group=SWARM, flag="--tracker",
    )  # fmt: skip
    tracker_wait_s: float = knob(
        60.0, "seconds to wait at start-up for the tracker to answer (it may still be loading)",
        group=SWARM, flag="--tracker-wait",
    )  # fmt: skip
    host: str = knob(
        "127.0.0.1", "address to listen on (0.0.0.0: every interface, for a swarm across "
        "machines)", group=SWARM,
    )  # fmt: skip
    port: int = knob(
        0,
        "port (0: a free one, printed at once as `meshnet-node listening on port N`)",
        group=SWARM,
    )
    advertise_url: str | None = knob(
        None, "URL the tracker and other nodes reach this one at (default: the address the "
        "tracker sees this node's registration come from, with --port; the tracker calls it "
        "back before routing to it)", group=SWARM,
    )  # fmt: skip
    allow_rebalance: bool = knob(
        False, "let the tracker move this node to another layer range to close a gap (a node "
        "started with no range is always movable)", group=SWARM,
    )  # fmt: skip
    node_id: str | None = knob(None, "stable node id (default: random)", group=SWARM)
    heartbeat_interval_s: float = knob(
        defaults.HEARTBEAT_INTERVAL_S, "seconds between heartbeats (the tracker's own interval "
        "wins once registered)", group=SWARM, flag="--heartbeat-interval",
    )  # fmt: skip

    # -- data path --
    decode_lanes: bool = knob(
        True, "plain decode steps go down a route on decode lanes: TCP connections beside the "
        "hop streams, read and written by each node's compute thread (docs/adr/0058; not "
        "offered where the node serves TLS)", group=DATA, action="bool",
    )  # fmt: skip

    # -- weights --
    model_path: Path | None = knob(
        None, "local snapshot folder (holding config.json); once started: the snapshot the "
        "shard is loaded from", group=WEIGHTS,
    )  # fmt: skip
    models_dir: Path | None = knob(
        None, "models dir to find --model-id in (both layouts)", group=WEIGHTS
    )
    cache_dir: Path = knob(
        Path.home() / ".cache" / "meshnet", "where fetched shards are kept", group=WEIGHTS
    )
    shard_sources: Annotated[tuple[str, ...], NoDecode] = knob(
        (), "peer or tracker URL to fetch weights from, tried in order before the tracker "
        "(repeatable; env: comma-separated)", group=WEIGHTS, flag="--shard-source",
        action="append",
    )  # fmt: skip
    revision: str | None = knob(
        None, "HF hub revision (branch, tag or commit) when the hub is the source", group=WEIGHTS
    )
    tracker_key: str | None = knob(
        None, "the tracker's public key (base64 Ed25519, as it logs at start and serves at "
        "/v1/tracker/key): weight manifests must be signed with it; without it the node asks "
        "the tracker for its key (docs/adr/0032)", group=WEIGHTS,
    )  # fmt: skip
    max_concurrent_downloads: int = knob(4, "peers fetching from us at once", group=WEIGHTS)
    operator_token: str | None = knob(
        None, "the operator's credential (header x-meshnet-operator-token) for draining this "
        "node over HTTP (POST /v1/node/drain); without it only SIGTERM drains it "
        "(docs/adr/0032)", group=SECURITY, secret=True,
    )  # fmt: skip
    fault_inject: str | None = knob(None, "", group=WEIGHTS, choices=FAULTS, hidden=True)

    # -- decided by the process itself --
    movable: bool = internal(False, "the tracker may move this node (assigned, or rebalance)")

    @field_validator("shard_sources", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return tuple(value)

    @field_validator("tracker_url", mode="before")
    @classmethod
    def _trackers(cls, value):
        """One URL or several (comma-separated, or a config file's list), each checked."""
        if value is None:
            return None
        urls = check_tracker_urls(value if isinstance(value, (list, tuple)) else str(value))
        return ",".join(urls) if urls else None

    @property
    def tracker_urls(self) -> tuple[str, ...]:
        """The trackers of the swarm, in the order given (``--tracker URL1,URL2``)."""
        return tuple(self.tracker_url.split(",")) if self.tracker_url else ()

    @property
    def timeouts(self) -> HopTimeouts:
        return HopTimeouts(self.connect_timeout, self.chunk_timeout, self.step_timeout)

    def with_shard(self, model_id: str, layers: LayerRange, model_path: Path) -> NodeSettings:
        """A copy serving ``layers`` of ``model_id`` from the snapshot at ``model_path``."""
        return self.replace(
            model_id=model_id, shard_start=layers.start, shard_end=layers.end,
            model_path=model_path,
        )  # fmt: skip

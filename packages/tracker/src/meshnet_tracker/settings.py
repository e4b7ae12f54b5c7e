"""Tracker settings: one frozen object built once from flags + ``MESHNET_*`` env (ADR-0014).
Its shard knobs (the tracker node's) are the node's, from ``meshnet_common``."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from meshnet_common.config import defaults
from meshnet_common.config.settings import knob
from meshnet_common.config.shard import DATA, LOGGING, MODEL, SECURITY, ShardSettings
from meshnet_common.web.shards import FAULTS

TRACKER = "tracker"


class TrackerSettings(ShardSettings):
    """What the tracker process is configured with."""

    GROUPS: ClassVar[dict[str, str | None]] = {
        TRACKER: None,
        MODEL: "Also serve the first layers [0, K) of a model in the tracker process: give all "
        "of --model-id, --shard-start 0 and --shard-end K.",
        DATA: None,
        SECURITY: ShardSettings.GROUPS[SECURITY],
        LOGGING: None,
    }
    GROUP_TITLES: ClassVar[dict[str, str]] = {MODEL: "tracker node (optional)"}

    models_dir: Path | None = knob(
        None, "folder of HF snapshots (both layouts): models known to placement, and the "
        "weights served to joining nodes", group=TRACKER,
    )  # fmt: skip
    host: str = knob(
        "127.0.0.1", "address to listen on (0.0.0.0: every interface, for nodes on other "
        "machines)", group=TRACKER,
    )  # fmt: skip
    port: int = knob(
        8080,
        "port (0: a free one, printed at once as `meshnet-tracker listening on port N`)",
        group=TRACKER,
    )
    advertise_url: str | None = knob(
        None, "URL nodes and clients reach the tracker at, given to joining nodes as a weight "
        "source and in routes through the tracker node (default: the address each caller "
        "dialed)", group=TRACKER,
    )  # fmt: skip
    models_rescan_s: float = knob(
        10.0, "seconds between scans of --models-dir for added, changed or removed models "
        "(also scanned whenever a node asks for an assignment; 0: only then)",
        group=TRACKER, flag="--models-rescan",
    )  # fmt: skip
    move_grace_s: float = knob(
        10.0, "seconds a coverage gap must last before the tracker moves a redundant node into "
        "it (nodes still loading count as coverage)", group=TRACKER, flag="--move-grace",
    )  # fmt: skip
    restart_grace_s: float = knob(
        60.0, "seconds a node dropped for missed heartbeats counts as restarting: requests for "
        "its layers wait for them (--coverage-wait) instead of failing at once (at least "
        "--move-grace)", group=TRACKER, flag="--restart-grace",
    )  # fmt: skip
    joining_ttl_s: float = knob(
        600.0, "seconds a node may stay loading before it no longer holds its range",
        group=TRACKER, flag="--joining-ttl",
    )  # fmt: skip
    verify_nodes: bool = knob(
        True, "call a registering node back on /health at its address before routing to it",
        group=TRACKER, action="bool",
    )  # fmt: skip
    heartbeat_interval_s: float = knob(
        defaults.HEARTBEAT_INTERVAL_S, "seconds between node heartbeats; 3 missed ones drop a "
        "node from the map", group=TRACKER, flag="--heartbeat-interval",
    )  # fmt: skip
    quarantine_after: int = knob(
        2, "verdicts (from heads auditing with --verify-fraction) against a node before it is "
        "quarantined: no routes, shown on the dashboard, told to refuse steps", group=TRACKER,
    )  # fmt: skip
    witness_age_s: float = knob(
        600.0, "seconds a node must have served (called back, unquarantined) before its "
        "signed rows count as a witness in a verdict against another node (docs/adr/0032)",
        group=SECURITY, flag="--witness-age",
    )  # fmt: skip
    max_nodes_per_source: int = knob(
        16, "live nodes one source address may register (more answer 429)", group=SECURITY,
    )  # fmt: skip
    max_models_per_source: int = knob(
        4, "models outside --models-dir that serving nodes from one source address may "
        "introduce to the model table (more answer 429; unheld models expire)",
        group=SECURITY,
    )  # fmt: skip
    proxy_timeout_s: float = knob(
        600.0, "seconds a request proxied to a head node may take", group=TRACKER,
        flag="--proxy-timeout",
    )  # fmt: skip
    max_concurrent_downloads: int = knob(4, "shard downloads served at once", group=TRACKER)
    signing_key: Path | None = knob(
        None, "Ed25519 private key (PEM) the tracker signs weight manifests with; created "
        "if the file is missing; without it, a new key each run (docs/adr/0032)",
        group=SECURITY,
    )  # fmt: skip
    operator_token: str | None = knob(
        None, "the operator's credential (header x-meshnet-operator-token) for removing "
        "another node or lifting a quarantine; without it nobody can (docs/adr/0032)",
        group=SECURITY, secret=True,
    )  # fmt: skip
    revision: str | None = knob(
        None, "without --models-dir: the revision of --model-id served from the standard HF "
        "cache (branch, tag or commit; ORG/NAME@REV says the same; default: main), downloaded "
        "when missing unless HF_HUB_OFFLINE is set", group=MODEL,
    )  # fmt: skip
    store: str | None = knob(
        None, "the swarm's shared store, etcd://HOST:PORT[,HOST:PORT...]: several trackers "
        "keep one registry there, one of them (elected) places and moves nodes; without it "
        "this tracker keeps its registry in memory, alone", group=TRACKER,
    )  # fmt: skip
    fault_inject: str | None = knob(None, "", group=TRACKER, choices=FAULTS, hidden=True)

    @property
    def url(self) -> str:
        """The tracker's URL as configured (--advertise-url, else the bind address)."""
        scheme = "https" if self.tls_cert is not None else "http"
        return self.advertise_url or f"{scheme}://{self.host}:{self.port}"

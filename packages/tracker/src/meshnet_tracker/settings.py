"""Tracker settings, fixed at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from meshnet_common.config import defaults


@dataclass(frozen=True)
class TrackerSettings:
    """What the tracker process is configured with."""

    models_dir: Path | None
    host: str = "127.0.0.1"
    port: int = 8080
    advertise_url: str | None = None  # how nodes reach the tracker (default: what they dial)
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S
    verify_nodes: bool = True  # call a registering node back on /health before routing to it
    models_rescan_s: float = 10.0  # how often the models dir is indexed again (0: never)
    move_grace_s: float = 10.0  # a gap must last this long before a node is moved into it
    joining_ttl_s: float = 600.0  # a node loading longer than this no longer holds its range
    proxy_timeout_s: float = 600.0
    max_request_bytes: int = 8 * 1024 * 1024  # one OpenAI JSON body; larger -> 413
    max_concurrent_downloads: int = 4  # shard downloads served at once; the rest queue
    fault_inject: str | None = None  # tests only: corrupt or truncate served weights
    manifest_key: str | None = field(default=None, repr=False)  # HMAC key signing manifests
    swarm_token: str | None = field(default=None, repr=False)  # secret between services
    api_key: str | None = field(default=None, repr=False)  # clients' key for OpenAI routes

    @property
    def url(self) -> str:
        """The tracker's URL as configured (--advertise-url, else the bind address)."""
        return self.advertise_url or f"http://{self.host}:{self.port}"

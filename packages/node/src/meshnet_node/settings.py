"""Node settings: one frozen object built from CLI flags / env vars at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from meshnet_common.config import defaults
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision


@dataclass(frozen=True)
class HopTimeouts:
    """Per-hop HTTP timeouts in seconds."""

    connect: float = 5.0
    prefill_chunk: float = 120.0
    decode_step: float = 60.0


@dataclass(frozen=True)
class NodeSettings:
    """Everything a node process needs to know, fixed at start-up."""

    model_id: str
    model_path: Path
    layers: LayerRange
    host: str = "127.0.0.1"
    port: int = 0
    advertise_url: str | None = None
    tracker_url: str | None = None
    quantization: Precision = Precision.BFLOAT16
    device: str = "cpu"
    memory_gb: float | None = None
    kv_budget_tokens: int = defaults.KV_BUDGET_TOKENS
    max_sessions: int = 256
    session_idle_timeout_s: float = 300.0
    chunk_tokens: int = defaults.CHUNK_TOKENS
    max_decode_batch: int = 32  # decode steps of different sessions merged per pass (1: off)
    inline_decode: bool = True  # a lone decode step runs on the event loop's thread ...
    inline_decode_max_ms: float = 250.0  # ... while the last decode pass took less than this
    step_delay_ms: float = 0.0  # tests only: every compute pass takes this much longer
    max_body_bytes: int = 64 * 1024 * 1024  # one activation frame
    max_request_bytes: int = 8 * 1024 * 1024  # one OpenAI JSON body
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S
    turn_timeout_s: float = defaults.TURN_TIMEOUT_S  # a chunk waiting for an earlier one
    open_timeout_s: float = defaults.OPEN_TIMEOUT_S  # ... for its session to open
    pool_max_idle_s: float = defaults.POOL_MAX_IDLE_S  # hop connections idle longer: closed
    zstd_level: int = 1
    threads: int | None = None
    timeouts: HopTimeouts = field(default_factory=HopTimeouts)
    node_id: str | None = None
    movable: bool = False  # the tracker may move this node (assigned, or --allow-rebalance)
    models_dir: Path | None = None  # where to find snapshots for assigned or moved shards
    swarm_token: str | None = field(default=None, repr=False)  # shared secret between services
    api_key: str | None = field(default=None, repr=False)  # clients' key for the OpenAI routes

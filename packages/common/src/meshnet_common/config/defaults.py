"""Every default that more than one place needs, defined once: the CLI flags, the settings
objects, the internal messages and the engine read them from here."""

from __future__ import annotations

KV_BUDGET_TOKENS = 32768  # most tokens a node holds in KV caches across its sessions
CHUNK_TOKENS = 128  # prefill chunk on the wire (docs/adr/0003)
PROMPT_CALL_TOKENS = 8192  # a prompt up to this long is one call on every hop (ADR-0053)
HEARTBEAT_INTERVAL_S = 2.0  # a node's heartbeat; the tracker's value wins once registered
TURN_TIMEOUT_S = 60.0  # a prefill chunk waits this long for an earlier chunk of its session
OPEN_TIMEOUT_S = 5.0  # ... and this long when its session is not open yet (chunk 0 is late)
STREAM_PING_S = 10.0  # keepalive pings on a hop stream: a silent peer is dead after 2x
CONNECTIONS_PER_ADDRESS = 256  # connections one client address may hold open (docs/adr/0032)
BODY_TIMEOUT_S = 30.0  # a request body must arrive within this of its request's start

"""Graceful drain (docs/adr/0024): a node leaves without failing a request.

SIGTERM (or ``POST /v1/node/drain`` with the node's --operator-token) puts the node in ``LEAVING``: it
tells the tracker at once (a registration, not the next heartbeat), which routes no new
session through it; it refuses to open sessions (503 ``draining``: a head that raced the
map fails over elsewhere) and lets the sessions it holds finish. Once none is left, or
after ``--drain-timeout`` (the rest then fail over to replicas, replaying exactly), it
deregisters and exits 0. A second SIGTERM or a SIGINT stops it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from meshnet_common.protocol import NodeState

logger = logging.getLogger(__name__)

POLL_S = 0.1


def busy(runtime) -> int:
    """Sessions this node holds plus generations it drives as a head."""
    service = runtime.service
    stages = [s for s in (service.stage, service.retiring) if s is not None]
    running = runtime.openai.generator.running if runtime.openai is not None else 0
    return sum(len(s.sessions) for s in stages) + running


class Drain:
    """One node's drain; ``start`` is idempotent (a second request changes nothing)."""

    def __init__(self, runtime, timeout_s: float, exit_with: Callable[[int], None]) -> None:
        self.runtime = runtime
        self.timeout_s = timeout_s
        self.exit_with = exit_with
        self.task: asyncio.Task | None = None
        self.started_at: float | None = None
        self.checks = 0  # times it found sessions still held (an event tests wait on)

    @property
    def draining(self) -> bool:
        return self.task is not None

    def start(self) -> None:
        if self.task is not None:
            return
        runtime = self.runtime
        runtime.state = NodeState.LEAVING
        runtime.service.draining = runtime.url
        if runtime.membership is not None:
            runtime.membership.register_again()  # the tracker hears LEAVING now
        self.started_at = time.monotonic()
        logger.info("draining: no new sessions; %d open, waiting up to %.0f s for them",
                    busy(runtime), self.timeout_s)  # fmt: skip
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while busy(self.runtime) and time.monotonic() < deadline:
            self.checks += 1
            await asyncio.sleep(POLL_S)
        left = busy(self.runtime)
        seconds = time.monotonic() - self.started_at
        if left:
            logger.warning("drain timeout after %.1f s: %d sessions still open; they fail over",
                           seconds, left)  # fmt: skip
        else:
            logger.info("drained in %.1f s; deregistering and exiting", seconds)
        self.exit_with(0)  # the lifespan's shutdown deregisters from the tracker

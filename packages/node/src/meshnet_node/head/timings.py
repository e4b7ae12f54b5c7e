"""Where a generation's decode time went: each step's wall time at the head against the
model compute inside it (``meshnet_timing`` in non-streamed completions); and per route, the
wall time of plain decode steps the head reports to the tracker (``RouteTimes``)."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from meshnet_common.protocol import MAX_ROUTE_TIME_HOPS, MAX_ROUTE_TIMES, RouteTime

logger = logging.getLogger(__name__)

ROUTE_STEPS = 32  # the last plain decode steps of a route whose median is reported
ROUTE_MIN_STEPS = 8  # fewer say too little of a route
ROUTE_WINDOW_S = 300.0  # a route is reported while its last step is this recent


@dataclass
class StepTimings:
    """Wall time of each decode step at the head against the model compute inside it.

    What is left after compute is serving overhead: serialization, HTTP, scheduling and
    thread hand-offs, spread over the route's network hops.
    """

    hops: int = 0
    wall_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)

    def add(self, wall_s: float, compute_ms: list[float], hops: int, steps: int = 1) -> None:
        """A step's wall time and every hop's compute in it; a pass that ran ``steps``
        steps ahead (ADR-0047, 0059) counts as that many steps of its average."""
        self.hops = hops
        wall, compute = wall_s * 1000 / steps, sum(compute_ms) / steps
        self.wall_ms += [wall] * steps
        self.compute_ms += [compute] * steps

    def summary(self) -> dict | None:
        if not self.wall_ms:
            return None
        overhead = [w - c for w, c in zip(self.wall_ms, self.compute_ms, strict=True)]
        out = {
            "decode_steps": len(self.wall_ms),
            "hops": self.hops,
            "step_ms_p50": round(statistics.median(self.wall_ms), 3),
            "compute_ms_p50": round(statistics.median(self.compute_ms), 3),
            "overhead_ms_p50": round(statistics.median(overhead), 3),
        }
        if self.hops:
            out["overhead_per_hop_ms_p50"] = round(statistics.median(overhead) / self.hops, 3)
        return out


class RouteTimes:
    """The wall time of this head's plain decode steps (one token, no drafts, no failover)
    per route, the hops after the head, for its heartbeats: the tracker holds the compute
    the route's nodes claim against it (docs/adr/0032). Steps are added on the event loop,
    reports read on the membership thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._routes: dict[tuple[str, ...], tuple[deque[float], float]] = {}  # oldest first
        self._lock = threading.Lock()

    def add(self, route: tuple[str, ...], wall_s: float) -> None:
        if not route or len(route) > MAX_ROUTE_TIME_HOPS:
            return
        with self._lock:
            steps, _ = self._routes.pop(route, None) or (deque(maxlen=ROUTE_STEPS), 0.0)
            steps.append(wall_s * 1000)
            self._routes[route] = (steps, self.clock())
            while len(self._routes) > MAX_ROUTE_TIMES:  # the least recently used goes
                del self._routes[next(iter(self._routes))]

    def report(self) -> tuple[RouteTime, ...]:
        """The recent routes' median step times (a route whose URLs the protocol refuses,
        as a test's made-up hosts may be, is left out rather than fail the heartbeat)."""
        since = self.clock() - ROUTE_WINDOW_S
        with self._lock:
            recent = [
                (route, statistics.median(steps)) for route, (steps, used) in self._routes.items()
                if used >= since and len(steps) >= ROUTE_MIN_STEPS
            ]  # fmt: skip
        reports = []
        for route, step_ms in recent:
            step_ms = round(min(max(step_ms, 1e-3), 60_000.0), 3)  # within the protocol's
            try:
                reports.append(RouteTime(hops=route, step_ms=step_ms))
            except ValidationError:
                logger.debug("route %s: not reported (not a URL the protocol takes)", route)
        return tuple(reports)

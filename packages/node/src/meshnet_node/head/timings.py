"""Where a generation's decode time went: each step's wall time at the head against the
model compute inside it (``meshnet_timing`` in non-streamed completions)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class StepTimings:
    """Wall time of each decode step at the head against the model compute inside it.

    What is left after compute is serving overhead: serialization, HTTP, scheduling and
    thread hand-offs, spread over the route's network hops.
    """

    hops: int = 0
    wall_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)

    def add(self, wall_s: float, compute_ms: list[float], hops: int) -> None:
        self.hops = hops
        self.wall_ms.append(wall_s * 1000)
        self.compute_ms.append(sum(compute_ms))

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

"""Test doubles shared by the audit tests (docs/adr/0026, 0032)."""

from __future__ import annotations


class FakeView:
    """The swarm as audits see it (``SwarmView``): a fixed map, and the verdicts reported."""

    def __init__(self, replicas) -> None:
        self.replicas_ = list(replicas)
        self.reports: list[tuple[str, object]] = []

    async def replicas(self, model_id):
        return self.replicas_

    async def report(self, node_id, verdict):
        self.reports.append((node_id, verdict))

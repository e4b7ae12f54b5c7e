"""Test doubles shared by the audit tests (docs/adr/0026, 0032)."""

from __future__ import annotations

from meshnet_common.layers import LayerRange
from meshnet_common.trust.evidence import Signer, check_evidence


class FakeView:
    """The swarm as audits see it (``SwarmView``): a fixed map, and the verdicts reported."""

    def __init__(self, replicas) -> None:
        self.replicas_ = list(replicas)
        self.reports: list[tuple[str, object]] = []

    async def replicas(self, model_id):
        return self.replicas_

    async def report(self, node_id, verdict):
        self.reports.append((node_id, verdict))


def checked(evidence, suspect, secret_of, tolerance):
    """``check_evidence`` as a tracker that called every node back (hosts of their own,
    serving long enough, one model and precision) sees it: only the rows are judged."""

    def signer(node_id: str) -> Signer:
        return Signer(
            secret=secret_of(node_id), called_back=True, serving=True, model_id="m",
            precision="p", layers=LayerRange(0, 1 << 20), hosts=frozenset({node_id}), since=0.0,
        )  # fmt: skip

    return check_evidence(evidence, suspect, signer, tolerance, now=0.0, witness_age_s=0.0)

"""A removed or quarantined node's certificate ends at once, not when it expires (docs/adr/
0032): the tracker certifies its key no more and lists it in every heartbeat answer, and a
node's checker refuses it from then on. In-process, no sockets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from test_trust_identity import OPERATOR, Swarm, beat

from meshnet_common.trust.identity import CallChecker, Identity, IdentityError
from meshnet_common.trust.manifest_keys import ManifestKey
from meshnet_common.trust.revocation import MAX_REVOKED, Revocations
from meshnet_tracker.app import create_app
from meshnet_tracker.settings import TrackerSettings

HOST, TARGET = "10.0.0.9:9000", "/v1/forward"


@pytest.fixture
def swarm() -> Iterator[Swarm]:
    settings = TrackerSettings(models_dir=None, verify_nodes=False, operator_token="op-7")
    with TestClient(create_app(settings, node=None)) as client:
        yield Swarm(client)


def test_a_removed_or_quarantined_nodes_certificate_is_revoked_at_once(swarm):
    nodes = {n: Identity() for n in ("honest", "faulty", "h1", "h2", "gone")}
    for node_id, identity in nodes.items():
        answer = swarm.register(node_id, public_key=identity.key.public).json()
        identity.adopt(answer["certificate"])
    peer = CallChecker(ManifestKey.from_text(answer["tracker_key"]))  # a node's checker

    def call(node_id: str) -> str | None:
        return peer.caller("POST", HOST, TARGET, nodes[node_id].headers("POST", HOST, TARGET))

    def heartbeat(node_id: str) -> dict:
        resp = swarm.client.post("/v1/nodes/heartbeat", json=beat(node_id),
                                 headers=swarm.proof(node_id))  # fmt: skip
        return resp.json()

    assert call("gone") == "gone" and call("faulty") == "faulty"
    assert heartbeat("honest")["revoked"] == []
    assert swarm.client.delete("/v1/nodes/gone", headers=OPERATOR).status_code == 200
    swarm.report("faulty", "h1")
    assert swarm.report("faulty", "h2").json()["quarantined"] is True
    answer = heartbeat("honest")
    assert set(answer["revoked"]) == {nodes["gone"].key.public, nodes["faulty"].key.public}
    peer.revoked = frozenset(answer["revoked"])  # what a node does with each answer
    for node_id in ("gone", "faulty"):
        with pytest.raises(IdentityError, match="revoked"):
            call(node_id)
    assert call("honest") == "honest"
    assert heartbeat("faulty")["certificate"] is None  # a quarantined node is not renewed
    # the operator lifts the quarantine: certified again, no longer listed
    assert swarm.client.delete("/v1/nodes/faulty/quarantine", headers=OPERATOR).status_code == 200
    assert heartbeat("faulty")["certificate"] is not None
    assert heartbeat("honest")["revoked"] == [nodes["gone"].key.public]
    # the removed node registers again (removal is no ban): certified anew
    again = swarm.register("gone", public_key=nodes["gone"].key.public).json()
    assert again["certificate"] is not None and heartbeat("honest")["revoked"] == []


def test_revocations_last_as_long_as_a_certificate_and_are_bounded():
    now = [0.0]
    revoked = Revocations(clock=lambda: now[0])
    revoked.revoke("k" * 43)
    assert "k" * 43 in revoked and revoked.keys() == ("k" * 43,)
    now[0] = 600 + 120 + 1  # every certificate issued for it has expired
    assert "k" * 43 not in revoked and revoked.keys() == ()
    for n in range(MAX_REVOKED + 5):
        revoked.revoke(f"{n:043d}")
    assert len(revoked.keys()) == MAX_REVOKED and f"{0:043d}" not in revoked

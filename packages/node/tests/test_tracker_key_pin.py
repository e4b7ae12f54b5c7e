"""A node keeps the first tracker key it is answered with (trust on first use) or the one
pinned with --tracker-key, and refuses, in one error line, a tracker answering with
another (docs/adr/0032); it refuses the keys its tracker revoked."""

from __future__ import annotations

import logging

import httpx

from meshnet_common.protocol import (
    Heartbeat,
    HeartbeatResponse,
    NodeAnnouncement,
    RegisterResponse,
    ShardSpec,
)
from meshnet_common.trust.identity import CallChecker, issue
from meshnet_common.trust.manifest_keys import ManifestSigner
from meshnet_node.swarm.membership import Membership


def _answering(keys: list[ManifestSigner], membership: Membership) -> httpx.Client:
    """A tracker answering each registration with the next key of ``keys``."""
    turn = iter(keys)

    def tracker(request: httpx.Request) -> httpx.Response:
        signer = next(turn)
        reply = RegisterResponse(
            node_id="n1", heartbeat_interval_s=1.0, url="http://10.0.0.7:9000",
            certificate=issue(signer, "n1", membership.identity.key.public),
            tracker_key=signer.public().text,
        )  # fmt: skip
        return httpx.Response(200, content=reply.model_dump_json())

    return httpx.Client(transport=httpx.MockTransport(tracker))


def _membership(peers: CallChecker | None = None) -> Membership:
    announcement = NodeAnnouncement(
        node_id="n1", url="http://10.0.0.7:9000", num_layers=2, quantization="bfloat16",
        shard=ShardSpec(model_id="org/model", shard_start=0, shard_end=2), device="cpu",
        memory_declared_bytes=1, memory_free_bytes=1,
    )  # fmt: skip
    return Membership("http://tracker.test", lambda: announcement, lambda: None, 1.0, peers=peers)


def test_an_unpinned_node_keeps_the_first_tracker_key_and_refuses_a_new_one(caplog):
    first, other = ManifestSigner.generate(), ManifestSigner.generate()
    membership = _membership()
    membership._client = _answering([first, other, other, first], membership)
    with caplog.at_level(logging.ERROR, logger="meshnet_node.swarm.membership"):
        for _ in range(4):
            membership.register_once()
    assert membership.peers.tracker_key == first.public()  # never replaced
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1  # said once, not at every registration
    assert other.public().text in errors[0] and "--tracker-key" in errors[0]
    assert "first seen" in errors[0]
    assert membership.peers.authorities >= {"10.0.0.7:9000"}  # where peers' calls aim


def test_a_pinned_key_is_kept_whatever_the_tracker_answers(caplog):
    pinned, other = ManifestSigner.generate(), ManifestSigner.generate()
    membership = _membership(CallChecker.pinned(pinned.public().text))
    membership._client = _answering([other], membership)
    with caplog.at_level(logging.ERROR, logger="meshnet_node.swarm.membership"):
        membership.register_once()
    assert membership.peers.tracker_key == pinned.public()
    assert "pinned with --tracker-key" in caplog.records[-1].getMessage()


def test_a_heartbeat_answer_replaces_the_revoked_keys(caplog):
    revoked = "A" * 43

    def tracker(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=HeartbeatResponse(known=True, revoked=(revoked,))
                              .model_dump_json())  # fmt: skip

    membership = _membership()
    membership.heartbeat = lambda: Heartbeat(node_id="n1", state="serving", active_sessions=0,
                                             kv_tokens=0, memory_free_bytes=1)  # fmt: skip
    membership._client = httpx.Client(transport=httpx.MockTransport(tracker))
    assert membership.beat() is not None
    assert revoked in membership.peers.revoked

"""Bounded resources on a node (issue #35, docs/adr/0032): one peer cannot fill the session
table, and a node serving TLS dials no plain-HTTP hop."""

from __future__ import annotations

import asyncio

import pytest
from transformers import LlamaConfig

from meshnet_common.errors import CapacityExceeded
from meshnet_node.dataplane.streams import HopUnreachable, StreamHops
from meshnet_node.engine.sessions import SessionStore, opening_peer


def store(max_sessions: int = 4) -> SessionStore:
    config = LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2)
    return SessionStore(config, kv_budget_tokens=1024, max_sessions=max_sessions)


def open_as(sessions: SessionStore, peer: str | None, session_id: str) -> None:
    token = opening_peer.set(peer)
    try:
        sessions.open(session_id)
    finally:
        opening_peer.reset(token)


def test_one_peer_leaves_room_for_the_others():
    sessions = store(max_sessions=4)
    assert sessions.max_per_peer == 3
    for i in range(3):
        open_as(sessions, "10.0.0.5", f"a{i}")
    with pytest.raises(CapacityExceeded) as info:
        open_as(sessions, "10.0.0.5", "a3")
    assert info.value.code == "too_many_sessions" and "per peer" in info.value.message
    open_as(sessions, "10.0.0.6", "b0")  # another peer still gets the last place
    assert len(sessions) == 4
    sessions.close("a0")
    open_as(sessions, "10.0.0.5", "a4")  # a closed session frees the peer's place


def test_the_nodes_own_head_is_bounded_by_the_stage_only():
    sessions = store(max_sessions=4)
    for i in range(4):
        open_as(sessions, None, f"h{i}")
    with pytest.raises(CapacityExceeded):
        open_as(sessions, None, "h4")


def test_a_tiny_stage_keeps_its_one_place():
    assert store(max_sessions=1).max_per_peer == 1


def test_a_tls_node_dials_no_plain_http_hop():
    async def go():
        hops = StreamHops(headers={}, connect_timeout=1.0, https_only=True)
        with pytest.raises(HopUnreachable, match="--tls-cert"):
            await hops.request("POST", "http://127.0.0.1:1/v1/forward", headers={}, body=b"",
                               timeout=1.0)  # fmt: skip
        await hops.aclose()

    asyncio.run(go())


def test_a_hop_stream_reads_no_more_than_its_bound_in_flight(monkeypatch):
    """Past MAX_IN_FLIGHT unanswered messages the stream stops reading (the peer waits on
    the socket); one answer lets the next message in. The peer's address reaches the step."""
    from types import SimpleNamespace

    from meshnet_node.dataplane import stream_server
    from meshnet_node.dataplane.frames import Kind, encode_request
    from meshnet_node.dataplane.handlers import Answer

    monkeypatch.setattr(stream_server, "MAX_IN_FLIGHT", 3)

    async def go():
        release, peers = asyncio.Event(), []

        async def held_step(service, headers, body, peer=None):
            peers.append(peer)
            await release.wait()
            return Answer(200, b"{}", ())

        monkeypatch.setattr(stream_server, "forward_answer", held_step)
        inbox: asyncio.Queue = asyncio.Queue()
        for i in range(5):
            message = encode_request(Kind.STEP, i, {}, b"x")
            inbox.put_nowait({"type": "websocket.receive", "bytes": message})
        inbox.put_nowait({"type": "websocket.disconnect"})
        sent = []

        async def send(message):
            sent.append(message)

        service = SimpleNamespace(settings=SimpleNamespace(max_body_bytes=1 << 20),
                                  metrics=SimpleNamespace())  # fmt: skip
        monkeypatch.setattr(stream_server, "record_request", lambda *a: None)
        scope = {"client": ("10.0.0.7", 5555)}
        stream = stream_server._ServerStream(scope, inbox.get, send, service)
        stream.next_receiver()
        for _ in range(20):
            await asyncio.sleep(0)
        assert stream.in_flight == 3 and inbox.qsize() == 3  # two steps wait unread
        release.set()
        await asyncio.wait_for(stream.ended, 5)
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(sent) == 5 and peers == ["10.0.0.7"] * 5

    asyncio.run(go())


def test_a_signed_caller_is_bounded_by_its_node_id_not_its_address():
    from meshnet_common.web.auth import PEER_SCOPE_KEY
    from meshnet_node.dataplane.handlers import peer_of

    # two nodes behind one address are two peers; one node on two addresses is one
    a = {"client": ("10.0.0.1", 4000), PEER_SCOPE_KEY: "node-a"}
    b = {"client": ("10.0.0.1", 4001), PEER_SCOPE_KEY: "node-b"}
    a_again = {"client": ("10.0.0.2", 4002), PEER_SCOPE_KEY: "node-a"}
    assert peer_of(a) != peer_of(b) and peer_of(a) == peer_of(a_again) == "node:node-a"
    assert peer_of({"client": ("10.0.0.1", 4000)}) == "10.0.0.1"  # unsigned: its address

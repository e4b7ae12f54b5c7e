"""Hop streams (docs/adr/0022) between a real client and a real server on loopback.

A tail node built from the tiny test model is served the way ``meshnet_common.web.serve``
serves it (uvicorn's sans-I/O WebSockets, ``ws_max_size`` from the node's body limit) in a
thread. ``StreamHops``, the client every node uses for its next hops, drives it; a raw
``websockets`` client sends what no node would (garbage, text, oversize messages, no token).

Every session is driven along one canonical sequence (open with ``hidden(3)`` at position 0,
then one token at each position ``p`` with ``hidden(1, seed=p)``), so every token answered can
be checked against the same steps through the in-process ASGI path (``ForwardPath`` behind
FastAPI's ``TestClient``) of an identically built node.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect

from meshnet_common import wire
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import H_COMPUTE, H_SESSION_KEY, H_SWARM_TOKEN
from meshnet_node.dataplane.frames import (
    MAX_HEADER_BYTES,
    STREAM_PATH,
    SUBPROTOCOL,
    FrameError,
    Kind,
    decode_answer,
    decode_request,
    encode_answer,
    encode_request,
)
from meshnet_node.dataplane.steps import OpenSpec, Step
from meshnet_node.dataplane.stream_server import max_message_bytes
from meshnet_node.dataplane.streams import HopUnreachable, StreamHops
from meshnet_node.runtime import NodeRuntime, build_runtime, create_app
from meshnet_node.settings import NodeSettings

HOST = "127.0.0.1"  # every server here listens on loopback only
MODEL_ID = "meshnet-tiny/llama"
HIDDEN = 64  # the tiny models' hidden size
LIMIT = 4096  # max_body_bytes of the nodes here: a 3-token float32 frame fits, 20 tokens don't
ERROR_KEYS = {"message", "type", "param", "code"}
TOKEN_KEYS = {"token_id", "logprob", "top_logprobs"}
LAST = 12  # the canonical sequence's last decode position
TOKEN = "s3cret"


def settings_for(snapshot: Path, **overrides) -> NodeSettings:
    """A tail node [4, 6) of the tiny llama, float32."""
    return NodeSettings(
        model_id=MODEL_ID, model_path=snapshot, layers=LayerRange(4, 6),
        quantization=Precision.FLOAT32, max_frame_mb=LIMIT / 2**20, **overrides,
    )  # fmt: skip


async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
    return ()


@dataclass
class Served:
    server: uvicorn.Server
    thread: threading.Thread
    port: int
    runtime: NodeRuntime

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{HOST}:{self.port}{STREAM_PATH}"

    @property
    def sessions(self):
        return self.runtime.service.stage.sessions

    def stop(self, timeout: float = 10.0) -> float:
        started = time.monotonic()
        self.server.should_exit = True
        self.thread.join(timeout)
        return time.monotonic() - started


@contextmanager
def serving(snapshot: Path, *, loop: str = "auto", **overrides) -> Iterator[Served]:
    """A tail node under uvicorn in a thread, configured as ``meshnet_common.web.serve`` does."""
    runtime = build_runtime(settings_for(snapshot, **overrides), route_provider=no_route)
    app = create_app(runtime)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    config = uvicorn.Config(
        app, lifespan="on", log_config=None, log_level="warning", access_log=False,
        server_header=False, date_header=False, loop=loop, ws="websockets-sansio",
        ws_max_size=max_message_bytes(LIMIT), ws_per_message_deflate=False,
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20.0
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    served = Served(server, thread, sock.getsockname()[1], runtime)
    try:
        yield served
    finally:
        served.stop()
        sock.close()
        assert not served.thread.is_alive(), "uvicorn did not shut down"


# -- steps ------------------------------------------------------------------------------------


def open_spec(start_layer: int = 4, **sampling) -> OpenSpec:
    return OpenSpec(**sampling, start_layer=start_layer)


def hidden(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def step_head(session_id: str, position: int, *, key: str = "key", opening=None) -> dict:
    return Step(session_id, key, position, open_spec=opening, sample=True).to_headers()


def canonical(session_id: str, position: int, *, key: str = "key") -> tuple[dict, bytes]:
    """Headers and body of the canonical step at ``position`` (0 opens with 3 tokens)."""
    if position == 0:
        return step_head(session_id, 0, key=key, opening=open_spec()), wire.encode_tensor(hidden(3))  # fmt: skip
    return step_head(session_id, position, key=key), wire.encode_tensor(hidden(1, seed=position))  # fmt: skip


def make_hops(**kwargs) -> StreamHops:
    return StreamHops(headers={}, connect_timeout=5.0, **kwargs)


async def step(hops: StreamHops, node: Served, sid: str, position: int, timeout: float = 30.0):
    head, body = canonical(sid, position)
    return await hops.request("POST", f"{node.url}/v1/forward", headers=head, body=body,
                              timeout=timeout)  # fmt: skip


async def close(hops: StreamHops, node: Served, sid: str):
    return await hops.request("DELETE", f"{node.url}/v1/sessions/{sid}",
                              headers={H_SESSION_KEY: "key"}, body=None, timeout=10.0)  # fmt: skip


def assert_token(resp, expected: dict) -> None:
    assert resp.status == 200, (resp.status, resp.body)
    body = json.loads(resp.body)
    assert set(body) == TOKEN_KEYS
    assert body["token_id"] == expected["token_id"]
    assert body["logprob"] == pytest.approx(expected["logprob"], abs=1e-5)
    assert resp.compute_ms is not None and float(resp.compute_ms) > 0


def assert_error(resp, status: int, error_type: str | None = None) -> dict:
    assert resp.status == status, (resp.status, resp.body)
    body = json.loads(resp.body)
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    if error_type is not None:
        assert body["error"]["type"] == error_type
    return body["error"]


def raw_stream(node: Served, **kwargs):
    """A plain websockets client on the node's stream (what no node would send)."""
    return ws_connect(node.ws_url, subprotocols=[SUBPROTOCOL], compression=None,
                      open_timeout=5, close_timeout=2, max_size=None, proxy=None, **kwargs)  # fmt: skip


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshot(tiny_snapshot) -> Path:
    return tiny_snapshot("llama")


@pytest.fixture(scope="module")
def expected(snapshot) -> dict[int, dict]:
    """The canonical answers through the in-process ASGI path: position -> answer body."""
    runtime = build_runtime(settings_for(snapshot), route_provider=no_route)
    answers = {}
    with TestClient(create_app(runtime)) as client:
        for position in (0, *range(3, LAST + 1)):
            head, body = canonical("reference", position)
            resp = client.post("/v1/forward", content=body, headers=head)
            assert resp.status_code == 200, resp.text
            answers[position] = resp.json()
    return answers


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def node(request, snapshot) -> Iterator[Served]:
    with serving(snapshot, loop=request.param) as served:
        yield served


@pytest.fixture(scope="module")
def token_node(snapshot) -> Iterator[Served]:
    with serving(snapshot, swarm_token=TOKEN) as served:
        yield served


# -- 1. steps on one stream --------------------------------------------------------------------


def test_a_session_over_the_stream_agrees_with_the_asgi_path(node, expected):
    async def main():
        hops = make_hops()
        for position in (0, *range(3, LAST + 1)):
            assert_token(await step(hops, node, "seq", position), expected[position])
        assert len(hops._streams) == 1  # every step on the one stream
        assert json.loads((await close(hops, node, "seq")).body) == {"closed": "seq"}
        await hops.aclose()

    asyncio.run(main())
    assert node.sessions.peek("seq") is None


def test_sessions_are_multiplexed_on_one_stream(node, expected):
    """Eight sessions step at once: their messages interleave on one stream, each answer
    finds its request (ids), and every token is the canonical one."""
    sids = [f"mux-{i}" for i in range(8)]

    async def walk(hops, sid):
        for position in (0, *range(3, 8)):
            assert_token(await step(hops, node, sid, position), expected[position])

    async def main():
        hops = make_hops()
        await asyncio.gather(*(walk(hops, sid) for sid in sids))
        stream = next(iter(hops._streams.values()))
        assert len(hops._streams) == 1 and stream.next_id == 1 + 8 * 6
        for sid in sids:
            await close(hops, node, sid)
        await hops.aclose()

    asyncio.run(main())


BAD_STEPS = {
    "missing session header": (lambda sid: {k: v for k, v in step_head(sid, 3).items()
                                            if k != "x-meshnet-session"}, 400),
    "position behind": (lambda sid: step_head(sid, 0), 409),
    "unknown session": (lambda sid: step_head("nobody", 3), 404),
    "wrong session key": (lambda sid: step_head(sid, 3, key="other"), 404),  # hides it
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_STEPS)
def test_a_bad_step_is_an_error_answer_and_the_stream_stays(node, expected, case):
    make, status = BAD_STEPS[case]
    sid = "bad-" + "".join(c if c.isalnum() else "-" for c in case)

    async def main():
        hops = make_hops()
        assert_token(await step(hops, node, sid, 0), expected[0])
        stream = hops._streams[node.ws_url]
        resp = await hops.request("POST", f"{node.url}/v1/forward", headers=make(sid),
                                  body=wire.encode_tensor(hidden(1, seed=3)), timeout=10)  # fmt: skip
        assert_error(resp, status)
        assert node.sessions.peek(sid).length == 3
        # The same stream still carries the next good step, at the right position.
        assert_token(await step(hops, node, sid, 3), expected[3])
        assert hops._streams[node.ws_url] is stream
        await close(hops, node, sid)
        await hops.aclose()

    asyncio.run(main())


def test_a_bad_frame_body_is_400_bad_frame(node, expected):
    async def main():
        hops = make_hops()
        resp = await hops.request("POST", f"{node.url}/v1/forward",
                                  headers=step_head("junk", 0, opening=open_spec()),
                                  body=b"junk", timeout=10)  # fmt: skip
        assert assert_error(resp, 400)["code"] == "bad_frame"
        await hops.aclose()

    asyncio.run(main())


# -- 2. limits -------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_and_the_stream_stays(node, expected):
    async def main():
        hops = make_hops()
        assert_token(await step(hops, node, "big", 0), expected[0])
        too_big = wire.encode_tensor(hidden(20))
        assert len(too_big) > LIMIT
        resp = await hops.request("POST", f"{node.url}/v1/forward", headers=step_head("big", 3),
                                  body=too_big, timeout=10)  # fmt: skip
        assert "limit" in assert_error(resp, 413)["message"]
        # Larger than the stream's message limit: refused before it is sent.
        huge = b"\0" * (max_message_bytes(LIMIT) + 1)
        resp = await hops.request("POST", f"{node.url}/v1/forward", headers=step_head("big", 3),
                                  body=huge, timeout=10)  # fmt: skip
        assert assert_error(resp, 413)["code"] == "payload_too_large"
        assert_token(await step(hops, node, "big", 3), expected[3])
        await close(hops, node, "big")
        await hops.aclose()

    asyncio.run(main())


def test_a_message_over_the_stream_limit_closes_the_stream_1009(node, expected):
    with raw_stream(node) as ws:
        # The node may close while the client is still writing the message: then the send
        # itself reports the close it received.
        with pytest.raises(ConnectionClosed) as closed:
            ws.send(encode_request(Kind.STEP, 1, {}, b"\0" * (max_message_bytes(LIMIT) + 1)))
            ws.recv(timeout=5)
        assert closed.value.rcvd.code == 1009
    asyncio.run(_still_serves(node, expected, "after-1009"))


# -- 3. malformed messages: the stream closes with an error, the node serves on ----------------


async def _still_serves(node: Served, expected: dict, sid: str) -> None:
    hops = make_hops()
    assert_token(await step(hops, node, sid, 0), expected[0])
    await close(hops, node, sid)
    await hops.aclose()


MALFORMED = {
    "empty": b"",
    "short": b"\x01\x00\x00",
    "unknown kind": struct.pack("!BII", 9, 1, 2) + b"{}",
    "an answer sent as a request": encode_answer(1, 200, {}, b"{}"),
    "header past the end": struct.pack("!BII", 1, 1, 100) + b"{}",
    "header not json": struct.pack("!BII", 1, 1, 3) + b"{{{",
    "header not an object": struct.pack("!BII", 1, 1, 2) + b"[]",
    "header value not a string": struct.pack("!BII", 1, 1, 7) + b'{"a":1}',
    "header too long": struct.pack("!BII", 1, 1, MAX_HEADER_BYTES + 1),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_message_closes_the_stream_1007(node, expected, case):
    with raw_stream(node) as ws:
        ws.send(MALFORMED[case])
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd.code == 1007 and closed.value.rcvd.reason
    asyncio.run(_still_serves(node, expected, "after-" + "".join(c for c in case if c.isalpha())))


def test_a_text_message_closes_the_stream_1003(node, expected):
    with raw_stream(node) as ws:
        ws.send("hello")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd.code == 1003
    asyncio.run(_still_serves(node, expected, "after-text"))


def test_garbage_bytes_on_the_socket_never_crash_the_node(node, expected):
    """Not even a WebSocket: the handshake fails; bytes after a good handshake that are not
    WebSocket frames: the connection closes (1002)."""
    with socket.create_connection((HOST, node.port), timeout=5) as sock:
        sock.sendall(b"GET /v1/stream HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\n\r\n\x00\xff")
        assert sock.recv(1024).startswith(b"HTTP/1.1 4")
    with raw_stream(node) as ws:
        ws.socket.sendall(b"\xff\xff\xff\xff not a frame")
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=5)
    asyncio.run(_still_serves(node, expected, "after-garbage"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(data=st.one_of(
    st.binary(max_size=64),
    st.builds(lambda kind, rid, head, body: struct.pack("!BII", kind, rid, len(head)) + head + body,
              st.integers(0, 255), st.integers(0, 2**32 - 1),
              st.binary(max_size=40) | st.sampled_from([b"{}", b'{"x-meshnet-session":"f"}']),
              st.binary(max_size=40)),
))  # fmt: skip
def test_fuzzed_messages_get_an_answer_or_close_the_stream(node, data):
    """Whatever arrives, the node answers it (an error, mostly) or closes the stream with an
    error code; it never crashes, hangs or leaves the stream half-open."""
    with raw_stream(node) as ws:
        ws.send(data)
        try:
            got = decode_answer(ws.recv(timeout=10))
        except ConnectionClosed as closed:
            assert closed.rcvd is not None and closed.rcvd.code in (1003, 1007)
            with pytest.raises(FrameError):
                decode_request(data)
        else:
            request = decode_request(data)  # it parsed: the answer is to it
            assert got.id == request.id and 400 <= got.status < 500
            assert set(json.loads(got.body)["error"]) == ERROR_KEYS
    with httpx.Client() as client:
        assert client.get(f"{node.url}/health", timeout=5).status_code == 200


@given(kind=st.sampled_from([Kind.STEP, Kind.CLOSE, Kind.DELIVER]), rid=st.integers(0, 2**32 - 1),
       headers=st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=6),
       body=st.binary(max_size=256))  # fmt: skip
def test_requests_and_answers_round_trip(kind, rid, headers, body):
    assert decode_request(encode_request(kind, rid, headers, body)) == (kind, rid, headers, body)
    status = 100 + rid % 500
    assert decode_answer(encode_answer(rid, status, headers, body)) == (rid, status, headers, body)


@given(value=st.text(alphabet="0123456789.,", max_size=40) | st.text(max_size=20),
       rid=st.integers(0, 2**32 - 1))  # fmt: skip
def test_a_step_answers_compute_header_reads_as_json_would(value, rid):
    headers = {H_COMPUTE: value}
    as_json = json.dumps(headers, separators=(",", ":")).encode()  # what _reply writes
    for header in (headers, as_json):
        assert decode_answer(encode_answer(rid, 200, header, b"{}")) == (rid, 200, headers, b"{}")


@given(data=st.binary(max_size=200))
def test_decoding_raises_only_frame_errors(data):
    for decode in (decode_request, decode_answer):
        with suppress(FrameError):
            decode(data)


# -- 4. the handshake: subprotocol and swarm token ---------------------------------------------


def test_a_stream_without_the_subprotocol_is_refused_400(node):
    with pytest.raises(InvalidStatus) as refused:
        ws_connect(node.ws_url, open_timeout=5, proxy=None)
    assert refused.value.response.status_code == 400
    assert set(json.loads(refused.value.response.body)["error"]) == ERROR_KEYS


def test_the_swarm_token_is_checked_when_the_stream_opens(token_node, expected):
    async def main():
        hops = make_hops()  # no token
        resp = await step(hops, token_node, "tok", 0)
        assert assert_error(resp, 401, "authentication_error")
        assert hops._streams == {}  # a refused stream is not kept
        wrong = StreamHops(headers={H_SWARM_TOKEN: "wrong"}, connect_timeout=5.0)
        assert (await step(wrong, token_node, "tok", 0)).status == 401
        right = StreamHops(headers={H_SWARM_TOKEN: TOKEN}, connect_timeout=5.0)
        assert_token(await step(right, token_node, "tok", 0), expected[0])
        await close(right, token_node, "tok")
        for client in (hops, wrong, right):
            await client.aclose()

    asyncio.run(main())


# -- 5. dead streams, timeouts ---------------------------------------------------------------


@dataclass
class HeldPasses:
    """A served node's compute passes held at a gate: ``entered`` is set once one began,
    and each waits for ``release`` (a hop mid-step for as long as a test needs)."""

    entered: threading.Event
    release: threading.Event


@contextmanager
def held_passes(node: Served) -> Iterator[HeldPasses]:
    """Hold every compute pass of ``node`` from now on until ``release`` (set on leaving,
    so that the node can always shut down). Passes run on the node's compute thread: the
    node's loop goes on meanwhile."""
    held = HeldPasses(threading.Event(), threading.Event())
    compute = node.runtime.service.scheduler

    def gate() -> None:
        held.entered.set()
        held.release.wait(30)

    compute.before_pass = gate
    try:
        yield held
    finally:
        held.release.set()


def test_a_dead_stream_fails_its_requests_and_the_next_one_reconnects(snapshot, expected):
    async def main():
        hops = make_hops()
        with serving(snapshot) as node:
            assert_token(await step(hops, node, "dead", 0), expected[0])
            with held_passes(node) as held:
                in_flight = asyncio.ensure_future(step(hops, node, "dead", 3))
                assert await asyncio.to_thread(held.entered.wait, 30)  # the hop computes it
                # The hop goes away mid-step: its shutdown closes the stream at once, and
                # waits for the held pass (released once the client saw the close).
                stopping = asyncio.ensure_future(asyncio.to_thread(node.stop))
                with pytest.raises(HopUnreachable, match="closed"):
                    await in_flight
                held.release.set()
                await stopping
        with pytest.raises(HopUnreachable):  # nobody listens there now
            await step(hops, node, "dead", 3, timeout=5)
        with serving(snapshot) as other:  # a fresh hop: a fresh stream
            assert_token(await step(hops, other, "alive", 0), expected[0])
        await hops.aclose()

    asyncio.run(main())


def test_a_step_that_times_out_leaves_the_stream_usable(snapshot, expected):
    async def main():
        hops = make_hops()
        with serving(snapshot) as node, held_passes(node) as held:
            # The pass is held until after the wait ended: only the timeout can end it.
            with pytest.raises(HopUnreachable, match="TimeoutError"):
                await step(hops, node, "slow", 0, timeout=0.2)
            stream = hops._streams[node.ws_url]
            answered = asyncio.Event()
            on_message = stream.on_message

            def noting(data) -> None:
                on_message(data)
                answered.set()

            stream.on_message = noting
            assert await asyncio.to_thread(held.entered.wait, 30)  # the hop got the step
            assert not answered.is_set()
            held.release.set()
            await asyncio.wait_for(answered.wait(), 30)  # the late answer arrives: dropped
            assert stream.usable and stream.pending == {}
            assert_token(await step(hops, node, "slow", 3), expected[3])
        await hops.aclose()

    asyncio.run(main())


def test_graceful_shutdown_with_open_streams_does_not_hang(snapshot, expected):
    async def main():
        hops = make_hops()
        with serving(snapshot) as node:
            assert_token(await step(hops, node, "bye", 0), expected[0])
            seconds = await asyncio.to_thread(node.stop)
            assert seconds < 5
            await asyncio.sleep(0.1)
            assert not hops._streams[node.ws_url].usable  # the client saw the close
        await hops.aclose()

    asyncio.run(main())


# -- 6. direct answers, closes and metrics over the stream --------------------------------------


def test_close_and_deliver_over_the_stream(node, expected):
    async def main():
        hops = make_hops()
        assert_token(await step(hops, node, "cd", 0), expected[0])
        assert json.loads((await close(hops, node, "cd")).body) == {"closed": "cd"}
        assert node.sessions.peek("cd") is None
        resp = await hops.request("POST", f"{node.url}/v1/answers/cd",
                                  headers={H_SESSION_KEY: "key", "x-meshnet-position": "3"},
                                  body=b"{}", timeout=5)  # fmt: skip
        assert_error(resp, 404, "not_found_error")  # no step of this head waits for it
        resp = await hops.request("POST", f"{node.url}/v1/answers/cd", headers={}, body=b"{}",
                                  timeout=5)  # fmt: skip
        assert_error(resp, 400)
        await hops.aclose()

    asyncio.run(main())


def metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = "^" + re.escape(name + (f"{{{want}}}" if labels else "")) + r" (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_metrics_count_stream_steps_and_wire_bytes(node, expected):
    forward, sessions = "/v1/forward", "/v1/sessions/{session_id}"
    scrape = lambda: httpx.get(f"{node.url}/metrics", timeout=5).text  # noqa: E731
    before = scrape()
    sent = 0

    async def main():
        nonlocal sent
        hops = make_hops()
        for position in (0, 3, 4, 5, 6):
            sent += len(canonical("metrics", position)[1])
            assert_token(await step(hops, node, "metrics", position), expected[position])
        resp = await hops.request("POST", f"{node.url}/v1/forward",
                                  headers=step_head("metrics", 7), body=b"junk", timeout=5)  # fmt: skip
        sent += 4
        assert assert_error(resp, 400)["code"] == "bad_frame"
        await close(hops, node, "metrics")
        await hops.aclose()

    asyncio.run(main())
    growth = {  # (name, labels): by how much it grew
        ("meshnet_requests_total", (("path", forward), ("status", "200"))): 5,
        ("meshnet_requests_total", (("path", forward), ("status", "400"))): 1,
        ("meshnet_requests_total", (("path", sessions), ("status", "200"))): 1,
        ("meshnet_errors_total", (("code", "bad_frame"), ("status", "400"))): 1,
        ("meshnet_wire_received_bytes_total", ()): sent,
    }

    def grew(after: str) -> dict:
        return {(name, labels): metric(after, name, **dict(labels))
                - metric(before, name, **dict(labels)) for name, labels in growth}  # fmt: skip

    # Each is recorded just after its answer: wait until all are (counters never shrink).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        got < growth[key] for key, got in grew(scrape()).items()
    ):
        time.sleep(0.01)
    assert grew(scrape()) == growth


def test_plain_http_steps_still_work_for_tools(node, expected):
    """``POST /v1/forward`` over HTTP (ForwardPath) stays for tools and in-process tests."""
    head, body = canonical("http", 0)
    resp = httpx.post(f"{node.url}/v1/forward", content=body, headers=head, timeout=10)
    assert resp.status_code == 200 and resp.json()["token_id"] == expected[0]["token_id"]
    resp = httpx.delete(f"{node.url}/v1/sessions/http", headers={H_SESSION_KEY: "key"})
    assert resp.json() == {"closed": "http"}

"""The data path's own HTTP/1.1 front end (``HopServerConnection``) in a real uvicorn server.

A tail node built from the tiny test model is served the way ``meshnet_common.web.serve`` serves
it (``http=protocol_factory(app)``, no server/date headers) by uvicorn in a thread, on a
loopback socket. The tests talk to it byte for byte over raw sockets (and with httpx): the
data path's answers, the hand-over of a connection to uvicorn for every other request,
errors that keep the node and its sessions intact, the swarm token, pipelining, requests
split into tiny writes, metrics, the idle timeout and graceful shutdown.

Every session here is driven along one canonical sequence (open with ``hidden(3)`` at
position 0, then one token at each position ``p`` with ``hidden(1, seed=p)``), so every
token answered can be checked against the same steps through the in-process ASGI path
(``ForwardPath`` behind FastAPI's ``TestClient``) of an identically built node.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from meshnet_common import wire
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import (
    H_COMPUTE,
    H_SESSION,
    H_SESSION_KEY,
    H_SWARM_TOKEN,
    SamplingSpec,
)
from meshnet_node.dataplane.hop_server import protocol_factory
from meshnet_node.dataplane.steps import step_headers
from meshnet_node.runtime import NodeRuntime, build_runtime, create_app
from meshnet_node.settings import NodeSettings

HOST = "127.0.0.1"  # every server here listens on loopback only
MODEL_ID = "meshnet-tiny/llama"
HIDDEN = 64  # the tiny models' hidden size
LIMIT = 4096  # max_body_bytes of the nodes here: a 3-token float32 frame fits, 20 tokens don't
ERROR_KEYS = {"message", "type", "param", "code"}
TOKEN_KEYS = {"token_id", "logprob", "top_logprobs"}
REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
LAST = 12  # the canonical sequence's last decode position


# -- nodes ---------------------------------------------------------------------------------


def settings_for(snapshot: Path, **overrides) -> NodeSettings:
    """A tail node [4, 6) of the tiny llama, float32."""
    return NodeSettings(
        model_id=MODEL_ID,
        model_path=snapshot,
        layers=LayerRange(4, 6),
        quantization=Precision.FLOAT32,
        max_frame_mb=LIMIT / 2**20,
        **overrides,
    )


async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
    return ()


@dataclass
class Served:
    server: uvicorn.Server
    thread: threading.Thread
    port: int
    runtime: NodeRuntime
    app: FastAPI

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def sessions(self):
        return self.runtime.service.stage.sessions

    def connect(self) -> Conn:
        return Conn(self.port)

    def stop(self, timeout: float = 10.0) -> float:
        """Ask the server to exit; the seconds its thread took to end."""
        started = time.monotonic()
        self.server.should_exit = True
        self.thread.join(timeout)
        return time.monotonic() - started


@contextmanager
def serving(snapshot: Path, *, loop: str = "auto", **config) -> Iterator[Served]:
    """A tail node under uvicorn in a thread, configured as ``meshnet_common.web.serve`` does."""
    overrides = {k: config.pop(k) for k in ("swarm_token",) if k in config}
    runtime = build_runtime(settings_for(snapshot, **overrides), route_provider=no_route)
    app = create_app(runtime)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    uconfig = uvicorn.Config(
        app, lifespan="on", log_config=None, log_level="warning", access_log=False,
        server_header=False, date_header=False, http=protocol_factory(app), loop=loop, **config,
    )  # fmt: skip
    server = uvicorn.Server(uconfig)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn-data-path"
    )
    thread.start()
    deadline = time.monotonic() + 20.0
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    served = Served(server, thread, sock.getsockname()[1], runtime, app)
    try:
        yield served
    finally:
        served.stop()
        sock.close()
        assert not thread.is_alive(), "uvicorn did not shut down"


# -- requests, byte for byte ----------------------------------------------------------------


def open_spec(start_layer: int = 4, **sampling) -> dict:
    return {**SamplingSpec(**sampling).model_dump(), "start_layer": start_layer}


def hidden(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def frame(tensor: torch.Tensor) -> bytes:
    return wire.encode_tensor(tensor)


def step_head(session_id: str, position: int, *, key: str = "key", opening=None) -> dict:
    return step_headers(
        session_id=session_id, session_key=key, position=position, chunk=0, route=(),
        sample=True, open_spec=opening,
    )  # fmt: skip


def canonical(session_id: str, position: int, *, key: str = "key") -> tuple[dict, bytes]:
    """Headers and body of the canonical step at ``position`` (0 opens with 3 tokens)."""
    if position == 0:
        return step_head(session_id, 0, key=key, opening=open_spec()), frame(hidden(3))
    return step_head(session_id, position, key=key), frame(hidden(1, seed=position))


def raw_request(
    method: str, target: str, headers: dict[str, str] | None = None, body: bytes | None = None
) -> bytes:
    """One HTTP/1.1 request: host first, then ``headers`` in order, then content-length."""
    lines = [f"{method} {target} HTTP/1.1", f"host: {HOST}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body is not None:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def step_request(session_id: str, position: int, *, key: str = "key", extra=None) -> bytes:
    head, body = canonical(session_id, position, key=key)
    return raw_request("POST", "/v1/forward", {**head, **(extra or {})}, body)


def delete_request(session_id: str, *, key: str = "key", extra=None) -> bytes:
    return raw_request("DELETE", f"/v1/sessions/{session_id}", {H_SESSION_KEY: key, **(extra or {})})  # fmt: skip


class Reply(NamedTuple):
    status: int
    reason: str
    headers: list[tuple[str, str]]  # lower-case names, in order
    body: bytes

    def header(self, name: str) -> str | None:
        found = [v for k, v in self.headers if k == name]
        assert len(found) <= 1, f"{name} answered {len(found)} times: {self.headers}"
        return found[0] if found else None

    def json(self):
        assert self.header("content-type") == "application/json", self.headers
        return json.loads(self.body)


class Conn:
    """A client socket reading answers off a buffer (nothing read past an answer is lost)."""

    def __init__(self, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def dribble(self, data: bytes, pause: float = 0.002) -> None:
        """Send ``data`` one byte a write, pausing so that each arrives on its own."""
        for i in range(len(data)):
            self.sock.sendall(data[i : i + 1])
            time.sleep(pause)

    def _fill(self) -> bool:
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            return False
        self.buf += chunk
        return bool(chunk)

    def reply(self) -> Reply:
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                raise EOFError(f"the server closed mid-answer: {self.buf!r}")
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        version, status, reason = (status_line.split(" ", 2) + [""])[:3]
        assert version == "HTTP/1.1", status_line
        fields = []
        for line in lines:
            name, sep, value = line.partition(":")
            assert sep and name == name.strip(), f"malformed header line {line!r}"
            fields.append((name.lower(), value.strip()))
        lengths = [v for k, v in fields if k == "content-length"]
        assert len(lengths) == 1, f"expected one content-length: {fields}"
        size = int(lengths[0])
        while len(self.buf) < size:
            if not self._fill():
                raise EOFError("the server closed mid-body")
        body, self.buf = self.buf[:size], self.buf[size:]
        return Reply(int(status), reason, fields, body)

    def request(self, data: bytes) -> Reply:
        self.send(data)
        return self.reply()

    def closed_within(self, seconds: float) -> float | None:
        """Seconds until the server closes this connection (None: still open after
        ``seconds``). Nothing else may arrive first."""
        started = time.monotonic()
        self.sock.settimeout(seconds)
        try:
            while True:
                try:
                    chunk = self.sock.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                assert not chunk and not self.buf, f"unexpected bytes: {self.buf + chunk!r}"
                return time.monotonic() - started
        except TimeoutError:
            return None
        finally:
            self.sock.settimeout(5.0)


def assert_step(reply: Reply, expected: dict, *, request_id: str | None = None) -> dict:
    """A step's answer: 200, the expected token, one compute time, a request id."""
    assert reply.status == 200, (reply.status, reply.body)
    assert reply.header("content-length") == str(len(reply.body))
    body = reply.json()
    assert set(body) == TOKEN_KEYS
    assert body["token_id"] == expected["token_id"]
    assert body["logprob"] == pytest.approx(expected["logprob"], abs=1e-5)
    compute = reply.header(H_COMPUTE)
    assert compute is not None and "," not in compute, compute  # a tail: one hop's time
    assert float(compute) > 0
    rid = reply.header("x-request-id")
    assert rid is not None and REQUEST_ID.match(rid)
    if request_id is not None:
        assert rid == request_id
    return body


def assert_error(reply: Reply, status: int, error_type: str | None = None) -> dict:
    assert reply.status == status, (reply.status, reply.body)
    assert reply.header("content-length") == str(len(reply.body))
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if error_type is not None:
        assert body["error"]["type"] == error_type
    assert reply.header("x-request-id") is not None
    return body["error"]


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshot(tiny_snapshot) -> Path:
    return tiny_snapshot("llama")


@pytest.fixture(scope="module")
def expected(snapshot) -> dict[int, dict]:
    """The canonical sequence's answers through the ASGI path (``ForwardPath``) of an
    identically built node, in-process: position -> answer body."""
    runtime = build_runtime(settings_for(snapshot), route_provider=no_route)
    answers = {}
    with TestClient(create_app(runtime)) as client:
        for position in (0, *range(3, LAST + 1)):
            head, body = canonical("reference", position)
            resp = client.post("/v1/forward", content=body, headers=head)
            assert resp.status_code == 200, resp.text
            assert set(resp.json()) == TOKEN_KEYS
            assert float(resp.headers[H_COMPUTE]) > 0
            answers[position] = resp.json()
    return answers


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def node(request, snapshot) -> Iterator[Served]:
    """The tail node under uvicorn, on uvloop (as ``serve`` runs it) and on asyncio."""
    with serving(snapshot, loop=request.param) as served:
        yield served


# Tests of what uvicorn's own protocol serves (or of plain request handling) run on uvloop
# only: uvicorn's protocol on the asyncio loop stalls about 40 ms an answer on loopback.
uvloop_only = pytest.mark.parametrize("node", ["uvloop"], indirect=True)


@pytest.fixture(scope="module")
def token_node(snapshot) -> Iterator[Served]:
    with serving(snapshot, swarm_token="s3cret") as served:
        yield served


def open_session(node: Served, sid: str, expected: dict, *, key: str = "key") -> None:
    with node.connect() as conn:
        assert_step(conn.request(step_request(sid, 0, key=key)), expected[0])
    assert node.sessions.peek(sid).length == 3


def scrape(node: Served) -> str:
    with node.connect() as conn:
        reply = conn.request(raw_request("GET", "/metrics"))
    assert reply.status == 200
    return reply.body.decode()


def metric(text: str, name: str, **labels) -> float:
    """One sample of a Prometheus exposition (labels in their exposition order); 0 if absent."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = "^" + re.escape(name + (f"{{{want}}}" if labels else "")) + r" (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


# -- 1. one step, byte for byte -------------------------------------------------------------


def test_forward_step_over_a_raw_socket_agrees_with_the_asgi_path(node, expected):
    sid = "raw-1"
    with node.connect() as conn:
        opened = conn.request(step_request(sid, 0, extra={"x-request-id": "open-0001"}))
        assert_step(opened, expected[0], request_id="open-0001")
        reply = conn.request(step_request(sid, 3, extra={"x-request-id": "step.3_A-b"}))
        body = assert_step(reply, expected[3], request_id="step.3_A-b")
        assert body["top_logprobs"] == expected[3]["top_logprobs"]
        # The answer is exactly: status line, the headers the data path writes, the JSON.
        assert (reply.status, reply.reason) == (200, "OK")
        assert [name for name, _ in reply.headers] == [
            "content-type", "content-length", "x-request-id", H_COMPUTE,
        ]  # fmt: skip
        # An id that is not a short printable token is replaced, not echoed.
        reply = conn.request(step_request(sid, 4, extra={"x-request-id": "not ok!"}))
        assert_step(reply, expected[4])
        assert reply.header("x-request-id") != "not ok!"
    assert node.sessions.peek(sid).length == 5
    # httpx (a real client: its own headers, keep-alive) gets the same answers.
    with httpx.Client(base_url=node.url, timeout=5.0) as client:
        for position in range(5, 8):
            head, frame_ = canonical(sid, position)
            resp = client.post("/v1/forward", content=frame_, headers=head)
            assert resp.status_code == 200, resp.text
            assert resp.json()["token_id"] == expected[position]["token_id"]
            assert float(resp.headers[H_COMPUTE]) > 0
            assert resp.http_version == "HTTP/1.1"
            assert "server" not in resp.headers and "date" not in resp.headers
        resp = client.delete(f"/v1/sessions/{sid}", headers={H_SESSION_KEY: "key"})
        assert resp.status_code == 200 and resp.json() == {"closed": sid}
    assert node.sessions.peek(sid) is None


# -- 2, 3. keep-alive and the hand-over to uvicorn ------------------------------------------


def test_keep_alive_then_hand_over_to_uvicorn_on_the_same_socket(node, expected):
    sid = "keep-1"
    with node.connect() as conn:
        for position in (0, 3, 4, 5):
            assert_step(conn.request(step_request(sid, position)), expected[position])
        health = conn.request(raw_request("GET", "/health"))
        assert health.status == 200
        body = health.json()
        assert body["status"] == "ok" and body["model_id"] == MODEL_ID
        assert (body["shard_start"], body["shard_end"]) == (4, 6)
        assert body["node_id"] == node.runtime.node_id
        assert health.header("server") is None and health.header("date") is None
        # The connection is uvicorn's now: forward steps go through ForwardPath.
        for position in (6, 7):
            reply = conn.request(step_request(sid, position, extra={"x-request-id": f"u-{position}"}))  # fmt: skip
            assert_step(reply, expected[position], request_id=f"u-{position}")
        info = conn.request(raw_request("GET", "/v1/node"))
        assert info.status == 200 and info.json()["num_layers"] == 6
        assert conn.request(delete_request(sid)).json() == {"closed": sid}
    assert node.sessions.peek(sid) is None


@uvloop_only
def test_connection_that_starts_with_get_goes_to_uvicorn(node, expected):
    sid = "get-first"
    with node.connect() as conn:
        assert conn.request(raw_request("GET", "/health")).json()["status"] == "ok"
        for position in (0, 3, 4):
            assert_step(conn.request(step_request(sid, position)), expected[position])
        assert conn.request(delete_request(sid)).json() == {"closed": sid}
        assert_error(conn.request(delete_request(sid)), 404)


# -- 4. errors: the node and the session survive ----------------------------------------------


BAD_ON_A_KEPT_CONNECTION = {
    # name: (request given the session id, status, error type or None)
    "malformed frame": (
        lambda sid: raw_request("POST", "/v1/forward", step_head(sid, 3), b"not a tensor frame"),
        400, "invalid_request_error",
    ),
    "truncated frame": (
        lambda sid: raw_request("POST", "/v1/forward", step_head(sid, 3), frame(hidden(1))[:-3]),
        400, "invalid_request_error",
    ),
    "wrong content-type": (
        lambda sid: raw_request(
            "POST", "/v1/forward", {**step_head(sid, 3), "content-type": "text/plain"},
            frame(hidden(1, seed=3)),
        ),
        415, None,
    ),
    "missing session header": (
        lambda sid: raw_request(
            "POST", "/v1/forward",
            {k: v for k, v in step_head(sid, 3).items() if k != H_SESSION},
            frame(hidden(1, seed=3)),
        ),
        400, "invalid_request_error",
    ),
    "position behind": (
        lambda sid: raw_request("POST", "/v1/forward", step_head(sid, 0), frame(hidden(1))),
        409, None,
    ),
    "unknown session": (
        lambda sid: raw_request("POST", "/v1/forward", step_head("nobody", 3), frame(hidden(1))),
        404, None,
    ),
    "GET /v1/forward": (lambda sid: raw_request("GET", "/v1/forward"), 405, None),
    "PUT /v1/forward": (lambda sid: raw_request("PUT", "/v1/forward", {}, b"x"), 405, None),
}  # fmt: skip


@uvloop_only
@pytest.mark.parametrize("case", BAD_ON_A_KEPT_CONNECTION)
def test_error_keeps_the_connection_and_the_session(node, expected, case):
    make, status, error_type = BAD_ON_A_KEPT_CONNECTION[case]
    sid = "err-" + "".join(c if c.isalnum() else "-" for c in case)
    open_session(node, sid, expected)
    with node.connect() as conn:
        reply = conn.request(make(sid))
        error = assert_error(reply, status, error_type)
        if case == "wrong content-type":
            assert error["param"] == "content-type"
        if status == 405:  # not a data-path request: uvicorn, then ForwardPath, answer it
            assert reply.header("allow") == "POST"
        assert node.sessions.peek(sid).length == 3
        # The same connection still carries the next good step, at the right position.
        assert_step(conn.request(step_request(sid, 3)), expected[3])
        assert conn.request(delete_request(sid)).json() == {"closed": sid}


def test_declared_body_over_the_limit_is_413_and_closes(node, expected):
    sid = "too-big"
    open_session(node, sid, expected)
    head = {**step_head(sid, 3), "content-length": str(LIMIT + 1), "x-request-id": "big-1"}
    with node.connect() as conn:
        conn.send(raw_request("POST", "/v1/forward", head))  # the head only: never read
        reply = conn.reply()
        assert "limit" in assert_error(reply, 413)["message"]
        assert reply.header("x-request-id") == "big-1"
        assert reply.header("connection") == "close"
        assert conn.buf == b""  # nothing follows the answer
        assert conn.closed_within(2.0) is not None
    # Chunked, no content-length: refused once the bytes read pass the limit.
    with node.connect() as conn:
        chunked = {**step_head(sid, 3), "transfer-encoding": "chunked"}
        part = b"\x00" * 3000
        conn.send(raw_request("POST", "/v1/forward", chunked) + b"%x\r\n%s\r\n" % (len(part), part) * 2)  # fmt: skip
        assert_error(conn.reply(), 413)
        assert conn.closed_within(2.0) is not None
    assert node.sessions.peek(sid).length == 3
    with node.connect() as conn:
        assert_step(conn.request(step_request(sid, 3)), expected[3])
        assert conn.request(delete_request(sid)).json() == {"closed": sid}


GARBAGE = {
    "bad request line": b"POST /v1/forward \x00\x01\x02garbage\r\n\r\n",
    "bad version": b"POST /v1/forward HTTP/9.Z\r\nhost: x\r\n\r\n",
    "header without a colon": b"POST /v1/forward HTTP/1.1\r\nhost x\r\n\r\n",
    "bad content-length": b"POST /v1/forward HTTP/1.1\r\ncontent-length: ten\r\n\r\n",
    "bad chunk size": (
        b"POST /v1/forward HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nxx\r\n"
    ),
    "upgrade": (
        b"POST /v1/forward HTTP/1.1\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
        b"content-length: 0\r\n\r\n"
    ),
}


@pytest.mark.parametrize("case", GARBAGE)
def test_garbage_that_starts_like_a_step_is_400_and_closes(node, expected, case):
    sid = "garbage-" + "".join(c if c.isalnum() else "-" for c in case)
    open_session(node, sid, expected)
    with node.connect() as conn:
        conn.send(GARBAGE[case])
        assert_error(conn.reply(), 400, "invalid_request_error")
        assert conn.closed_within(2.0) is not None
    assert node.sessions.peek(sid).length == 3
    with node.connect() as conn:
        assert_step(conn.request(step_request(sid, 3)), expected[3])
        assert conn.request(delete_request(sid)).json() == {"closed": sid}


@uvloop_only
def test_connection_close_and_http10_are_honoured(node, expected):
    sid = "closing"
    open_session(node, sid, expected)
    with node.connect() as conn:
        reply = conn.request(step_request(sid, 3, extra={"connection": "close"}))
        assert_step(reply, expected[3])
        assert reply.header("connection") == "close"
        assert conn.closed_within(2.0) is not None
    with node.connect() as conn:
        reply = conn.request(step_request(sid, 4).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        assert_step(reply, expected[4])  # answered, then closed (no keep-alive in 1.0)
        assert reply.header("connection") == "close"
        assert conn.closed_within(2.0) is not None
        assert node.sessions.peek(sid).length == 5
    with node.connect() as conn:
        assert conn.request(delete_request(sid)).json() == {"closed": sid}


# -- 5. closing sessions ---------------------------------------------------------------------


@uvloop_only
def test_delete_session_over_the_data_path(node, expected):
    sid = "del-1"
    open_session(node, sid, expected, key="owner")
    with node.connect() as conn:
        assert_error(conn.request(delete_request(sid, key="intruder")), 404)
        assert_error(conn.request(raw_request("DELETE", f"/v1/sessions/{sid}")), 404)  # no key
        assert node.sessions.peek(sid).length == 3
        reply = conn.request(delete_request(sid, key="owner", extra={"x-request-id": "del-1"}))
        assert reply.status == 200 and reply.json() == {"closed": sid}
        assert reply.header("x-request-id") == "del-1"
        assert reply.header("content-length") == str(len(reply.body))
        assert node.sessions.peek(sid) is None
        assert_error(conn.request(delete_request(sid, key="owner")), 404, "not_found_error")
        for bad in ("..", "a.b", "a%2Fb", "s" * 129, "a/b"):
            error = assert_error(conn.request(delete_request(bad)), 400, "invalid_request_error")
            assert error["param"] == "session_id"
        # Still a data-path connection in good order: a step after all of that.
        assert_step(conn.request(step_request("del-2", 0)), expected[0])
        assert conn.request(delete_request("del-2")).json() == {"closed": "del-2"}


# -- 6. the swarm token ------------------------------------------------------------------------


def test_swarm_token_is_checked_on_the_data_path(token_node, expected):
    assert token_node.app.state.swarm_token == "s3cret"
    sid = "tok-1"
    token = {H_SWARM_TOKEN: "s3cret"}
    with token_node.connect() as conn:
        for offered in ({}, {H_SWARM_TOKEN: "wrong"}, {H_SWARM_TOKEN: ""}):
            reply = conn.request(step_request(sid, 0, extra=offered))
            error = assert_error(reply, 401, "authentication_error")
            assert error["code"] == "invalid_api_key"
            assert reply.header("www-authenticate") == "Bearer"
            assert token_node.sessions.peek(sid) is None  # nothing ran
        assert_step(conn.request(step_request(sid, 0, extra=token)), expected[0])
        assert_step(conn.request(step_request(sid, 3, extra=token)), expected[3])
        reply = conn.request(delete_request(sid))
        assert_error(reply, 401, "authentication_error")
        assert reply.header("www-authenticate") == "Bearer"
        assert token_node.sessions.peek(sid).length == 4
        assert conn.request(delete_request(sid, extra=token)).json() == {"closed": sid}
    # The routes uvicorn serves check it too (AuthMiddleware); /health stays open.
    with token_node.connect() as conn:
        assert conn.request(raw_request("GET", "/health")).status == 200
        reply = conn.request(raw_request("GET", "/v1/node"))
        assert_error(reply, 401, "authentication_error")
        assert reply.header("www-authenticate") == "Bearer"
        reply = conn.request(step_request("tok-2", 0))  # after the hand-over: ForwardPath
        assert_error(reply, 401)
        assert reply.header("www-authenticate") == "Bearer"
        assert_step(conn.request(step_request("tok-2", 0, extra=token)), expected[0])
        assert conn.request(delete_request("tok-2", extra=token)).json() == {"closed": "tok-2"}


# -- 7. pipelining -----------------------------------------------------------------------------


def test_pipelined_request_is_not_answered_and_the_connection_closes(node, expected):
    sid = "pipe-1"
    with node.connect() as conn:
        conn.send(step_request(sid, 0) + step_request(sid, 3))  # one write, two requests
        first = conn.reply()
        assert_step(first, expected[0])
        assert first.header("connection") == "close"
        assert conn.closed_within(2.0) is not None  # and the second is never answered
    assert node.sessions.peek(sid).length == 3  # the second step did not run
    with node.connect() as conn:
        assert_step(conn.request(step_request(sid, 3)), expected[3])
        assert conn.request(delete_request(sid)).json() == {"closed": sid}


# -- 8. requests split into tiny writes --------------------------------------------------------


def test_request_sent_a_byte_at_a_time_is_answered(node, expected):
    sid = "dribble"
    with node.connect() as conn:
        data = step_request(sid, 0)
        line = data.index(b"\r\n") + 2
        conn.dribble(data[:line])  # the request line, one byte a write
        conn.send(data[line:])
        assert_step(conn.reply(), expected[0])
        conn.dribble(step_request(sid, 3), pause=0.0005)  # head and body, byte by byte
        assert_step(conn.reply(), expected[3])
        # Split right before the space that makes it ours.
        data = step_request(sid, 4)
        conn.send(data[:16])
        time.sleep(0.02)
        conn.send(data[16:])
        assert_step(conn.reply(), expected[4])
        # A chunked body, in pieces.
        head, body = canonical(sid, 5)
        conn.send(raw_request("POST", "/v1/forward", {**head, "transfer-encoding": "chunked"}))
        for piece in (body[:7], body[7:100], body[100:]):
            time.sleep(0.01)
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        conn.send(b"0\r\n\r\n")
        assert_step(conn.reply(), expected[5])
        data = delete_request(sid)
        conn.send(data[:4])
        time.sleep(0.02)
        conn.send(data[4:])
        assert conn.reply().json() == {"closed": sid}


@uvloop_only
@pytest.mark.parametrize(
    ("parts", "status"),
    [
        ((b"POST /v1/forward", b"X HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"), 404),
        ((b"POST /v1/forw", b"ard/x HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"), 404),
        ((b"DELE", b"TE /v1/node HTTP/1.1\r\nhost: x\r\n\r\n"), 405),
        ((b"DELETE /v1/sess", b"ion HTTP/1.1\r\nhost: x\r\n\r\n"), 404),
        ((b"P", b"OST /health HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"), 405),
        ((b"G", b"ET /health HTTP/1.1\r\nhost: x\r\n\r\n"), 200),
    ],
)
def test_partial_start_that_is_not_ours_goes_to_uvicorn(node, expected, parts, status):
    with node.connect() as conn:
        for part in parts:
            conn.send(part)
            time.sleep(0.02)
        reply = conn.reply()
        if status == 200:
            assert reply.status == 200 and reply.json()["status"] == "ok"
        else:
            assert_error(reply, status)
        # uvicorn's connection now, still alive: a step on it is served by ForwardPath.
        sid = "partial-" + re.sub(rb"[^A-Za-z0-9]", b"-", parts[0] + parts[1][:6]).decode()
        assert_step(conn.request(step_request(sid, 0)), expected[0])
        assert conn.request(delete_request(sid)).json() == {"closed": sid}


# -- 9. metrics ---------------------------------------------------------------------------------


@uvloop_only
def test_metrics_count_data_path_steps_and_wire_bytes(node, expected):
    forward, sessions = "/v1/forward", "/v1/sessions/{session_id}"
    requests, wire, errors = (
        "meshnet_requests_total", "meshnet_wire_received_bytes_total", "meshnet_errors_total",
    )  # fmt: skip
    before = scrape(node)
    sid = "metrics-1"
    sent = 0
    with node.connect() as conn:
        for position in (0, 3, 4, 5, 6):
            _, body = canonical(sid, position)
            sent += len(body)
            assert_step(conn.request(step_request(sid, position)), expected[position])
        bad = raw_request("POST", "/v1/forward", step_head(sid, 7), b"junk")
        sent += 4
        assert assert_error(conn.request(bad), 400)["code"] == "bad_frame"
        assert conn.request(delete_request(sid)).json() == {"closed": sid}
    after = scrape(node)

    def grew(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew(requests, path=forward, status="200") == 5
    assert grew(requests, path=forward, status="400") == 1
    assert grew(requests, path=sessions, status="200") == 1
    assert grew(errors, code="bad_frame", status="400") == 1
    assert metric(after, wire) > 0 and grew(wire) == sent
    # Steps on a connection handed to uvicorn (ForwardPath) count under the same labels.
    with node.connect() as conn:
        assert conn.request(raw_request("GET", "/health")).status == 200
        assert_step(conn.request(step_request("metrics-2", 0)), expected[0])
        assert conn.request(delete_request("metrics-2")).json() == {"closed": "metrics-2"}
    assert metric(scrape(node), requests, path=forward, status="200") == metric(after, requests, path=forward, status="200") + 1  # fmt: skip


# -- 10, 11. idle timeout and graceful shutdown ---------------------------------------------


def test_idle_connections_are_closed_after_the_keep_alive_timeout(snapshot, expected):
    with serving(snapshot, timeout_keep_alive=0.5) as node:
        conns = [node.connect() for _ in range(4)]
        fresh, stepped, partial, handed = conns
        try:
            partial.send(b"POST /v1/")  # could still become a step: buffered
            assert handed.request(raw_request("GET", "/health")).status == 200  # uvicorn's
            # Each answer restarts the clock: a connection stepping now and then is kept.
            for position in (0, 3, 4):
                if position:
                    time.sleep(0.35)
                assert_step(stepped.request(step_request("idle", position)), expected[position])
            # ... and closed about 0.5 s after its last answer.
            after = stepped.closed_within(3.0)
            assert after is not None and 0.3 <= after <= 1.5, after
            for conn in (fresh, partial, handed):  # idle since the start
                assert conn.closed_within(0.5) is not None, "the idle connection stayed open"
        finally:
            for conn in conns:
                conn.sock.close()


def test_graceful_shutdown_with_idle_connections_does_not_hang(snapshot, expected):
    with serving(snapshot) as node:
        conns = [node.connect() for _ in range(4)]
        fresh, stepped, partial, handed = conns
        try:
            assert_step(stepped.request(step_request("bye", 0)), expected[0])
            partial.send(b"DELETE /v1/se")
            assert handed.request(raw_request("GET", "/health")).status == 200
            took = node.stop(timeout=5.0)
            assert not node.thread.is_alive(), "uvicorn hung on shutdown"
            assert took < 3.0, took
            for conn in conns:
                assert conn.closed_within(1.0) is not None
        finally:
            for conn in conns:
                conn.sock.close()


def test_graceful_shutdown_with_a_half_sent_request_head_does_not_hang(snapshot):
    with serving(snapshot) as node, node.connect() as stalled:
        stalled.send(b"POST /v1/forward HTTP/1.1\r\nhost: x\r\n")  # and nothing more
        time.sleep(0.05)
        node.stop(timeout=1.0)
        assert not node.thread.is_alive(), "uvicorn hung on shutdown"


def test_expect_100_continue_is_answered(token_node, expected):
    token = {H_SWARM_TOKEN: "s3cret"}
    head, body = canonical("expect-1", 0)
    with token_node.connect() as conn:
        conn.send(raw_request("POST", "/v1/forward", {**head, **token, "expect": "100-continue",
                                                      "content-length": str(len(body))}))  # fmt: skip
        conn.sock.settimeout(0.3)
        try:
            interim = conn.sock.recv(65536)
        except TimeoutError:
            interim = b""
        finally:
            conn.sock.settimeout(5.0)
        conn.send(body)  # whatever came back, the step itself is then answered
        assert_step(conn.reply(), expected[0])
        assert conn.request(delete_request("expect-1", extra=token)).json() == {
            "closed": "expect-1"
        }
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), interim

"""A request head must arrive within the deadline (docs/adr/0032): slowloris connections
are closed, while long bodies, long streamed answers and WebSockets are not cut. Real servers
started by meshnet's ``serve.run`` (its uvicorn limits included) on 127.0.0.1, both of
uvicorn's HTTP parsers, raw sockets."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
from fastapi import FastAPI, WebSocket
from fastapi.responses import StreamingResponse

from meshnet_common.web import head_deadline, serve

DEADLINE_S = 0.5
PROTOCOLS = [head_deadline.H11HeadDeadline]
if head_deadline.HttpToolsProtocol is not None:
    PROTOCOLS.append(head_deadline.HttpToolsHeadDeadline)


def app() -> FastAPI:
    api = FastAPI()

    @api.get("/ok")
    def ok():
        return {"ok": True}

    @api.post("/early")
    def early():  # answers without reading the request's body
        return {"early": True}

    @api.get("/slow")
    async def slow():
        async def chunks():
            for _ in range(6):  # 3x the deadline
                await asyncio.sleep(DEADLINE_S / 2)
                yield b"x"

        return StreamingResponse(chunks())

    @api.websocket("/ws")
    async def echo(ws: WebSocket):
        await ws.accept()
        await ws.send_text(await ws.receive_text())
        await ws.close()

    return api


@pytest.fixture(params=PROTOCOLS, ids=lambda cls: cls.__name__)
def server(request, monkeypatch):
    monkeypatch.setattr(head_deadline, "HEAD_TIMEOUT_S", DEADLINE_S)
    monkeypatch.setattr(head_deadline, "protocol_class", lambda: request.param)
    api, sock, started = app(), serve.bind("127.0.0.1", 0), threading.Event()
    port = serve.bound_port(sock)
    thread = threading.Thread(
        target=serve.run, args=(api, sock, None), daemon=True,
        kwargs={"on_started": started.set},
    )  # fmt: skip
    thread.start()
    assert started.wait(10), "server did not start"
    yield port
    api.state.request_exit(0)
    thread.join(timeout=10)


def closed_within(sock: socket.socket, limit_s: float) -> bytes:
    """What the server sent before closing; fails if it has not closed within ``limit_s``."""
    sock.settimeout(limit_s)
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    return got


def test_a_head_trickling_in_is_cut_off(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
        assert closed_within(sock, 10) == b""


def test_a_connection_that_sends_nothing_is_closed(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        assert closed_within(sock, 10) == b""


def test_a_kept_alive_connection_gets_the_deadline_again(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        assert b"200 OK" in sock.recv(4096)
        sock.sendall(b"GET /ok HTTP/1.1\r\n")  # the next head stalls halfway
        assert closed_within(sock, 10) == b""


def test_an_unread_body_then_a_stalled_head_is_cut_off(server):
    """The answer went out before its body came: the rest of the body and the next head
    count against the deadline (h11 armed no deadline here before)."""
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")
        sock.settimeout(10)
        assert b"200 OK" in sock.recv(4096)
        sock.sendall(b"body")
        sock.sendall(b"GET /ok HTTP/1.1\r\n")
        assert closed_within(sock, 10) == b""


def test_requests_and_long_streamed_answers_are_not_cut(server):
    base = f"http://127.0.0.1:{server}"
    with httpx.Client(timeout=10) as client:
        assert client.get(f"{base}/ok").json() == {"ok": True}
        resp = client.get(f"{base}/slow")  # lasts 1.5 s, three deadlines
        assert resp.status_code == 200 and resp.content == b"x" * 6
        assert client.get(f"{base}/ok").status_code == 200  # the same connection, again


def test_a_pipelined_long_answer_is_not_cut(server):
    """The second request's head came with the first; its answer streams past the deadline
    (httptools armed the deadline over it before)."""
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        got = closed_within(sock, 10)  # closed once idle past the deadline
    assert got.count(b"200 OK") == 2 and got.endswith(b"1\r\nx\r\n0\r\n\r\n")


def test_a_websocket_is_not_timed_after_the_upgrade(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")  # fmt: skip
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 101")
        threading.Event().wait(3 * DEADLINE_S)  # silent, three deadlines long
        mask = b"\x01\x02\x03\x04"
        sock.sendall(b"\x81\x82" + mask + bytes(b ^ mask[i] for i, b in enumerate(b"hi")))
        assert sock.recv(4096).startswith(b"\x81\x02hi")  # echoed: still open

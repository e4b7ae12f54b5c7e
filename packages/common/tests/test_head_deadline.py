"""A request head must arrive within the deadline (docs/adr/0032): slowloris connections
are closed, while long bodies and long streamed answers are not cut. Real uvicorn servers on
127.0.0.1, both of its HTTP parsers, raw sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from meshnet_common.web import head_deadline
from meshnet_common.web.serve import free_port

DEADLINE_S = 0.5
PROTOCOLS = [head_deadline.H11HeadDeadline]
if head_deadline.HttpToolsProtocol is not None:
    PROTOCOLS.append(head_deadline.HttpToolsHeadDeadline)


def app() -> FastAPI:
    api = FastAPI()

    @api.get("/ok")
    def ok():
        return {"ok": True}

    @api.get("/slow")
    async def slow():
        async def chunks():
            for _ in range(6):  # 3x the deadline
                await asyncio.sleep(DEADLINE_S / 2)
                yield b"x"

        return StreamingResponse(chunks())

    return api


@pytest.fixture(params=PROTOCOLS, ids=lambda cls: cls.__name__)
def server(request, monkeypatch):
    monkeypatch.setattr(head_deadline, "HEAD_TIMEOUT_S", DEADLINE_S)
    port = free_port()
    config = uvicorn.Config(app(), host="127.0.0.1", port=port, http=request.param,
                            log_level="warning", timeout_keep_alive=30)  # fmt: skip
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield port
    srv.should_exit = True
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


def test_requests_and_long_streamed_answers_are_not_cut(server):
    base = f"http://127.0.0.1:{server}"
    with httpx.Client(timeout=10) as client:
        assert client.get(f"{base}/ok").json() == {"ok": True}
        resp = client.get(f"{base}/slow")  # lasts 1.5 s, three deadlines
        assert resp.status_code == 200 and resp.content == b"x" * 6
        assert client.get(f"{base}/ok").status_code == 200  # the same connection, again

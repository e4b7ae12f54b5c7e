"""What a listening process accepts from its connections (issue #52, docs/adr/0032): only
requests for its own names (DNS rebinding: 421 otherwise), request bodies within a deadline
(408), a bounded number of connections per client address (503 past it), and room in its
open-file limit. The tracker's app stands for both services (``install_access``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from meshnet_common.web import serve
from meshnet_tracker.app import create_app
from meshnet_tracker.settings import TrackerSettings


@pytest.fixture
def tracker() -> TestClient:
    settings = TrackerSettings(models_dir=None, allowed_hosts=("tracker.lan",))
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8080", "127.0.0.1:8080", "[::1]:8080", "192.168.1.5:8080",
             "TRACKER.lan.:8080", "testserver"],
)  # fmt: skip
def test_loopback_addresses_and_configured_names_are_served(tracker, host):
    assert tracker.get("/health", headers={"host": host}).status_code == 200


@pytest.mark.parametrize(
    "host",
    [
        "rebind.attacker.example",
        "rebind.attacker.example:8080",
        "localhost.attacker.example",
        "tracker.lan.attacker.example",
    ],
)
def test_another_host_name_is_answered_421(tracker, host):
    resp = tracker.post("/v1/completions", json={"model": "m", "prompt": "hi"},
                        headers={"host": host})  # fmt: skip
    assert resp.status_code == 421, resp.text
    assert resp.json()["error"]["code"] == "host_not_allowed"


def test_the_advertised_name_is_served():
    settings = TrackerSettings(models_dir=None, advertise_url="http://mesh.example:8080")
    with TestClient(create_app(settings)) as client:
        assert client.get("/health", headers={"host": "mesh.example:8080"}).status_code == 200
        assert client.get("/health", headers={"host": "other.example"}).status_code == 421


def test_a_body_trickling_past_its_deadline_is_answered_408():
    app = create_app(TrackerSettings(models_dir=None, body_timeout_s=0.2))
    sent: list[dict] = []
    reads = 0

    async def receive():
        nonlocal reads
        reads += 1
        if reads == 1:  # the first byte of the body, then nothing more
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8080),
        "headers": [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json")],
    }  # fmt: skip
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 408
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert json.loads(body)["error"]["message"].startswith("the request body did not arrive")
    assert reads == 2  # the request waited for the rest once, and no more


@pytest.fixture
def capped_server() -> int:
    api = FastAPI()

    @api.get("/ok")
    def ok():
        return {"ok": True}

    api.state.connections_per_address = 2
    sock, started = serve.bind("127.0.0.1", 0), threading.Event()
    port = serve.bound_port(sock)
    thread = threading.Thread(
        target=serve.run, args=(api, sock, None), daemon=True, kwargs={"on_started": started.set}
    )
    thread.start()
    assert started.wait(10), "server did not start"
    yield port
    api.state.request_exit(0)
    thread.join(timeout=10)


def _ask(conn: socket.socket) -> bytes:
    conn.sendall(b"GET /ok HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    return conn.recv(4096)


def test_one_address_holds_at_most_its_cap_of_connections(capped_server):
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(socket.create_connection(("127.0.0.1", capped_server), 5))
                for _ in range(2)]  # fmt: skip
        for conn in held:
            assert _ask(conn).startswith(b"HTTP/1.1 200")
        third = stack.enter_context(socket.create_connection(("127.0.0.1", capped_server), 5))
        third.settimeout(5)
        refused = b""
        while chunk := third.recv(4096):  # answered, then closed by the server
            refused += chunk
        assert refused.startswith(b"HTTP/1.1 503") and b"too_many_connections" in refused
        held.pop().close()
    for _ in range(3):  # the slot comes back once a connection closes
        with socket.create_connection(("127.0.0.1", capped_server), 5) as conn:
            if _ask(conn).startswith(b"HTTP/1.1 200"):
                break
    else:
        pytest.fail("a connection freed no slot")


def test_the_open_file_limit_is_raised_toward_the_hard_limit():
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256 if hard == resource.RLIM_INFINITY else min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        want = serve.FD_LIMIT if hard == resource.RLIM_INFINITY else min(serve.FD_LIMIT, hard)
        assert serve.raise_fd_limit() == want
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == want
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

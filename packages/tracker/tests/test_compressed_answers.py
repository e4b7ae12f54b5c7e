"""The tracker reads no compressed answer (issue #52, docs/adr/0032): its registration
call-back and its proxy to a head ask for identity bytes and refuse a zstd bomb (4 KiB
that decodes to 128 MiB) at its head; a head's whole answer is read under a limit. Real
sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest
from answering_port import AnsweringPort, http_reply
from fastapi.testclient import TestClient
from starlette.requests import Request
from test_callback_bounds import TOKEN, announcement

from meshnet_common.errors import HopError
from meshnet_tracker import heads
from meshnet_tracker.api import admission
from meshnet_tracker.app import create_app
from meshnet_tracker.settings import TrackerSettings

BOMB_BYTES = 128 << 20


def zstd_bomb(extra_head: bytes = b"") -> bytes:
    zstandard = pytest.importorskip("zstandard")
    compressor = zstandard.ZstdCompressor(level=19).compressobj()
    zeros = b"\0" * (1 << 20)
    body = b"".join(compressor.compress(zeros) for _ in range(BOMB_BYTES >> 20))
    body += compressor.flush()
    head = b"HTTP/1.1 200 OK\r\ncontent-encoding: zstd\r\n%scontent-length: %d\r\n\r\n"
    return head % (extra_head, len(body)) + body


def test_the_registration_call_back_asks_for_identity_and_refuses_a_bomb(monkeypatch):
    monkeypatch.setattr(admission, "CALLBACK_BACKOFF_S", 0.0)
    settings = TrackerSettings(models_dir=None, swarm_token="swarm-1")
    with AnsweringPort(zstd_bomb()) as port, TestClient(create_app(settings)) as tracker:
        resp = tracker.post("/v1/nodes/register", json=announcement("n", port.url), headers=TOKEN)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "node_unreachable"
    assert port.requests and all("accept-encoding: identity" in r for r in port.requests)


def _client_request() -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "client": ("127.0.0.1", 5000), "query_string": b""}  # fmt: skip
    return Request(scope)


def _proxy(reply: bytes, **settings) -> tuple[bytes | Exception, list[str]]:
    async def call(url: str):
        app = create_app(TrackerSettings(models_dir=None, **settings))
        client = app.state.tracker.client
        try:
            resp = await heads.RemoteHead(client, url).answer(
                "/v1/completions", _client_request(), (), b"{}"
            )
            return resp.body
        except HopError as exc:
            return exc
        finally:
            await client.aclose()

    with AnsweringPort(reply) as port:
        return asyncio.run(call(port.url)), port.requests


def test_the_proxy_to_a_head_refuses_a_bomb():
    answer, requests = _proxy(zstd_bomb(b"content-type: application/json\r\n"))
    assert isinstance(answer, HopError) and "zstd" in str(answer), answer
    assert "accept-encoding: identity" in requests[0]


def test_the_proxy_reads_a_whole_answer_under_its_limit(monkeypatch):
    monkeypatch.setattr(heads, "ANSWER_LIMIT", 4096)
    answer, _ = _proxy(http_reply(b'{"x": "' + b"y" * 8192 + b'"}'))
    assert isinstance(answer, HopError), answer
    assert _proxy(http_reply(b'{"ok": true}'))[0] == b'{"ok": true}'

"""Swarm clients read answers as sent, under a limit (issue #52, docs/adr/0032): a 4 KiB
zstd answer that decodes to 128 MiB is refused at its head, before one byte of it is read
or decoded; an identity answer past the limit is refused as it arrives. Real sockets on
127.0.0.1 (``AnsweringPort``)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from answering_port import AnsweringPort, http_reply

from meshnet_common.web import swarm_client
from meshnet_common.web.swarm_client import AnswerRefused, limit

BOMB_BYTES = 128 << 20


def zstd_bomb() -> bytes:
    """An HTTP answer of ~4 KiB whose body decodes to 128 MiB of zeros."""
    zstandard = pytest.importorskip("zstandard")
    compressor = zstandard.ZstdCompressor(level=19).compressobj()
    zeros = b"\0" * (1 << 20)
    body = b"".join(compressor.compress(zeros) for _ in range(BOMB_BYTES >> 20))
    body += compressor.flush()
    assert len(body) < 8192
    head = b"HTTP/1.1 200 OK\r\ncontent-encoding: zstd\r\ncontent-length: %d\r\n\r\n"
    return head % len(body) + body


def test_a_zstd_bomb_is_refused_before_its_body_is_read():
    with AnsweringPort(zstd_bomb()) as port, swarm_client.swarm_client() as client:
        refused = pytest.raises(AnswerRefused, match="content-encoding 'zstd'")
        with refused, client.stream("GET", f"{port.url}/health"):
            pytest.fail("the answer's head must be refused")  # pragma: no cover
        with pytest.raises(AnswerRefused):
            client.get(f"{port.url}/v1/coverage")
    assert all("accept-encoding: identity" in head for head in port.requests), port.requests


def test_the_async_client_refuses_the_bomb_too():
    async def call() -> None:
        async with swarm_client.swarm_async_client() as client:
            await client.get(f"{port.url}/health")

    with AnsweringPort(zstd_bomb()) as port, pytest.raises(AnswerRefused, match="zstd"):
        asyncio.run(call())
    assert "accept-encoding: identity" in port.requests[0]


def test_a_one_shot_call_refuses_it():
    with AnsweringPort(zstd_bomb()) as port, pytest.raises(AnswerRefused):
        swarm_client.get(f"{port.url}/health")


def test_an_answer_past_the_limit_is_refused_as_it_arrives():
    body = b"x" * (1 << 20)
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    chunked += b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in [body[:4096]] * 256) + b"0\r\n\r\n"
    with AnsweringPort(chunked) as port, swarm_client.swarm_client(max_bytes=64 << 10) as client:
        read = 0
        refused = pytest.raises(AnswerRefused, match="more than 65536 bytes")
        with refused, client.stream("GET", port.url) as resp:
            for chunk in resp.iter_raw():
                read += len(chunk)
        assert read <= 64 << 10
        # one call's own limit: this one may take the whole megabyte
        assert len(client.get(port.url, extensions=limit(2 << 20)).content) == len(body)
    refused = pytest.raises(AnswerRefused, match="announced an answer of 1048576 bytes")
    with AnsweringPort(http_reply(body)) as port:
        small = swarm_client.swarm_client(max_bytes=4096)
        with small, refused:  # refused at the head: content-length is over the limit
            small.get(port.url)


def test_refusals_are_http_errors_the_callers_already_handle():
    assert issubclass(AnswerRefused, httpx.HTTPError)

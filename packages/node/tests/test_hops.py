"""Http11Hops, the data-path client, against real servers on loopback.

Most tests talk to a raw ``asyncio.start_server`` whose every byte the test controls (so it
can count connections, drop them, stall or answer garbage); a few talk to a real uvicorn
server in a thread, the kind of server a hop really is.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import pytest
import uvicorn

from meshnet_node.dataplane.hop_client import HopResponse, HopUnreachable, Http11Hops

TOKEN = {"x-meshnet-swarm-token": "s3cret-token"}
HOST = "127.0.0.1"  # every server here listens on loopback only


def make_hops(**kwargs) -> Http11Hops:
    return Http11Hops(headers=dict(TOKEN), connect_timeout=5.0, **kwargs)


# --- a raw HTTP/1.1 server the test controls byte for byte ----------------------------------


@dataclass
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]  # as received, in order, names as sent
    body: bytes
    conn: int  # which accepted connection (0, 1, ...) carried it

    def header(self, name: str) -> str | None:
        found = [v for k, v in self.headers if k.lower() == name.lower()]
        assert len(found) <= 1, f"header {name} sent {len(found)} times"
        return found[0] if found else None


async def read_request(reader: asyncio.StreamReader, conn: int) -> Request | None:
    """One request off the connection; None at a clean end of stream (the client closed)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        assert exc.partial == b"", f"the client sent half a request head: {exc.partial!r}"
        return None
    except ConnectionResetError:
        return None
    lines = head[:-4].decode("latin-1").split("\r\n")
    method, target, version = lines[0].split(" ")
    assert version == "HTTP/1.1"
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        assert sep, f"malformed header line {line!r}"
        headers.append((name, value.strip()))
    lengths = [v for k, v in headers if k.lower() == "content-length"]
    assert len(lengths) == 1, "every request carries exactly one content-length"
    body = await reader.readexactly(int(lengths[0]))
    return Request(method, target, headers, body, conn)


def answer(status: int = 200, body: bytes = b"", headers: tuple[str, ...] = ()) -> bytes:
    head = f"HTTP/1.1 {status} Whatever\r\ncontent-length: {len(body)}\r\n"
    return (head + "".join(f"{h}\r\n" for h in headers) + "\r\n").encode("latin-1") + body


# handler(request, reader, writer) -> False to close the connection (server side) after it
Handler = Callable[[Request, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool | None]]


async def echo_ok(req: Request, reader, writer) -> None:
    writer.write(answer(200, b"ok " + req.target.encode()))


class RawServer:
    def __init__(self, handler: Handler = echo_ok, *, drop_at_accept: bool = False) -> None:
        self.handler = handler
        self.drop_at_accept = drop_at_accept
        self.connections = 0
        self.requests: list[Request] = []
        self.eof: list[asyncio.Event] = []  # per connection: the client closed its side
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        await self._server.wait_closed()
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        index = self.connections
        self.connections += 1
        self.eof.append(asyncio.Event())
        self._writers.append(writer)
        try:
            if self.drop_at_accept:
                return
            while True:
                req = await read_request(reader, index)
                if req is None:
                    self.eof[index].set()
                    return
                self.requests.append(req)
                if await self.handler(req, reader, writer) is False:
                    return
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.eof[index].set()
        except asyncio.CancelledError:
            pass  # our own __aexit__ stops a handler still waiting (not an error to log)
        finally:
            writer.close()
            self._tasks.discard(asyncio.current_task())


async def wait_for(event: asyncio.Event, timeout: float = 2.0) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        return False
    return True


# --- 1. the request as sent, the answer as returned ------------------------------------------


def test_post_sends_exact_request_and_returns_exact_answer() -> None:
    body = bytes(range(256)) * 4 + b"\r\n\r\n\x00"  # binary, with CRLFs and NULs inside
    reply = bytes(reversed(range(256))) + b"\r\n0\r\n\r\n"

    async def handler(req, reader, writer) -> None:
        writer.write(answer(201, reply, ("content-type: application/octet-stream",)))

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            try:
                resp = await hops.request(
                    "POST",
                    f"{server.url}/v1/forward?a=1&b=x%20y",
                    headers={"content-type": "application/x-meshnet", "X-Trace-Id": "t-42"},
                    body=body,
                    timeout=5.0,
                )
            finally:
                await hops.aclose()
            assert type(resp) is HopResponse
            assert resp == HopResponse(201, reply)
            assert resp.status == 201 and resp.body == reply
            [req] = server.requests
            assert req.method == "POST"
            assert req.target == "/v1/forward?a=1&b=x%20y"
            assert req.body == body
            assert req.headers == [
                ("host", f"{HOST}:{server.port}"),
                ("content-length", str(len(body))),
                ("x-meshnet-swarm-token", "s3cret-token"),
                ("content-type", "application/x-meshnet"),
                ("X-Trace-Id", "t-42"),
            ]

    asyncio.run(run())


def test_error_statuses_are_answers_not_failures() -> None:
    async def handler(req, reader, writer) -> None:
        status = int(req.target.strip("/"))
        writer.write(answer(status, f'{{"error": {status}}}'.encode()))

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            for status in (404, 409, 500, 503):
                resp = await hops.request(
                    "POST", f"{server.url}/{status}", headers={}, body=b"x", timeout=5.0
                )
                assert resp == HopResponse(status, f'{{"error": {status}}}'.encode())
            assert server.connections == 1  # error answers keep the connection alive too
            await hops.aclose()

    asyncio.run(run())


def test_path_defaults_to_slash() -> None:
    async def run() -> None:
        async with RawServer() as server:
            hops = make_hops()
            resp = await hops.request("GET", server.url, headers={}, body=None, timeout=5.0)
            assert resp == HopResponse(200, b"ok /")
            await hops.aclose()

    asyncio.run(run())


# --- 2, 3. keep-alive ------------------------------------------------------------------------


def test_sequential_requests_reuse_one_connection() -> None:
    async def run() -> None:
        async with RawServer() as server:
            hops = make_hops()
            for i in range(10):
                resp = await hops.request(
                    "POST", f"{server.url}/r{i}", headers={}, body=b"%d" % i, timeout=5.0
                )
                assert resp == HopResponse(200, f"ok /r{i}".encode())
            assert server.connections == 1
            assert [r.conn for r in server.requests] == [0] * 10
            await hops.aclose()

    asyncio.run(run())


def test_connection_idle_too_long_is_not_reused() -> None:
    """A pooled connection idle past ``max_idle_s`` may be being closed by the hop right now:
    the next request opens a new one instead of racing that close."""

    async def run() -> None:
        async with RawServer() as server:
            hops = make_hops()
            await hops.request("POST", server.url, headers={}, body=b"a", timeout=5.0)
            hops.max_idle_s = 0.05
            await asyncio.sleep(0.1)
            await hops.request("POST", server.url, headers={}, body=b"b", timeout=5.0)
            assert server.connections == 2
            assert [r.conn for r in server.requests] == [0, 1]
            await hops.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(
    "close_answer",
    [
        answer(200, b"bye", ("Connection: close",)),
        answer(200, b"bye", ("connection: Close",)),
        b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\nbye",  # 1.0 without keep-alive
    ],
    ids=["connection-close", "lowercase", "http-1.0"],
)
def test_connection_close_answer_is_not_reused(close_answer: bytes) -> None:
    async def handler(req, reader, writer) -> None:
        # The server keeps its side open: only the client can decide not to reuse it.
        writer.write(close_answer)

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            for _ in range(3):
                resp = await hops.request("GET", server.url, headers={}, body=None, timeout=5.0)
                assert resp == HopResponse(200, b"bye")
                # the client closed that connection itself, right after the answer
                assert await wait_for(server.eof[-1], 1.0)
            assert server.connections == 3
            assert [r.conn for r in server.requests] == [0, 1, 2]
            await hops.aclose()

    asyncio.run(run())


# --- 4, 5. framing: chunked answers, large bodies, fragmented answers -----------------------


def chunked(parts: list[bytes], trailer: str = "") -> bytes:
    out = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"]
    for part in parts:
        out += [b"%x;ext=1\r\n" % len(part), part, b"\r\n"]
    return b"".join(out) + b"0\r\n" + trailer.encode() + b"\r\n"


def test_chunked_answer_is_dechunked_and_connection_kept() -> None:
    parts = [b"hello ", b"", b"\r\n0\r\n", bytes(range(256)), b"x" * 70_000]
    parts = [p for p in parts if p]  # an empty chunk would end the body

    async def handler(req, reader, writer) -> None:
        if req.target == "/trailer":
            writer.write(chunked([b"abc", b"def"], trailer="x-checksum: 1\r\n"))
        else:
            writer.write(chunked(parts))

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            resp = await hops.request("GET", server.url, headers={}, body=None, timeout=5.0)
            assert resp == HopResponse(200, b"".join(parts))
            resp = await hops.request(
                "GET", f"{server.url}/trailer", headers={}, body=None, timeout=5.0
            )
            assert resp == HopResponse(200, b"abcdef")
            assert server.connections == 1  # a chunked answer leaves the connection in step
            await hops.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("size", [0, 65535, 65536, 1 << 20], ids=str)
def test_large_bodies_arrive_intact(size: int) -> None:
    """Bodies under 64 KiB go out in one write with the head, larger ones by writelines."""
    out = bytes((i * 7 + 3) % 251 for i in range(size))
    back = out[::-1] + b"tail" * 1000

    async def handler(req, reader, writer) -> None:
        assert req.body == out
        if req.target == "/chunked":
            writer.write(chunked([back[i : i + 100_000] for i in range(0, len(back), 100_000)]))
        else:
            writer.write(answer(200, back))

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            for path in ("/plain", "/chunked", "/plain"):
                resp = await hops.request(
                    "PUT", server.url + path, headers={}, body=out, timeout=5.0
                )
                assert resp == HopResponse(200, back)
            assert [len(r.body) for r in server.requests] == [size] * 3
            assert server.connections == 1
            await hops.aclose()

    asyncio.run(run())


def test_answer_in_tiny_fragments() -> None:
    async def handler(req, reader, writer) -> None:
        for byte in chunked([b"frag", b"mented"]):
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0)

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            for _ in range(2):
                resp = await hops.request("GET", server.url, headers={}, body=None, timeout=5.0)
                assert resp == HopResponse(200, b"fragmented")
            assert server.connections == 1
            await hops.aclose()

    asyncio.run(run())


def test_status_without_body() -> None:
    async def handler(req, reader, writer) -> None:
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            for _ in range(2):
                resp = await hops.request("DELETE", server.url, headers={}, body=None, timeout=5.0)
                assert resp == HopResponse(204, b"")
            assert server.connections == 1
            await hops.aclose()

    asyncio.run(run())


# --- 6, 7, 8. dropped and refused connections -------------------------------------------------


def test_idle_connection_closed_by_server_is_replaced() -> None:
    """The hop closes a kept-alive connection while it sits idle in the pool."""

    async def handler(req, reader, writer) -> bool:
        writer.write(answer(200, b"once"))  # keep-alive, yet the server closes right after
        return False

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            for i in range(3):
                resp = await hops.request("GET", server.url, headers={}, body=None, timeout=5.0)
                assert resp == HopResponse(200, b"once")
                assert server.connections == i + 1
                await asyncio.sleep(0.02)  # the client sees the close while the conn is idle
            assert [r.conn for r in server.requests] == [0, 1, 2]
            await hops.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
def test_request_on_a_connection_the_hop_just_dropped_is_sent_again(reset: bool) -> None:
    """The race: the client reuses a pooled connection that the hop closes as the request
    arrives, with no byte of answer. The request goes again on a fresh connection."""

    async def handler(req, reader, writer) -> bool | None:
        if req.conn == 0 and req.target == "/second":
            if reset:
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
            return False  # close without a byte of answer
        writer.write(answer(200, b"ok " + req.target.encode()))
        return None

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            first = await hops.request(
                "GET", f"{server.url}/first", headers={}, body=None, timeout=5.0
            )
            assert first == HopResponse(200, b"ok /first")
            second = await hops.request(
                "POST", f"{server.url}/second", headers={"x-n": "2"}, body=b"data", timeout=5.0
            )
            assert second == HopResponse(200, b"ok /second")
            assert server.connections == 2
            assert [(r.conn, r.target, r.body) for r in server.requests] == [
                (0, "/first", b""),
                (0, "/second", b"data"),
                (1, "/second", b"data"),
            ]
            await hops.aclose()

    asyncio.run(run())


def test_fresh_connection_closed_without_answer_is_unreachable() -> None:
    async def run() -> None:
        for drop_at_accept in (True, False):

            async def handler(req, reader, writer) -> bool:
                return False  # read the request, close without answering

            async with RawServer(handler, drop_at_accept=drop_at_accept) as server:
                hops = make_hops()
                started = time.perf_counter()
                with pytest.raises(HopUnreachable, match="closed the connection"):
                    await hops.request("POST", server.url, headers={}, body=b"x", timeout=5.0)
                assert time.perf_counter() - started < 1.0  # no waiting out the timeout
                assert server.connections == 1  # a fresh connection is not tried again
                assert len(server.requests) == (0 if drop_at_accept else 1)
                await hops.aclose()

    asyncio.run(run())


def test_retry_after_stale_pooled_connection_is_bounded() -> None:
    """A reused connection dropped silently is retried once, on a fresh one; when the fresh
    one is dropped too the request fails instead of looping."""

    async def handler(req, reader, writer) -> bool | None:
        if req.target == "/drop":
            return False
        writer.write(answer(200, b"ok"))
        return None

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            assert await hops.request("GET", server.url, headers={}, body=None, timeout=5.0)
            with pytest.raises(HopUnreachable):
                await hops.request("GET", f"{server.url}/drop", headers={}, body=None, timeout=5.0)
            assert server.connections == 2
            assert [(r.conn, r.target) for r in server.requests] == [
                (0, "/"),
                (0, "/drop"),
                (1, "/drop"),
            ]
            # and the client still works afterwards
            resp = await hops.request("GET", server.url, headers={}, body=None, timeout=5.0)
            assert resp == HopResponse(200, b"ok")
            await hops.aclose()

    asyncio.run(run())


def test_connection_refused_is_unreachable() -> None:
    # A socket bound to a loopback port but not listening: connecting to it is refused, and
    # no other process can take the port while the test holds it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]

        async def run() -> None:
            hops = make_hops()
            started = time.perf_counter()
            with pytest.raises(HopUnreachable, match=f"cannot connect to {HOST}:{port}"):
                await hops.request(
                    "POST", f"http://{HOST}:{port}/v1/forward", headers={}, body=b"x", timeout=5.0
                )
            assert time.perf_counter() - started < 1.0
            await hops.aclose()

        asyncio.run(run())


# --- 9, 10, 11. timeouts, garbage, oversized answers -----------------------------------------


def test_timeout_is_unreachable_and_the_connection_is_dropped() -> None:
    async def handler(req, reader, writer) -> None:
        if req.target == "/slow":
            await asyncio.sleep(0.6)  # past the client's timeout, then a late answer
            writer.write(answer(200, b"late"))
        else:
            writer.write(answer(200, b"fast"))

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            url = server.url
            assert await hops.request("GET", f"{url}/fast", headers={}, body=None, timeout=5.0)
            started = time.perf_counter()
            with pytest.raises(HopUnreachable, match="TimeoutError"):
                await hops.request("GET", f"{url}/slow", headers={}, body=None, timeout=0.3)
            elapsed = time.perf_counter() - started
            assert 0.28 <= elapsed < 0.9, elapsed
            # Had the timed-out connection gone back to the pool, this would read "late".
            resp = await hops.request("GET", f"{url}/fast", headers={}, body=None, timeout=5.0)
            assert resp == HopResponse(200, b"fast")
            assert server.connections == 2
            assert [(r.conn, r.target) for r in server.requests] == [
                (0, "/fast"),
                (0, "/slow"),
                (1, "/fast"),
            ]
            assert await wait_for(server.eof[0])  # the client closed the timed-out connection
            await hops.aclose()

    asyncio.run(run())


def test_timeout_on_a_fresh_connection() -> None:
    async def handler(req, reader, writer) -> None:
        await asyncio.sleep(10)

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            started = time.perf_counter()
            with pytest.raises(HopUnreachable, match="no answer within 0.2s"):
                await hops.request("POST", server.url, headers={}, body=b"x", timeout=0.2)
            assert 0.18 <= time.perf_counter() - started < 0.9
            assert len(server.requests) == 1  # sent once, not again after the timeout
            await hops.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(
    "garbage",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"HTTP/1.1 abc Broken\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"\x00\xff" * 50,
    ],
    ids=["text", "status", "length", "chunk-size", "binary"],
)
def test_malformed_answer_is_unreachable(garbage: bytes) -> None:
    async def handler(req, reader, writer) -> None:
        if req.target == "/good":
            writer.write(answer(200, b"good"))
        else:
            writer.write(garbage)

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            url = server.url
            assert await hops.request("GET", f"{url}/good", headers={}, body=None, timeout=5.0)
            started = time.perf_counter()
            with pytest.raises(HopUnreachable, match="bad HTTP answer"):
                await hops.request("GET", f"{url}/bad", headers={}, body=None, timeout=5.0)
            assert time.perf_counter() - started < 1.0
            # not sent again (the hop did answer, badly), and the connection is dropped
            assert [(r.conn, r.target) for r in server.requests] == [(0, "/good"), (0, "/bad")]
            resp = await hops.request("GET", f"{url}/good", headers={}, body=None, timeout=5.0)
            assert resp == HopResponse(200, b"good")
            assert server.connections == 2
            await hops.aclose()

    asyncio.run(run())


def test_answer_over_max_body_is_unreachable() -> None:
    async def handler(req, reader, writer) -> None:
        size = int(req.target.split("/")[-1])
        body = b"z" * size
        if req.target.startswith("/chunked"):
            writer.write(chunked([body[i : i + 300] for i in range(0, size, 300)]))
        else:
            writer.write(answer(200, body))

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops(max_body=1000)
            url = server.url
            for kind in ("plain", "chunked"):
                ok = await hops.request(
                    "GET", f"{url}/{kind}/1000", headers={}, body=None, timeout=5.0
                )
                assert ok == HopResponse(200, b"z" * 1000)  # the limit itself is allowed
                for size in (1001, 5000, 1 << 20):
                    # (the message reads "bad HTTP answer: `on_body` callback error": the
                    # "exceeds 1000 bytes" reason is lost inside httptools' own error)
                    with pytest.raises(HopUnreachable, match="bad HTTP answer"):
                        await hops.request(
                            "GET", f"{url}/{kind}/{size}", headers={}, body=None, timeout=5.0
                        )
            # each refusal dropped its connection; the client still works
            ok = await hops.request("GET", f"{url}/plain/10", headers={}, body=None, timeout=5.0)
            assert ok == HopResponse(200, b"z" * 10)
            assert len(server.requests) == 9  # none of the refusals was sent twice
            await hops.aclose()

    asyncio.run(run())


# --- 12. header injection --------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {"x-evil": "a\r\nx-injected: 1"},
        {"x-evil": "a\nb"},
        {"x-evil": "a\rb"},
        {"x-evil": "a\0b"},
        {"x-evil\r\nx-injected": "1"},
    ],
    ids=["crlf-value", "lf-value", "cr-value", "nul-value", "crlf-name"],
)
def test_header_injection_is_refused_before_sending(headers: dict[str, str]) -> None:
    async def run() -> None:
        async with RawServer() as server:
            hops = make_hops()
            # a fresh client: not even a connection is opened
            with pytest.raises(HopUnreachable, match="line break"):
                await hops.request("POST", server.url, headers=headers, body=b"x", timeout=5.0)
            await asyncio.sleep(0.05)
            assert server.connections == 0
            # with a pooled connection: nothing reaches it, and it stays usable and in step
            assert await hops.request("GET", f"{server.url}/a", headers={}, body=None, timeout=5.0)
            with pytest.raises(HopUnreachable, match="line break"):
                await hops.request("POST", server.url, headers=headers, body=b"x", timeout=5.0)
            resp = await hops.request("GET", f"{server.url}/b", headers={}, body=None, timeout=5.0)
            assert resp == HopResponse(200, b"ok /b")
            assert [(r.conn, r.target) for r in server.requests] == [(0, "/a"), (0, "/b")]
            assert all(r.header("x-injected") is None for r in server.requests)
            await hops.aclose()

    asyncio.run(run())


def test_header_injection_in_default_headers_is_refused() -> None:
    with pytest.raises(HopUnreachable, match="line break"):
        Http11Hops(headers={"x-meshnet-swarm-token": "t\r\nx-injected: 1"}, connect_timeout=1.0)


# --- 13. DELETE without a body ---------------------------------------------------------------


def test_delete_without_body_sends_content_length_zero() -> None:
    async def handler(req, reader, writer) -> None:
        writer.write(answer(200, b'{"closed": true}'))

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            for _ in range(2):
                resp = await hops.request(
                    "DELETE",
                    f"{server.url}/v1/sessions/s-1",
                    headers={"x-meshnet-session-key": "k"},
                    body=None,
                    timeout=5.0,
                )
                assert resp == HopResponse(200, b'{"closed": true}')
            for req in server.requests:
                assert req.method == "DELETE"
                assert req.target == "/v1/sessions/s-1"
                assert req.header("content-length") == "0"
                assert req.header("x-meshnet-session-key") == "k"
                assert req.header("x-meshnet-swarm-token") == "s3cret-token"
                assert req.body == b""
            assert server.connections == 1
            await hops.aclose()

    asyncio.run(run())


# --- 14, 15. closing the pool, concurrency ---------------------------------------------------


def test_aclose_closes_pooled_connections() -> None:
    async def run() -> None:
        async with RawServer() as server:
            hops = make_hops()
            for _ in range(2):
                assert await hops.request("GET", server.url, headers={}, body=None, timeout=5.0)
            assert server.connections == 1
            assert not server.eof[0].is_set()  # kept alive while pooled
            await hops.aclose()
            assert await wait_for(server.eof[0])
            # a closed client can still be used: it opens a new connection
            assert await hops.request("GET", server.url, headers={}, body=None, timeout=5.0)
            assert server.connections == 2
            await hops.aclose()
            assert await wait_for(server.eof[1])

    asyncio.run(run())


def test_concurrent_requests_each_get_their_own_answer() -> None:
    async def handler(req, reader, writer) -> None:
        n = int(req.header("x-request-id"))
        await asyncio.sleep((n * 7 % 5) * 0.005)  # answers come back out of order
        writer.write(answer(200, f"answer-{n}:".encode() + req.body))

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()

            async def one(n: int) -> HopResponse:
                return await hops.request(
                    "POST",
                    f"{server.url}/v1/forward",
                    headers={"x-request-id": str(n)},
                    body=b"%d" % n * (n + 1),
                    timeout=5.0,
                )

            for wave in range(2):
                results = await asyncio.gather(*(one(n) for n in range(20)))
                for n, resp in enumerate(results):
                    assert resp == HopResponse(200, f"answer-{n}:".encode() + b"%d" % n * (n + 1))
                # one connection per concurrent request; the second wave reuses all of them
                assert server.connections == 20
                assert len(server.requests) == 20 * (wave + 1)
            await hops.aclose()
            for event in server.eof:
                assert await wait_for(event)

    asyncio.run(run())


# --- against a real uvicorn server -------------------------------------------------------------


async def asgi_app(scope, receive, send) -> None:
    assert scope["type"] == "http"
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = dict(scope["headers"])
    if scope["path"] == "/stream":  # no content-length: uvicorn answers chunked
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"one,", b"two,", b"x" * 100_000, b"three"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    meta = (
        f"{scope['method']} {scope['path']}?{scope['query_string'].decode()} "
        f"{scope['client'][1]} {headers.get(b'x-meshnet-swarm-token', b'').decode()} "
        f"{headers.get(b'x-trace', b'').decode()}\n"
    ).encode()
    out = meta + body
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(out)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def uvicorn_url() -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    config = uvicorn.Config(
        asgi_app,
        lifespan="off",
        loop="asyncio",
        http="httptools",
        log_config=None,
        log_level="warning",
        access_log=False,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5.0
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://{HOST}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(5.0)
        sock.close()


def parse_echo(resp: HopResponse) -> tuple[list[str], bytes]:
    assert resp.status == 200
    meta, _, body = resp.body.partition(b"\n")
    return meta.decode().split(" "), body


def test_uvicorn_echo_keep_alive_and_large_bodies(uvicorn_url: str) -> None:
    big = bytes((i * 13) % 256 for i in range(1 << 20))

    async def run() -> None:
        hops = make_hops()
        ports = set()
        try:
            for i, body in enumerate([b"\x00\x01binary\r\n", big, b"", big[:70_000]]):
                resp = await hops.request(
                    "POST",
                    f"{uvicorn_url}/v1/forward?step={i}",
                    headers={"x-trace": f"t{i}"},
                    body=body,
                    timeout=5.0,
                )
                meta, echoed = parse_echo(resp)
                method, path, port, token, trace = meta
                assert (method, path, token, trace) == (
                    "POST",
                    f"/v1/forward?step={i}",
                    "s3cret-token",
                    f"t{i}",
                )
                assert echoed == body
                ports.add(port)
            stream = await hops.request(
                "GET", f"{uvicorn_url}/stream", headers={}, body=None, timeout=5.0
            )
            assert stream == HopResponse(200, b"one,two," + b"x" * 100_000 + b"three")
            resp = await hops.request(
                "DELETE", f"{uvicorn_url}/v1/sessions/s", headers={}, body=None, timeout=5.0
            )
            meta, echoed = parse_echo(resp)
            assert meta[0] == "DELETE" and echoed == b""
            ports.add(meta[2])
            assert len(ports) == 1  # every request, the chunked one included, on one connection
        finally:
            await hops.aclose()

    asyncio.run(run())


def test_uvicorn_concurrent_and_across_event_loops(uvicorn_url: str) -> None:
    hops = make_hops()  # one client used from two event loops, one after the other

    async def wave() -> set[str]:
        results = await asyncio.gather(
            *(
                hops.request(
                    "POST",
                    f"{uvicorn_url}/n{n}",
                    headers={"x-trace": str(n)},
                    body=b"b%d" % n,
                    timeout=5.0,
                )
                for n in range(20)
            )
        )
        ports = set()
        for n, resp in enumerate(results):
            meta, body = parse_echo(resp)
            assert meta[1] == f"/n{n}?" and meta[4] == str(n) and body == b"b%d" % n
            ports.add(meta[2])
        return ports

    async def first() -> set[str]:
        return await wave()  # the pool keeps these connections; this loop then ends

    async def second() -> set[str]:
        try:
            return await wave()
        finally:
            await hops.aclose()

    assert len(asyncio.run(first())) == 20
    assert len(asyncio.run(second())) == 20


# --- framing corners of HTTP/1.1 -------------------------------------------------------------


def test_answer_delimited_by_connection_close() -> None:
    async def handler(req, reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nbody until close")
        return False

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            resp = await hops.request("GET", server.url, headers={}, body=None, timeout=5.0)
            assert resp == HopResponse(200, b"body until close")
            await hops.aclose()

    asyncio.run(run())


def test_interim_1xx_answer_is_skipped() -> None:
    async def handler(req, reader, writer) -> None:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(200, b"final"))

    async def run() -> None:
        async with RawServer(handler) as server:
            hops = make_hops()
            resp = await hops.request("POST", server.url, headers={}, body=b"x", timeout=5.0)
            assert resp == HopResponse(200, b"final")
            await hops.aclose()

    asyncio.run(run())

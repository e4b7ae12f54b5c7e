"""The HTTP client a node uses to reach the next hop of a route (the data path).

Every decode step crosses each hop once, so the client's own cost is paid per token per
hop. ``Http11Hops`` is a lean HTTP/1.1 client over pooled keep-alive connections: about a
fifth of the Python per request of aiohttp, which itself costs a third of httpx
(docs/adr/0010, 0011). aiohttp carries ``https://`` hops. (In-process tests swap in
``tests/inprocess_hops.HttpxHops``, the same contract over an httpx transport.)
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import NamedTuple, Protocol
from urllib.parse import urlsplit

import aiohttp
import httptools

from meshnet_common.config import defaults
from meshnet_common.protocol import H_COMPUTE


class HopResponse(NamedTuple):
    status: int
    body: bytes
    compute_ms: str | None = None  # the x-meshnet-compute-ms header of a step's answer


class HopUnreachable(Exception):
    """The hop could not be reached, dropped the connection, or did not answer in time."""


class HopTransport(Protocol):
    async def request(
        self, method: str, url: str, *, headers: dict[str, str], body: bytes | None, timeout: float
    ) -> HopResponse: ...

    async def aclose(self) -> None: ...


class AiohttpHops:
    """Keep-alive connections to the next hops; one aiohttp session per event loop."""

    def __init__(self, *, headers: dict[str, str], connect_timeout: float) -> None:
        self.headers = headers
        self.connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session is bound to the loop that made it (tests run several loops).
            self._loop = loop
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                connector=aiohttp.TCPConnector(limit=128, limit_per_host=64),
                auto_decompress=False,
            )
        return self._session

    async def request(
        self, method: str, url: str, *, headers: dict[str, str], body: bytes | None, timeout: float
    ) -> HopResponse:
        limits = aiohttp.ClientTimeout(total=timeout, sock_connect=self.connect_timeout)
        try:
            async with self._client().request(
                method, url, data=body, headers=headers, timeout=limits
            ) as resp:
                body = await resp.read()
                return HopResponse(resp.status, body, resp.headers.get(H_COMPUTE))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise HopUnreachable(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed and self._loop is asyncio.get_running_loop():
            await session.close()


_COMPUTE = H_COMPUTE.encode()


class _HopClientConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a hop; one request at a time."""

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.answer: asyncio.Future | None = None
        self._parser = None
        self._body: list[bytes] = []
        self._size = 0
        self.received = 0  # bytes of the current answer so far (0: the hop never answered)
        self.keep_alive = False
        self.idle_since = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small frames must leave now, not after Nagle's delay
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def begin(self) -> asyncio.Future:
        self.answer = asyncio.get_running_loop().create_future()
        if self._parser is None:  # one parser per connection: it reads answer after answer
            self._parser = httptools.HttpResponseParser(self)
        self._body, self._size, self.received = [], 0, 0
        self._framed = False  # content-length or chunked: else the body ends with the connection
        self._compute: str | None = None
        self._headers_done = False
        self._error: str | None = None
        return self.answer

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == _COMPUTE:
            self._compute = value.decode("latin-1")
        elif name in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True

    def on_body(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self.max_body:
            self._error = f"answer exceeds {self.max_body} bytes"
            raise _TooLarge(self._error)
        self._body.append(data)

    def on_message_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # An interim answer (100 Continue, 103 Early Hints): the real one follows.
            self._body, self._size, self._framed, self._headers_done = [], 0, False, False
            self._compute = None
            return
        self.keep_alive = parser.should_keep_alive()
        self._resolve(status)

    def _resolve(self, status: int) -> None:
        if self.answer is not None and not self.answer.done():
            body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
            self.answer.set_result(HopResponse(status, body, self._compute))

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self._parser is None or self.answer is None or self.answer.done():
            self.closed = True  # bytes nobody asked for: this connection is out of step
            if self.transport is not None:
                self.transport.close()
            return
        try:
            self._parser.feed_data(data)
        except Exception as exc:  # a malformed answer (or one over the limit)
            self.closed = True
            self.transport.close()
            if not self.answer.done():
                reason = self._error or str(exc)
                self.answer.set_exception(HopUnreachable(f"bad HTTP answer: {reason}"))

    def expire(self) -> None:
        """The request's deadline passed (a timer set by ``Http11Hops``)."""
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(_Expired())

    def eof_received(self):
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.answer is None or self.answer.done():
            return
        if exc is None and self._headers_done and not self._framed and self._error is None:
            # HTTP/1.1 lets an answer without length or chunking end with the connection.
            self.keep_alive = False
            self._resolve(self._parser.get_status_code())
            return
        reason = f"{type(exc).__name__}: {exc}" if exc else "connection closed"
        self.answer.set_exception(HopUnreachable(f"hop closed the connection ({reason})"))


class _TooLarge(Exception):
    pass


class _Expired(Exception):
    pass


class Http11Hops:
    """A lean HTTP/1.1 client for the data path: pooled keep-alive connections, requests
    written in one ``write`` call, answers parsed by httptools (llhttp, in C).

    It does only what hops need (a byte body out, status and byte body back), which costs a
    fraction of a general client's per-request Python (docs/adr/0011). ``https://`` hops
    go through ``fallback`` (aiohttp, with TLS).
    """

    def __init__(
        self,
        *,
        headers: dict[str, str],
        connect_timeout: float,
        max_body: int = 256 << 20,
        max_idle_per_hop: int = 64,
        max_idle_s: float = defaults.POOL_MAX_IDLE_S,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle_s = max_idle_s  # a pooled connection idle longer is closed, not reused
        self.max_body = max_body
        self.max_idle_per_hop = max_idle_per_hop
        self._default = "".join(f"{_checked(k)}: {_checked(v)}\r\n" for k, v in headers.items())
        self.fallback = AiohttpHops(headers=headers, connect_timeout=connect_timeout)
        self._idle: dict[tuple[str, int], list[_HopClientConnection]] = {}
        self._targets: dict[str, tuple[str, int, str, str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _target(self, url: str) -> tuple[str, int, str, str] | None:
        """(host, port, Host header, path) of an http:// URL; None for https://."""
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme != "http":
                return None
            if not parts.hostname:
                raise HopUnreachable(f"no host in {url!r}")
            port = parts.port or 80
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            if any(c.isspace() for c in path):
                raise HopUnreachable(f"whitespace in the path of {url!r}")
            target = (parts.hostname, port, _checked(parts.netloc), _checked(path))
            if len(self._targets) < 4096:
                self._targets[url] = target
        return target

    def _pool(self, key: tuple[str, int]) -> list[_HopClientConnection]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # connections belong to the loop that made them
            self._loop = loop
            self._idle = {}
        return self._idle.setdefault(key, [])

    async def request(
        self, method: str, url: str, *, headers: dict[str, str], body: bytes | None, timeout: float
    ) -> HopResponse:
        target = self._target(url)
        if target is None:
            return await self.fallback.request(
                method, url, headers=headers, body=body, timeout=timeout
            )
        host, port, netloc, path = target
        body = body or b""
        try:
            head = (
                f"{method} {path} HTTP/1.1\r\nhost: {netloc}\r\ncontent-length: {len(body)}\r\n"
                + self._default
                + "".join(f"{_checked(k)}: {_checked(v)}\r\n" for k, v in headers.items())
                + "\r\n"
            ).encode("latin-1")
        except UnicodeEncodeError as exc:
            raise HopUnreachable(f"a header is not latin-1 text: {exc}") from exc
        message = head + body if len(body) < 65536 else None
        # A timer on the answer, not asyncio.timeout: less code on every step's path.
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            return await self._exchange(host, port, head, body, message, deadline)
        except (_Expired, TimeoutError) as exc:
            raise HopUnreachable(f"TimeoutError: no answer within {timeout:g}s") from exc

    async def _exchange(self, host, port, head, body, message, deadline) -> HopResponse:
        loop = asyncio.get_running_loop()
        pool = self._pool((host, port))
        while True:
            conn, reused = None, False
            now = time.monotonic()
            while pool and conn is None:
                candidate = pool.pop()
                if candidate.closed:
                    continue
                if now - candidate.idle_since > self.max_idle_s:
                    # The hop may be closing it right now (uvicorn: after 5 s): a request
                    # sent then would be lost. A new connection costs a fraction of a ms.
                    candidate.closed = True
                    candidate.transport.close()
                    continue
                conn, reused = candidate, True
            if conn is None:
                conn = await self._connect(host, port, deadline)
            answer = conn.begin()
            timer = loop.call_at(deadline, conn.expire)
            try:
                if message is not None:
                    conn.transport.write(message)
                else:
                    conn.transport.writelines((head, body))
                response = await answer
            except HopUnreachable:
                conn.closed = True
                conn.transport.close()
                # A kept-alive connection the hop had already closed: it never saw this
                # request, so send it again on a fresh one.
                if reused and conn.received == 0:
                    continue
                raise
            except BaseException:  # cancelled or timed out mid-answer: out of step now
                conn.closed = True
                conn.transport.close()
                raise
            finally:
                timer.cancel()
            if conn.keep_alive and not conn.closed and len(pool) < self.max_idle_per_hop:
                conn.answer = None
                conn.idle_since = time.monotonic()
                pool.append(conn)
            else:
                conn.transport.close()
            return response

    async def _connect(self, host: str, port: int, deadline: float) -> _HopClientConnection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(min(deadline, loop.time() + self.connect_timeout)):
                _, conn = await loop.create_connection(
                    lambda: _HopClientConnection(self.max_body), host, port
                )
        except (OSError, TimeoutError) as exc:
            raise HopUnreachable(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for pool in idle.values():
            for conn in pool:
                if conn.transport is not None:
                    conn.transport.close()
        await self.fallback.aclose()


def _checked(text: str) -> str:
    """A header name or value as sent: CR, LF or NUL would split the message."""
    if "\r" in text or "\n" in text or "\0" in text:
        raise HopUnreachable(f"refusing a header with a line break: {text[:40]!r}")
    return text

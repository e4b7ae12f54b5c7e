"""The client end of hop streams (docs/adr/0022): one persistent WebSocket to each next hop,
opened on first use, every session's steps multiplexed on it.

``StreamHops`` keeps the hop-client contract the data path was written against
(``request(method, url, ...) -> HopResponse``): a step (``POST /v1/forward``), a session
close (``DELETE /v1/sessions/{id}``) and a direct answer (``POST /v1/answers/{id}``) each
become one message on the stream to that URL's node, and its answer comes back on the same
stream, matched by request id. The WebSocket itself (handshake, framing, masking, pings,
close) is the ``websockets`` library's. In-process tests swap in
``tests/inprocess_hops.HttpxHops``, the same contract over an httpx transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import ssl as ssl_module
from typing import NamedTuple, Protocol
from urllib.parse import unquote, urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.frames import Opcode
from websockets.headers import build_host
from websockets.protocol import State
from websockets.uri import parse_uri

from meshnet_common.protocol import H_COMPUTE, H_SESSION
from meshnet_common.trust.identity import Identity
from meshnet_common.web.http import error_body
from meshnet_node.dataplane.frames import (
    H_MAX_MESSAGE,
    MAX_ANSWER_BYTES,
    STREAM_PATH,
    SUBPROTOCOL,
    FrameError,
    Kind,
    decode_answer,
    encode_request,
)
from meshnet_node.dataplane.lanes import H_LANE, H_LANE_DIRECT, parse_lane_header

logger = logging.getLogger(__name__)

_OVERHEAD = 64 << 10  # room for a message's header beyond its body, when checking the limit
_DIRECT_SEND = 64 << 10  # messages up to this size skip websockets' send() (see _Stream.call)


class HopResponse(NamedTuple):
    status: int
    body: bytes
    compute_ms: str | None = None  # the x-meshnet-compute-ms header of a step's answer


class HopUnreachable(Exception):
    """The hop could not be reached, its stream died, or it did not answer in time."""


class HopTransport(Protocol):
    async def request(
        self, method: str, url: str, *, headers: dict[str, str], body: bytes | None, timeout: float
    ) -> HopResponse: ...

    async def aclose(self) -> None: ...


class _Target(NamedTuple):
    stream_url: str  # ws:// or wss:// ... /v1/stream
    kind: Kind
    session: str | None


_ROUTES = (("POST", "/v1/forward", Kind.STEP), ("DELETE", "/v1/sessions/", Kind.CLOSE),
           ("POST", "/v1/answers/", Kind.DELIVER))  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _target(method: str, url: str) -> _Target:
    # Cached: a node sends every step to the same few URLs, and parsing one costs tens of
    # microseconds on a CPU whose caches the step's compute emptied (docs/adr/0011).
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise HopUnreachable(f"not an http(s) hop URL: {url[:80]!r}")
    for verb, route, kind in _ROUTES:
        at = parts.path.find(route)
        if verb == method and at >= 0:
            rest = parts.path[at + len(route) :]
            if (kind == Kind.STEP) == bool(rest):  # a step's path ends there; the others don't
                continue
            prefix = parts.path[:at]
            return _Target(f"{scheme}://{parts.netloc}{prefix}{STREAM_PATH}", kind,
                           unquote(rest) if rest else None)  # fmt: skip
    raise HopUnreachable(f"no hop-stream message for {method} {parts.path[:80]}")


def _too_large(size: int, limit: int) -> HopResponse:
    body = error_body(f"a message of {size} bytes exceeds the hop's limit of {limit}",
                      "invalid_request_error", code="payload_too_large")  # fmt: skip
    return HopResponse(413, json.dumps(body).encode())


class _HopConnection(ClientConnection):
    """websockets' client connection, handing each complete binary message straight to
    its stream as it is parsed (``process_event`` is the documented override point): an
    answer wakes the step that waits for it, with no reader task in between."""

    stream: _Stream | None = None

    def process_event(self, event) -> None:
        stream = self.stream
        if stream is not None and event.opcode is Opcode.BINARY and event.fin:
            stream.on_message(event.data)
        else:
            super().process_event(event)

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        if self.stream is not None:
            self.stream.on_closed()


class _Stream:
    """One open stream: requests out, answers matched back to them by id."""

    def __init__(self, ws: ClientConnection, url: str) -> None:
        self.ws = ws
        self.url = url
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 1
        try:
            self.max_message = int(ws.response.headers.get(H_MAX_MESSAGE, ""))
        except ValueError:
            self.max_message = None
        self.lane = parse_lane_header(ws.response.headers.get(H_LANE))  # (port, secret) offered
        self.lane_direct = ws.response.headers.get(H_LANE_DIRECT) == "1"  # ADR-0060
        self.closed: str | None = None  # why, once it is
        sock = ws.transport.get_extra_info("socket") if ws.transport else None
        if sock is not None:  # small frames must leave now, not after Nagle's delay
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ws.stream = self  # answers come to on_message from now on
        self.reader = asyncio.ensure_future(self._read())

    @property
    def usable(self) -> bool:
        return self.closed is None and self.ws.state is State.OPEN

    async def call(self, kind: Kind, headers: dict[str, str], body: bytes, timeout: float):
        loop = asyncio.get_running_loop()
        request_id = self.next_id
        self.next_id = request_id + 1 if request_id < 0xFFFFFFFF else 1
        answer = loop.create_future()
        self.pending[request_id] = answer
        timer = loop.call_later(timeout, _expire, answer, timeout)
        try:
            try:
                message = encode_request(kind, request_id, headers, body)
            except FrameError as exc:
                raise HopUnreachable(f"cannot send this request: {exc}") from exc
            try:
                ws = self.ws
                if (len(message) <= _DIRECT_SEND and ws.protocol.state is State.OPEN
                        and ws.transport.get_write_buffer_size() < _DIRECT_SEND):  # fmt: skip
                    # A small message straight through the sans-I/O protocol: one frame,
                    # written now; flow control cannot hold it (the buffer is near empty).
                    ws.protocol.send_binary(message)
                    ws.transport.writelines(ws.protocol.data_to_send())
                else:
                    await ws.send(message)
            except ConnectionClosed as exc:
                raise HopUnreachable(f"the stream to {self.url} closed ({_why(self.ws)})") from exc
            got = await answer
        finally:
            timer.cancel()
            self.pending.pop(request_id, None)
        return HopResponse(got.status, got.body, got.headers.get(H_COMPUTE))

    def on_message(self, data) -> None:
        """A binary message from the hop (called from the connection's data_received)."""
        try:
            got = decode_answer(bytes(data))
        except FrameError as exc:
            self._fail(f"malformed answer: {exc}", 1007, str(exc)[:120])
            return
        waiting = self.pending.get(got.id)
        if waiting is not None and not waiting.done():
            waiting.set_result(got)

    def on_closed(self) -> None:
        self._fail(_why(self.ws))

    def _fail(self, reason: str, code: int | None = None, text: str = "") -> None:
        """Fail every request in flight; close the stream with ``code`` (None: it closed)."""
        if self.closed is None:
            self.closed = reason
        if code is not None:
            self._closing = asyncio.ensure_future(self.ws.close(code, text))
        failure = HopUnreachable(f"the stream to {self.url} closed ({self.closed})")
        for waiting in self.pending.values():
            if not waiting.done():
                waiting.set_exception(failure)

    async def _read(self) -> None:
        """What does not take the fast path (``_HopConnection``): a text or fragmented
        message closes the stream; the end of the connection fails what is in flight."""
        try:
            async for data in self.ws:
                if isinstance(data, str):
                    self._fail("the hop sent a text message", 1003, "binary messages only")
                else:
                    self.on_message(data)
        except ConnectionClosed:
            pass
        except Exception as exc:  # never leave requests waiting on a reader that died
            self._fail(f"{type(exc).__name__}: {exc}", 1011, "client error")
            return
        self.on_closed()

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), 2.0)
        self.reader.cancel()


def _expire(answer: asyncio.Future, timeout: float) -> None:
    if not answer.done():
        answer.set_exception(HopUnreachable(f"TimeoutError: no answer within {timeout:g}s"))


def _why(ws: ClientConnection) -> str:
    code = ws.close_code
    if code is None or code == 1006:
        return "connection lost"
    return f"{code} {ws.close_reason or ''}".strip()


class StreamHops:
    """Persistent streams to the next hops; one per hop URL and event loop."""

    def __init__(
        self,
        *,
        headers: dict[str, str],
        connect_timeout: float,
        ping_interval: float | None = 20.0,
        max_answer: int = MAX_ANSWER_BYTES,
        ssl: ssl_module.SSLContext | None = None,
        https_only: bool = False,
        identity: Identity | None = None,
    ) -> None:
        self.headers = dict(headers)
        self.identity = identity  # signs each stream's handshake (docs/adr/0032)
        self.https_only = https_only  # this node serves TLS: no plain ws:// hop (ADR-0032)
        self.connect_timeout = connect_timeout
        self.ping_interval = ping_interval or None
        self.max_answer = max_answer
        self.ssl = ssl
        self._streams: dict[str, _Stream] = {}
        self._opening: dict[str, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def request(
        self, method: str, url: str, *, headers: dict[str, str], body: bytes | None, timeout: float
    ) -> HopResponse:
        target = _target(method, url)
        if self.https_only and not target.stream_url.startswith("wss:"):
            raise HopUnreachable(
                f"hop {url[:80]} is plain http://, but this node serves TLS (--tls-cert): "
                "it dials https:// peers only"
            )
        if target.session is not None:
            headers = {**headers, H_SESSION: target.session}
        body = body or b""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for _attempt in range(2):
            stream = await self._stream(target.stream_url, deadline)
            if isinstance(stream, HopResponse):
                return stream  # the hop refused the stream: its answer is this request's
            limit = stream.max_message
            if limit is not None and len(body) + _OVERHEAD > limit:
                return _too_large(len(body), limit)
            if not stream.usable:  # it closed since: this request never left
                self._forget(target.stream_url, stream)
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise HopUnreachable(f"TimeoutError: no answer within {timeout:g}s")
            return await stream.call(target.kind, headers, body, remaining)
        raise HopUnreachable(f"the stream to {target.stream_url} keeps closing")

    def lane_offer(self, hop: str) -> tuple[str, int, str] | None:
        """The decode lane ``hop``'s open stream offered: (host, port, secret), or None."""
        try:
            target = _target("POST", f"{hop.rstrip('/')}/v1/forward")
        except HopUnreachable:
            return None
        stream = self._streams.get(target.stream_url)
        if stream is None or stream.lane is None or not stream.usable:
            return None
        host = urlsplit(target.stream_url).hostname
        return (host, *stream.lane) if host else None

    def lane_direct(self, hop: str) -> bool:
        """Whether ``hop``'s lane (offered on its open stream) reads ``DIRECT`` steps."""
        offer = self.lane_offer(hop)
        if offer is None:
            return False
        stream = self._streams.get(_target("POST", f"{hop.rstrip('/')}/v1/forward").stream_url)
        return stream is not None and stream.lane_direct

    async def _stream(self, url: str, deadline: float) -> _Stream | HopResponse:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # streams belong to the loop that opened them
            self._loop, self._streams, self._opening = loop, {}, {}
        stream = self._streams.get(url)
        if stream is not None and stream.usable:
            return stream
        opening = self._opening.get(url)
        if opening is None:  # one handshake per hop, however many requests wait on it
            opening = loop.create_task(self._open(url))
            self._opening[url] = opening
            opening.add_done_callback(lambda _t: self._opening.pop(url, None))
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(opening)
        except TimeoutError as exc:
            raise HopUnreachable(f"TimeoutError: cannot open a stream to {url}") from exc

    def _handshake_headers(self, url: str) -> dict[str, str]:
        """The swarm token, and this node's signature of the handshake once certified."""
        if self.identity is None:
            return self.headers
        uri = parse_uri(url)
        host = build_host(uri.host, uri.port, uri.secure)
        return {**self.headers, **self.identity.headers("GET", host, uri.resource_name)}

    async def _open(self, url: str) -> _Stream | HopResponse:
        try:
            ws = await connect(
                url, create_connection=_HopConnection,
                additional_headers=self._handshake_headers(url), subprotocols=[SUBPROTOCOL],
                compression=None, proxy=None, user_agent_header=None,
                open_timeout=self.connect_timeout, ping_interval=self.ping_interval,
                ping_timeout=self.ping_interval, close_timeout=2.0, max_size=self.max_answer,
                max_queue=None, ssl=self.ssl if url.startswith("wss:") else None,
            )  # fmt: skip
        except InvalidStatus as exc:  # refused at the handshake (401, 404, ...): not cached
            return HopResponse(exc.response.status_code, bytes(exc.response.body or b""))
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            raise HopUnreachable(f"cannot open a stream to {url}: {reason}") from exc
        if ws.subprotocol != SUBPROTOCOL:
            await ws.close(1002, "wrong subprotocol")
            raise HopUnreachable(f"{url} does not speak {SUBPROTOCOL}")
        stream = _Stream(ws, url)
        self._streams[url] = stream
        return stream

    def _forget(self, url: str, stream: _Stream) -> None:
        if self._streams.get(url) is stream:
            del self._streams[url]

    async def aclose(self) -> None:
        streams, self._streams = self._streams, {}
        if self._loop is not asyncio.get_running_loop():
            return
        for task in self._opening.values():
            task.cancel()
        for stream in streams.values():
            await stream.aclose()

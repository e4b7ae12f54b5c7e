"""A deadline on request heads (docs/adr/0032): uvicorn has none. A connection must deliver a
complete request head within ``HEAD_TIMEOUT_S`` of opening, and of the end of its previous
response when kept alive; else it is closed. A client sending a head a byte at a time
(slowloris), or nothing at all, holds a connection that long at most. Bodies, streamed
answers and WebSockets after the upgrade are not timed here: once the head is in, the
deadline is off.

uvicorn's keep-alive timer is no such bound: any byte received cancels it. The protocol
classes below are uvicorn's own (0.55), with the deadline armed at ``connection_made`` and
once a response is complete (what the client still sends then, the rest of a body the app
did not read included, counts against it), and disarmed when the parser reports a complete
head: httptools' ``on_headers_complete``, h11's ``their_state`` leaving ``IDLE``. These
hooks (``handle_events``, ``on_response_complete``, ``conn``, ``pipeline``, ``loop``,
``transport``) are the only uvicorn internals this module relies on; uvicorn has no public
hook for it. ``MESHNET_HEAD_TIMEOUT_S`` sets the deadline (tests: ``HEAD_TIMEOUT_S``).

The same classes cap the connections one client address holds open at once (uvicorn's
``limit_concurrency`` counts all of them together): past ``per_address`` (set on uvicorn's
``Config`` by ``serve``; 0: no cap), a new connection is answered 503 and closed at once.
"""

from __future__ import annotations

import asyncio
import os

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn's faster parser, where installed ("auto" picks it)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools is optional
    HttpToolsProtocol = None

HEAD_TIMEOUT_S = float(os.environ.get("MESHNET_HEAD_TIMEOUT_S", "10"))
PER_ADDRESS = "meshnet_per_address"  # the attribute of uvicorn's Config holding the cap
_BUSY_BODY = (
    b'{"error": {"message": "too many connections from this address", '
    b'"type": "server_error", "param": null, "code": "too_many_connections"}}'
)
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


def over_cap(protocol) -> bool:
    """Whether ``protocol``'s connection (just made, already counted among the server's)
    makes its address hold more than the cap; then it is answered 503 and closed."""
    cap = getattr(protocol.config, PER_ADDRESS, 0)
    host = protocol.client[0] if protocol.client else None
    if not cap or host is None:
        return False
    held = sum(1 for c in protocol.server_state.connections if _host(c) == host)
    if held <= cap:
        return False
    protocol.transport.write(BUSY)
    protocol.transport.close()
    return True


def _host(connection) -> str | None:
    client = getattr(connection, "client", None)  # WebSocket protocols hold one too
    return client[0] if client else None


class HeadClock:
    """Closes a transport unless ``disarm`` comes within the deadline of ``arm``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self.loop, self.seconds = loop, seconds
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, transport: asyncio.BaseTransport) -> None:
        """Start the deadline unless it already runs (bytes arriving never extend it)."""
        if self._timer is None and not transport.is_closing():
            self._timer = self.loop.call_later(self.seconds, _close, transport)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _close(transport: asyncio.BaseTransport) -> None:
    if not transport.is_closing():
        transport.close()


class H11HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.head_clock = HeadClock(self.loop, HEAD_TIMEOUT_S)
        super().connection_made(transport)
        if not over_cap(self):
            self.head_clock.arm(transport)

    def _sync_head_clock(self) -> None:
        # Waiting for a head: none has begun (IDLE), or the answer is out (DONE) and what
        # still comes is the rest of its body, then the next head. h11 moves to IDLE after an
        # unread body's end only inside handle_events, hence this check after each call.
        if self.conn.their_state is h11.IDLE or self.conn.our_state is h11.DONE:
            self.head_clock.arm(self.transport)
        else:  # a head is in (or the connection failed)
            self.head_clock.disarm()

    def handle_events(self) -> None:
        super().handle_events()
        self._sync_head_clock()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_head_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self.head_clock.disarm()
        super().connection_lost(exc)


if HttpToolsProtocol is not None:

    class HttpToolsHeadDeadline(HttpToolsProtocol):
        """uvicorn's httptools protocol with a deadline on each request head."""

        def connection_made(self, transport) -> None:  # type: ignore[override]
            self.head_clock = HeadClock(self.loop, HEAD_TIMEOUT_S)
            super().connection_made(transport)
            if not over_cap(self):
                self.head_clock.arm(transport)

        def on_headers_complete(self) -> None:
            self.head_clock.disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            queued = bool(self.pipeline)  # a pipelined request, its head in, starts now
            super().on_response_complete()
            if not queued:
                self.head_clock.arm(self.transport)

        def connection_lost(self, exc: Exception | None) -> None:
            self.head_clock.disarm()
            super().connection_lost(exc)


def protocol_class() -> type[asyncio.Protocol]:
    """The class uvicorn's ``http="auto"`` would pick (httptools where installed), with the
    head deadline."""
    return H11HeadDeadline if HttpToolsProtocol is None else HttpToolsHeadDeadline

"""A node's decode lanes as its event loop sees them (docs/adr/0058): the listener it offers
on its hop streams (it admits a lane whose hello names the secret, then hands its socket to
the compute thread's ``LaneRelay``), the lanes it dials to its next hops, and whether it
offers lanes at all (``start_lanes``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from urllib.parse import urlsplit

from meshnet_node.dataplane import lanes
from meshnet_node.dataplane.lane_relay import LaneRelay
from meshnet_node.dataplane.lanes import LaneError, LaneKind

logger = logging.getLogger(__name__)

_HELLO_TIMEOUT_S = 2.0


class LaneEnds:
    """A node's lanes as its event loop sees them: the listener it offers on its hop streams
    (``header``), and the lanes it dials to next hops that offer one (``want``)."""

    def __init__(self, service, host: str) -> None:
        self.service = service
        self.host = host
        self.secret = secrets.token_urlsafe(24)
        self.relay: LaneRelay | None = None
        self._listener: socket.socket | None = None
        self._host_listener: socket.socket | None = None  # ``lanes.host_name``, on Linux
        self._dialing: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    @property
    def header(self) -> str | None:
        """``x-meshnet-lane``'s value for a stream's handshake answer (None: none offered)."""
        if self._listener is None:
            return None
        return f"{self._listener.getsockname()[1]} {self.secret}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.relay = LaneRelay(self.service, loop)
        listener = socket.create_server((self.host, 0), backlog=64)
        listener.setblocking(False)
        self._listener = listener
        loop.add_reader(listener, self._accept, listener)
        self._host_listener = _host_listener(listener.getsockname()[1], self.secret)
        if self._host_listener is not None:  # the same lanes for peers on this host
            loop.add_reader(self._host_listener, self._accept, self._host_listener)

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, OSError):
            return
        sock.setblocking(False)
        self._spawn(self._admit(sock))

    async def _admit(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(_HELLO_TIMEOUT_S):
                head = await _recv_exactly(loop, sock, lanes.HEAD_BYTES)
                size, kind, _ = lanes.parse_head(head)
                if kind != LaneKind.HELLO or size > 256:
                    raise LaneError("no hello")
                secret = (await _recv_exactly(loop, sock, size)).decode("ascii", "replace")
        except (TimeoutError, OSError, LaneError):
            sock.close()
            return
        if not secrets.compare_digest(secret, self.secret):
            logger.warning("a decode lane with a wrong secret: closed")
            sock.close()
            return
        self.relay.adopt_upstream(sock)  # type: ignore[union-attr]

    def want(self, hop: str) -> None:
        """On the loop: dial a lane to ``hop`` (if it offered one) for the compute thread."""
        if hop in self._dialing or self.relay is None or hop in self.relay.downstream:
            return
        offer = self.service.links.lane_offer(hop)
        if offer is None:
            return
        self._dialing.add(hop)
        self._spawn(self._dial(hop, *offer))

    async def _dial(self, hop: str, host: str, port: int, secret: str) -> None:
        try:
            sock = await lanes.dial(host, port, secret, _HELLO_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            logger.info("no decode lane to %s: %s", hop, exc)
            return
        finally:
            self._dialing.discard(hop)
        self.relay.adopt_downstream(hop, sock)  # type: ignore[union-attr]

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for listener in (self._listener, self._host_listener):
            if listener is not None:
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(listener)
                listener.close()
        self._listener = self._host_listener = None
        for task in self._tasks:
            task.cancel()


def _host_listener(port: int, secret: str) -> socket.socket | None:
    """A Unix socket listening at the lane offer's ``lanes.host_name`` (an abstract name: no
    file, gone with the process): peers on this host dial it rather than loopback TCP. None
    where the platform has no such names (then every lane is TCP)."""
    family = getattr(socket, "AF_UNIX", None)
    if family is None:
        return None
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind(lanes.host_name(port, secret))
        listener.listen(64)
    except OSError as exc:  # not Linux: abstract names are Linux's
        logger.debug("no lanes for peers on this host by Unix socket: %s", exc)
        listener.close()
        return None
    listener.setblocking(False)
    return listener


def fronted(settings) -> bool:
    """Whether other nodes reach this one through something in front of it: an
    ``--advertise-url`` on another port than its own (a proxy, a port forward, a link
    relay). A lane dialed at that host would go around it (or nowhere): none is offered."""
    if settings.advertise_url is None:
        return False
    return urlsplit(settings.advertise_url).port != settings.port


async def start_lanes(service, settings) -> None:
    """Offer decode lanes on ``service``'s hop streams and dial them to its next hops, where
    ``--decode-lanes`` (the default), the node serves no TLS (a lane is plain TCP, or a
    Unix socket) and nothing fronts it (``fronted``)."""
    if settings.decode_lanes and settings.tls_cert is None and not fronted(settings):
        service.lanes = LaneEnds(service, settings.host)
        await service.lanes.start()
        service.links.lanes_on = True


async def _recv_exactly(loop, sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = await loop.sock_recv(sock, n - len(out))
        if not chunk:
            raise LaneError("closed")
        out += chunk
    return bytes(out)

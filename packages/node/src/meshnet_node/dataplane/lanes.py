"""Decode lanes (docs/adr/0058): plain TCP connections (Unix sockets between the nodes of
one host: ``host_name``) beside the hop streams, on which a session's plain decode steps go
down a route and their answers come back, read and written by the nodes' compute threads.

A hop stream's step crosses, at each node, the event loop's receive, parse and submit, a
hand-over to the compute thread and back, and the relay; each piece costs what the code it
touches costs to bring back into caches a pass emptied (ADR-0011). On a lane the compute
thread reads the step, runs the pass and writes the next hop's step itself: no event loop
and no thread hand-over at the nodes after the head.

A message::

    length (u32, of what follows the header) | kind (u8) | seq (u32) | payload

``HELLO``: the lane's secret (``x-meshnet-lane`` in the hop stream's handshake answer: only
a peer the stream admitted knows it); ``STEP``: a step as bytes and its tensor frame
(``step_bytes``), numbered by the sender; ``ANSWER``: status (u16) | compute length (u16) |
compute times (``x-meshnet-compute-ms``'s text) | body (``answer_bytes``, or an error's
JSON), numbered as the step it answers. ``ANSWERS`` (a tag, 8 bytes) and ``DIRECT`` (tag |
the answer lane's number for it (u32) | hops timed (u8) | their compute (u32 us each) | a ``STEP``'s
payload): a tail answering the head on a lane of its own (docs/adr/0060). Big-endian.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from enum import IntEnum
from typing import Any, NamedTuple

H_LANE = "x-meshnet-lane"  # a hop stream's handshake answer: "<port> <secret>"
# beside it, "1": the lane reads ``DIRECT`` steps and ``ANSWERS`` (docs/adr/0060); a node
# of an older version, which would close a lane on them, says nothing
H_LANE_DIRECT = "x-meshnet-lane-direct"
LANE_REFUSED = 421  # an answer: "send it on the stream", nothing ran
MAX_LANE_MESSAGE = 16 << 20  # a decode step's frame and header stay far below
BY_SESSION_MAX = 4096  # what a node remembers of sessions' lane steps, the latest sessions
LANE_TIMEOUT_S = 5.0  # a message begun is read to its end within this long, or the lane closes

_HEAD = struct.Struct("!IBI")
_ANSWER = struct.Struct("!HH")
_ANSWER_HEAD = struct.Struct("!IBIHH")  # an answer's message header and its own, packed at once
_DIRECT = struct.Struct("!8sIB")  # a direct step's tag, the answer lane's number, hops timed


class LaneKind(IntEnum):
    HELLO = 1
    STEP = 2
    ANSWER = 3
    ANSWERS = 4  # on a lane a head dialed to a tail: answer the steps with this tag here
    DIRECT = 5  # a step whose tail answers the head on its answer lane (``Direct`` first)


_KINDS = {kind.value: kind for kind in LaneKind}  # a lookup, not the enum's slower call


class LaneError(ConnectionError):
    """A lane that closed, or a message that is not one of this protocol's."""


class LaneAnswer(NamedTuple):
    status: int
    compute: str  # every hop's compute time so far, comma-separated
    body: bytes


def plain(step) -> bool:
    """Whether a ``Step`` may take a lane: one token of a session open on every hop, with
    nothing to order it by (no opening, prompt chunk, drafts, guess, replay or audit)."""
    return (
        step.open_spec is None and step.chunk == 0 and not step.drafts
        and step.guess_from is None and not step.replay_pass and step.answer_to is None
        and not step.audit
    )  # fmt: skip


def message(kind: LaneKind, seq: int, *parts: bytes) -> bytes:
    size = sum(len(p) for p in parts)
    return b"".join((_HEAD.pack(size, kind, seq), *parts))


def step_message(seq: int, head: bytes, frame: bytes, direct: Direct | None = None) -> bytes:
    """A step's lane message: a ``STEP``, or a ``DIRECT`` one after ``direct``."""
    if direct is None:
        return message(LaneKind.STEP, seq, head, frame)
    return message(LaneKind.DIRECT, seq, direct.prefix(), head, frame)


def answer(seq: int, status: int, compute: str, body: bytes) -> bytes:
    text = compute.encode()
    size = _ANSWER.size + len(text) + len(body)
    return _ANSWER_HEAD.pack(size, LaneKind.ANSWER, seq, status, len(text)) + text + body


HEAD_BYTES = _HEAD.size


def parse_head(head: bytes) -> tuple[int, int, int]:
    """A message's header: (payload length, kind, number)."""
    return _HEAD.unpack(head)


def parse_answer(payload: bytes) -> LaneAnswer:
    if len(payload) < _ANSWER.size:
        raise LaneError("an answer shorter than its header")
    status, n = _ANSWER.unpack_from(payload)
    end = _ANSWER.size + n
    if end > len(payload):
        raise LaneError("an answer's compute times run past its end")
    return LaneAnswer(status, payload[_ANSWER.size : end].decode("ascii", "replace"),
                      payload[end:])  # fmt: skip


class Direct(NamedTuple):
    """What a ``DIRECT`` step carries before the step (ADR-0060): the tag of the head's
    answer lane at the tail, that lane's number for the step (its answer's), and the
    compute of each hop it passed, in route order (microseconds)."""

    tag: bytes
    seq: int
    compute_us: tuple[int, ...]

    def prefix(self) -> bytes:
        hops = len(self.compute_us)
        return _direct_struct(hops).pack(self.tag, self.seq, hops, *self.compute_us)

    def on(self, own_ms: float) -> Direct:
        """This step as the next hop gets it: this hop's compute added."""
        own_us = min(max(int(own_ms * 1000), 0), 0xFFFFFFFF)
        return Direct(self.tag, self.seq, (*self.compute_us, own_us)[-MAX_DIRECT_HOPS:])

    def compute(self, own_ms: float) -> str:
        """Every hop's compute, the tail's (``own_ms``) last, as an answer says it."""
        return ",".join([*(f"{us / 1000:.3f}" for us in self.compute_us), f"{own_ms:.3f}"])


@functools.cache
def _direct_struct(hops: int) -> struct.Struct:
    """A ``DIRECT`` prefix with ``hops`` compute times: one pack a step (a format made anew
    each time costs ~10 us more on a core a pass left cold)."""
    return struct.Struct(f"!8sIB{hops}I")


def direct_prefix(tag: bytes, seq: int) -> bytes:
    """A head's ``DIRECT`` prefix (``Direct(tag, seq, ()).prefix()``: no hop timed yet), in
    one pack."""
    return _DIRECT.pack(tag, seq, 0)


DIRECT_TAG_BYTES = 8
DIRECT_HEAD_BYTES = _DIRECT.size
MAX_DIRECT_HOPS = 64  # the compute of the hops past this many is dropped (oldest first)


def parse_direct(payload: bytes) -> tuple[Direct, int]:
    """A ``DIRECT`` message's ``Direct`` and where its step begins."""
    if len(payload) < _DIRECT.size:
        raise LaneError("a direct step shorter than its header")
    hops = payload[_DIRECT.size - 1]
    end = _DIRECT.size + 4 * hops
    if hops > MAX_DIRECT_HOPS or end > len(payload):
        raise LaneError("a direct step's compute times run past its end")
    tag, seq, _, *compute_us = _direct_struct(hops).unpack_from(payload)
    return Direct(tag, seq, tuple(compute_us)), end


def parse_lane_header(value: str | None) -> tuple[int, str] | None:
    """A hop stream's ``x-meshnet-lane``: (port, secret), or None (no lane offered)."""
    if not value:
        return None
    port, _, secret = value.partition(" ")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536 or not secret:
        return None
    return int(port), secret


# -- blocking ends: the compute thread's ------------------------------------------------------


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes: in one read as a message written whole mostly arrives, else more."""
    data = sock.recv(size)
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            raise LaneError("the lane closed")
        data += more
    return data


def read_message(sock: socket.socket) -> tuple[LaneKind, int, bytes]:
    """One whole message (the socket blocks, within ``LANE_TIMEOUT_S``)."""
    try:
        head = sock.recv(_HEAD.size)
        if not head:
            raise LaneError("the lane closed")
        if len(head) < _HEAD.size:
            head += _read_exactly(sock, _HEAD.size - len(head))
        size, kind, seq = _HEAD.unpack(head)
        known = _KINDS.get(kind)
        if size > MAX_LANE_MESSAGE or known is None:
            raise LaneError(f"not a lane message (kind {kind}, {size} bytes)")
        payload = _read_exactly(sock, size) if size else b""
    except OSError as exc:  # a timeout, a reset
        raise LaneError(f"the lane failed: {exc}") from exc
    return known, seq, payload


def write(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:
        raise LaneError(f"the lane failed: {exc}") from exc


_TIMEVAL = struct.Struct("@ll")  # struct timeval (seconds, microseconds)


def blocking(sock: socket.socket, timeout_s: float | None = None) -> socket.socket:
    """``sock`` as the compute thread keeps it: blocking within ``timeout_s`` (default
    ``LANE_TIMEOUT_S``), small
    messages sent at once. The kernel keeps the timeout (``SO_RCVTIMEO``, ``SO_SNDTIMEO``;
    a read or write that times out raises ``BlockingIOError``): a socket with a Python
    timeout polls before every read and write, one system call more each. Where the kernel
    takes no such option, the Python timeout."""
    timeout_s = LANE_TIMEOUT_S if timeout_s is None else timeout_s
    seconds = int(timeout_s)
    timeval = _TIMEVAL.pack(seconds, int((timeout_s - seconds) * 1e6))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        sock.settimeout(None)
    except OSError:
        sock.settimeout(timeout_s)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def host_name(port: int, secret: str) -> str:
    """The abstract Unix socket name a node offers its lanes at beside ``port`` (Linux): made
    of its lane offer, port and secret, so only a peer the hop stream admitted knows it, and
    a dialer that finds it in its network namespace found that node, on its own host."""
    digest = hashlib.sha256(f"meshnet-lane {port} {secret}".encode()).hexdigest()[:32]
    return f"\0meshnet-lane-{digest}"


async def dial(host: str, port: int, secret: str, timeout: float) -> socket.socket:
    """A lane to ``host:port``, its hello sent: a connected non-blocking socket. Where the
    node it names listens on this host (its ``host_name`` is there), a Unix socket: a
    message costs ~20 us less to write on it than on loopback TCP (docs/adr/0058)."""
    loop = asyncio.get_running_loop()
    unix = getattr(socket, "AF_UNIX", None)
    async with asyncio.timeout(timeout):
        sock = None
        if unix is not None:
            sock = await _connect(loop, unix, host_name(port, secret), quiet=True)
        if sock is None:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, address = infos[0]
            sock = await _connect(loop, family, address)
        try:
            await loop.sock_sendall(sock, message(LaneKind.HELLO, 0, secret.encode()))
        except BaseException:
            sock.close()
            raise
    if sock.family != unix:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


async def _connect(loop, family, address, quiet: bool = False) -> socket.socket | None:
    """A non-blocking stream socket of ``family`` connected to ``address``; ``quiet``: None
    where it cannot be (a ``host_name`` not on this host is refused at once) rather than
    the error."""
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        if quiet:
            return None
        raise
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, address)
    except BaseException as exc:
        sock.close()
        if quiet and isinstance(exc, OSError):
            return None
        raise
    return sock


# -- the head's end, on its event loop ---------------------------------------------------------


class LaneClient(asyncio.Protocol):
    """A head's lane to its route's first hop. Its answers are read on the event loop, each
    matched to its step by number as it is parsed (``data_received``); its steps are written
    by the compute thread right after the head's pass (``LaneStep.write``), on a duplicate
    of the socket that waits for room within ``LANE_TIMEOUT_S``."""

    def __init__(self, sock: socket.socket) -> None:
        self.out = sock.dup()  # the compute thread's: it alone writes
        self.out.settimeout(LANE_TIMEOUT_S)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.closed: str | None = None
        self._buffer = bytearray()
        self._seq = 0
        self._seq_lock = threading.Lock()  # steps are numbered on the loop and in bursts
        self.rtt_s: float | None = None  # the last answer's time from its step written
        self._held = 0  # bursts that may read the lane on the compute thread (lane_burst)
        self._loop: asyncio.AbstractEventLoop | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= _HEAD.size:
            size, kind, seq = _HEAD.unpack_from(buffer)
            if kind != LaneKind.ANSWER or size > MAX_LANE_MESSAGE:
                self._fail("the hop sent a message that is not an answer")
                return
            end = _HEAD.size + size
            if len(buffer) < end:
                return
            payload = bytes(buffer[_HEAD.size : end])
            del buffer[:end]
            waiting = self.pending.pop(seq, None)
            if waiting is not None and not waiting.done():
                try:
                    waiting.set_result(parse_answer(payload))
                except LaneError as exc:
                    waiting.set_exception(exc)

    def connection_lost(self, exc) -> None:
        self._fail(f"the lane closed ({exc or 'by the hop'})")

    def _fail(self, reason: str) -> None:
        if self.closed is None:
            self.closed = reason
            if self.transport is not None:
                self.transport.close()
            with contextlib.suppress(OSError):
                self.out.shutdown(socket.SHUT_RDWR)  # a burst reading it (lane_burst) wakes
            with contextlib.suppress(OSError):
                self.out.close()
        pending, self.pending = self.pending, {}
        for waiting in pending.values():
            if not waiting.done():
                waiting.set_exception(LaneError(reason))

    @property
    def usable(self) -> bool:
        return self.closed is None and self.transport is not None

    def next_seq(self) -> int:
        """The number of a step about to be written (any thread)."""
        with self._seq_lock:
            self._seq = seq = self._seq + 1 if self._seq < 0xFFFFFFFF else 1
        return seq

    def expect(self) -> tuple[int, asyncio.Future]:
        """On the loop: the number of a step about to be written, and its answer's future."""
        seq = self.next_seq()
        waiting = asyncio.get_running_loop().create_future()
        self.pending[seq] = waiting
        return seq, waiting

    def hold(self) -> None:
        """On the loop: stop reading the lane here; the compute thread may read it (a
        burst, ``lane_burst``) until ``release``."""
        self._loop = asyncio.get_running_loop()
        self._held += 1
        if self._held == 1 and self.transport is not None:
            self.transport.pause_reading()

    def release(self) -> None:
        """On the loop: one ``hold`` less; the loop reads the lane again after the last."""
        self._held -= 1
        if self._held == 0 and self.transport is not None:
            self.transport.resume_reading()

    def release_soon(self) -> None:
        """``release`` from the compute thread, once its burst stopped reading."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nothing reads any more
            self._loop.call_soon_threadsafe(self.release)  # type: ignore[union-attr]

    def close(self) -> None:
        self._fail("closed")


class LaneStep:
    """One step of the head on its lane: numbered on the loop, written by the compute thread
    as soon as the head's pass encoded its output (``encoder``), so the step is on its way
    before the loop hears the pass ended; its answer comes back to the loop (``answer``).
    ``encode_step``: the step's bytes (``step_bytes.encode`` with its request id)."""

    def __init__(self, client: LaneClient, encode_step: Callable[[], bytes]) -> None:
        self.client = client
        self.encode_step = encode_step
        self.seq, self.answer = client.expect()
        self.failed: BaseException | None = None  # the write's failure (compute thread)
        self.written = False
        self.sent, self.size = 0.0, 0  # when it was written, and its step's bytes

    def encoder(self, encode: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
        """``encode`` (a tensor to its frame), then the step written with that frame."""

        def encode_and_write(hidden) -> bytes:
            frame = encode(hidden)
            self.write(frame)
            return frame

        return encode_and_write

    def write(self, frame: bytes) -> None:
        """On the compute thread: the step and ``frame``, whole, on the lane."""
        try:
            data = message(LaneKind.STEP, self.seq, self.encode_step(), frame)
            self.client.out.sendall(data)
            self.sent, self.size = time.perf_counter(), len(data) - _HEAD.size
            self.written = True
        except Exception as exc:  # the loop fails the step (``HopLinks.lane_answer``)
            self.failed = exc

    def forget(self) -> None:
        """On the loop: the step was not written (its pass failed); no answer is awaited."""
        self.client.pending.pop(self.seq, None)

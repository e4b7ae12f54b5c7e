"""Download slots with deadlines (docs/adr/0032): at most ``count`` shard downloads stream at
once per source, at most ``per_peer`` of them for one client address, a request waits a
bounded time for a slot (else 503, retry later), and a slot whose reader falls behind is
taken back, so a reader that stalls or trickles cannot keep the others out.

A download keeps its slot while its bytes go out at the floor rate at least: its deadline is
``MIN_HOLD_S`` past its first byte plus the time its bytes sent so far take at
``FLOOR_BYTES_PER_S``. A reader at the floor rate or faster keeps it to the end; one slower
loses it once it is ``MIN_HOLD_S`` behind (a stalled one ``MIN_HOLD_S`` after its last
progress), however large the file. Until the first byte a slot is held ``START_S`` at most
(a response whose body never starts, its client gone, cannot keep a slot). A download past
its deadline ends early and its reader resumes with an HTTP range.

A thread lock: the bytes are produced in the threadpool, where a slot is released.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass

WAIT_S = 30.0  # how long a request waits for a slot
MIN_HOLD_S = 60.0  # the lead a download has over the floor rate
FLOOR_BYTES_PER_S = 1 << 20  # ...which is 1 MiB/s
POLL_S = 0.1  # how often a waiting request looks for a free slot
START_S = 10.0  # a slot whose download has not begun is taken back after this
PER_PEER = 2  # slots one client address may hold at once


@dataclass(frozen=True)
class Lease:
    """One held slot, for a download of ``nbytes``."""

    number: int
    nbytes: int


@dataclass
class _Hold:
    peer: str | None
    deadline: float
    started: float | None = None
    sent: int = 0


class DownloadSlots:
    """``count`` slots, ``per_peer`` at most for one address, each taken back at its
    lease's deadline."""

    def __init__(self, count: int, *, per_peer: int = PER_PEER, clock=time.monotonic) -> None:
        if count < 1 or per_peer < 1:
            raise ValueError("at least one download slot, and one per peer")
        self.count, self.per_peer = count, per_peer
        self.clock = clock
        self._held: dict[int, _Hold] = {}  # lease number -> its hold
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    def try_acquire(self, nbytes: int, peer: str | None = None) -> Lease | None:
        """A slot for a download of ``nbytes`` by ``peer`` (its address) if one is free now
        (overdue ones are) and ``peer`` holds fewer than ``per_peer``."""
        with self._lock:
            now = self.clock()
            for number in [n for n, hold in self._held.items() if hold.deadline <= now]:
                del self._held[number]  # overdue: its download ends at its next chunk
            if len(self._held) >= self.count:
                return None
            if peer is not None and sum(h.peer == peer for h in self._held.values()) >= (
                self.per_peer
            ):
                return None
            lease = Lease(next(self._numbers), nbytes)
            self._held[lease.number] = _Hold(peer, now + START_S)
            return lease

    async def acquire(
        self, nbytes: int, wait_s: float | None = None, peer: str | None = None
    ) -> Lease | None:
        """A slot, waiting up to ``wait_s`` (default ``WAIT_S``; polled: waiting holds no
        thread); None if none frees up."""
        give_up = self.clock() + (WAIT_S if wait_s is None else wait_s)
        while (lease := self.try_acquire(nbytes, peer)) is None:
            if self.clock() >= give_up:
                return None
            await asyncio.sleep(POLL_S)
        return lease

    def begin(self, lease: Lease) -> None:
        """The download's first byte goes out: its lead over the floor rate starts now."""
        with self._lock:
            if (hold := self._held.get(lease.number)) is not None:
                hold.started = self.clock()
                hold.deadline = hold.started + MIN_HOLD_S

    def sent(self, lease: Lease, nbytes: int) -> None:
        """``nbytes`` more went out: the deadline moves on by their time at the floor rate."""
        with self._lock:
            hold = self._held.get(lease.number)
            if hold is not None and hold.started is not None:
                hold.sent += nbytes
                hold.deadline = hold.started + MIN_HOLD_S + hold.sent / FLOOR_BYTES_PER_S

    def release(self, lease: Lease) -> None:
        with self._lock:
            self._held.pop(lease.number, None)

    def overdue(self, lease: Lease) -> bool:
        """Past its deadline, or already taken back."""
        with self._lock:
            hold = self._held.get(lease.number)
            return hold is None or self.clock() >= hold.deadline

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._held)

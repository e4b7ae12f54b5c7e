"""Download slots with deadlines (docs/adr/0032): at most ``count`` shard downloads stream at
once per source, a request waits a bounded time for a slot (else 503, retry later), and a
slot held past its deadline is taken back, so a reader that stalls or trickles cannot keep
the others out. The deadline allows the download's bytes at a floor rate, never less than a
minute, counted from the first byte sent; until then a slot is held ``START_S`` at most
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
MIN_HOLD_S = 60.0  # a slot is held at least this long
FLOOR_BYTES_PER_S = 1 << 20  # ...and as long as its bytes take at 1 MiB/s
POLL_S = 0.1  # how often a waiting request looks for a free slot
START_S = 10.0  # a slot whose download has not begun is taken back after this


@dataclass(frozen=True)
class Lease:
    """One held slot, for a download of ``nbytes``."""

    number: int
    nbytes: int


class DownloadSlots:
    """``count`` slots, each taken back at its lease's deadline."""

    def __init__(self, count: int, *, clock=time.monotonic) -> None:
        if count < 1:
            raise ValueError("at least one download slot")
        self.count = count
        self.clock = clock
        self._held: dict[int, float] = {}  # lease number -> deadline
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    def hold_for(self, nbytes: int) -> float:
        """Seconds a download of ``nbytes`` may hold its slot."""
        return max(MIN_HOLD_S, nbytes / FLOOR_BYTES_PER_S)

    def try_acquire(self, nbytes: int) -> Lease | None:
        """A slot for a download of ``nbytes`` if one is free now (overdue ones are)."""
        with self._lock:
            now = self.clock()
            for number in [n for n, until in self._held.items() if until <= now]:
                del self._held[number]  # overdue: its download ends at its next chunk
            if len(self._held) >= self.count:
                return None
            lease = Lease(next(self._numbers), nbytes)
            self._held[lease.number] = now + START_S
            return lease

    async def acquire(self, nbytes: int, wait_s: float | None = None) -> Lease | None:
        """A slot, waiting up to ``wait_s`` (default ``WAIT_S``; polled: waiting holds no
        thread); None if none frees up."""
        give_up = self.clock() + (WAIT_S if wait_s is None else wait_s)
        while (lease := self.try_acquire(nbytes)) is None:
            if self.clock() >= give_up:
                return None
            await asyncio.sleep(POLL_S)
        return lease

    def begin(self, lease: Lease) -> None:
        """The download's first byte goes out: its full hold time starts now."""
        with self._lock:
            if lease.number in self._held:
                self._held[lease.number] = self.clock() + self.hold_for(lease.nbytes)

    def release(self, lease: Lease) -> None:
        with self._lock:
            self._held.pop(lease.number, None)

    def overdue(self, lease: Lease) -> bool:
        """Past its deadline, or already taken back."""
        with self._lock:
            return self.clock() >= self._held.get(lease.number, float("-inf"))

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._held)

"""The in-process store: a tracker's state when it has no ``--store``, and the fake the
tests share between several trackers. Same semantics as etcd's: revisions, leases that
expire on a clock, watches from a revision (within the history it keeps)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from meshnet_tracker.store.base import Event, Snapshot, StoreError

HISTORY_EVENTS = 10_000  # events kept for watches that start in the past (etcd compacts too)


@dataclass
class _Entry:
    value: bytes
    lease: int | None


@dataclass
class _Lease:
    ttl_s: float
    deadline: float
    keys: set[str] = field(default_factory=set)


class MemoryStore:
    """A ``Store`` held in this process; leases expire on ``clock`` (checked on every call
    and by ``expire()``), so tests drive time by hand."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        history_events: int = HISTORY_EVENTS,
    ):
        self.clock = clock
        self._data: dict[str, _Entry] = {}
        self._leases: dict[int, _Lease] = {}
        self._next_lease = 1
        self.revision = 1  # etcd's empty store is at revision 1 too
        self._history: deque[Event] = deque()
        self._history_events = history_events
        self._compacted = 0  # the newest revision no longer in the history
        self._watches: list[_Watch] = []
        self._closed = False

    # -- time -------------------------------------------------------------------------
    def expire(self) -> int:
        """Revoke every lease whose time is up (deleting its keys); how many expired."""
        now = self.clock()
        gone = [lease_id for lease_id, lease in self._leases.items() if lease.deadline <= now]
        for lease_id in gone:
            self._revoke(lease_id)
        return len(gone)

    def _begin(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")
        self.expire()

    # -- writes -----------------------------------------------------------------------
    def _commit(self, changes: list[tuple[str, bytes | None, int | None]]) -> int:
        """Apply puts (value) and deletes (None) as one revision and tell the watchers."""
        self.revision += 1
        for key, value, lease in changes:
            old = self._data.pop(key, None)
            if old is not None and old.lease in self._leases:
                self._leases[old.lease].keys.discard(key)
            if value is not None:
                self._data[key] = _Entry(value, lease)
                if lease is not None:
                    self._leases[lease].keys.add(key)
            kind = "put" if value is not None else "delete"
            self._record(Event(kind, key, value, self.revision))
        return self.revision

    def _record(self, event: Event) -> None:
        self._history.append(event)
        while len(self._history) > self._history_events:
            self._compacted = self._history.popleft().revision
        for watch in self._watches:
            if event.key.startswith(watch.prefix):
                watch.queue.put_nowait(event)

    def _check_lease(self, lease: int | None) -> None:
        if lease is not None and lease not in self._leases:
            raise StoreError(f"lease {lease} not found (expired or revoked)")

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        self._begin()
        self._check_lease(lease)
        return self._commit([(key, bytes(value), lease)])

    async def create(self, key: str, value: bytes, *, lease: int | None = None) -> bool:
        self._begin()
        self._check_lease(lease)
        if key in self._data:
            return False
        self._commit([(key, bytes(value), lease)])
        return True

    async def delete(self, key: str) -> bool:
        self._begin()
        if key not in self._data:
            return False
        self._commit([(key, None, None)])
        return True

    async def delete_prefix(self, prefix: str) -> int:
        self._begin()
        keys = sorted(k for k in self._data if k.startswith(prefix))
        if keys:
            self._commit([(key, None, None) for key in keys])
        return len(keys)

    # -- reads ------------------------------------------------------------------------
    async def get(self, key: str) -> bytes | None:
        self._begin()
        entry = self._data.get(key)
        return entry.value if entry else None

    async def get_prefix(self, prefix: str) -> Snapshot:
        self._begin()
        items = {k: e.value for k, e in sorted(self._data.items()) if k.startswith(prefix)}
        return Snapshot(items, self.revision)

    # -- leases -----------------------------------------------------------------------
    async def grant(self, ttl_s: float) -> int:
        self._begin()
        if not ttl_s > 0:
            raise StoreError(f"a lease needs a positive TTL, not {ttl_s}")
        lease_id = self._next_lease
        self._next_lease += 1
        self._leases[lease_id] = _Lease(ttl_s, self.clock() + ttl_s)
        return lease_id

    async def keepalive(self, lease_id: int) -> bool:
        self._begin()
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        lease.deadline = self.clock() + lease.ttl_s
        return True

    async def revoke(self, lease_id: int) -> None:
        self._begin()
        self._revoke(lease_id)

    def _revoke(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease and lease.keys:
            self._commit([(key, None, None) for key in sorted(lease.keys)])

    def _next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self._leases.values()), default=None)

    # -- watches ----------------------------------------------------------------------
    def watch(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[Event]:
        """In place from this call on (etcd's, from its first iteration)."""
        self._begin()
        if start_revision is not None and start_revision <= self._compacted:
            raise StoreError(
                f"revision {start_revision} is compacted (history starts after {self._compacted})"
            )
        watch = _Watch(self, prefix)
        if start_revision is not None:  # the past first, then live: nothing in between
            for event in self._history:
                if event.revision >= start_revision and event.key.startswith(prefix):
                    watch.queue.put_nowait(event)
        self._watches.append(watch)
        return watch

    def _forget(self, watch: _Watch) -> None:
        if watch in self._watches:
            self._watches.remove(watch)

    async def close(self) -> None:
        self._closed = True
        for watch in self._watches:
            watch.queue.put_nowait(None)


class _Watch:
    """One watch on a MemoryStore: its events queued as they happen, until ``aclose()`` or
    the store closes."""

    def __init__(self, store: MemoryStore, prefix: str):
        self.store = store
        self.prefix = prefix
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self.closed = False

    def __aiter__(self) -> _Watch:
        return self

    async def __anext__(self) -> Event:
        while not self.closed:
            if not self.queue.empty():
                event = self.queue.get_nowait()
            else:  # while waiting, leases still expire when their time comes
                deadline = self.store._next_deadline()
                timeout = None if deadline is None else max(0.0, deadline - self.store.clock())
                try:
                    event = await asyncio.wait_for(self.queue.get(), timeout)
                except TimeoutError:
                    self.store.expire()
                    continue
            if event is not None:
                return event
            await self.aclose()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True
        self.store._forget(self)

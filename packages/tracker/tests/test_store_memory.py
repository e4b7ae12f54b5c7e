"""What only the in-process store does: expiry on its injected clock, a bounded history,
closing ends every watch, and two users (two trackers in one test) sharing one store."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from meshnet_tracker.store import MemoryStore, StoreError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_leases_expire_on_the_injected_clock_only():
    async def main():
        clock = Clock()
        store = MemoryStore(clock=clock)
        lease = await store.grant(5)
        await store.put("k", b"v", lease=lease)
        clock.now = 4.9
        assert store.expire() == 0 and await store.get("k") == b"v"
        clock.now = 5.0
        assert await store.get("k") is None  # every call checks the clock first
        assert await store.keepalive(lease) is False

    asyncio.run(main())


def test_a_waiting_watch_sees_an_expiry_when_its_time_comes():
    """With nobody calling the store, a watcher still hears of a lease running out (the
    default store of a lone tracker, on the real clock)."""

    async def main():
        store = MemoryStore()  # time.monotonic
        lease = await store.grant(0.05)
        await store.put("nodes/a", b"v", lease=lease)
        async with aclosing(store.watch("nodes/")) as watch:
            event = await asyncio.wait_for(anext(watch), 5)
        assert (event.kind, event.key) == ("delete", "nodes/a")

    asyncio.run(main())


def test_a_watch_before_the_kept_history_is_refused():
    async def main():
        store = MemoryStore(history_events=3)
        first = await store.put("k", b"0")
        for n in range(1, 5):
            last = await store.put("k", str(n).encode())
        with pytest.raises(StoreError, match="compacted"):
            await anext(store.watch("k", start_revision=first))
        async with aclosing(store.watch("k", start_revision=last - 2)) as watch:
            values = [(await anext(watch)).value for _ in range(3)]
        assert values == [b"2", b"3", b"4"]

    asyncio.run(main())


def test_closing_ends_every_watch_and_refuses_further_calls():
    async def main():
        store = MemoryStore()
        events = []

        async def follow():
            async for event in store.watch(""):
                events.append(event)

        task = asyncio.ensure_future(follow())
        await asyncio.sleep(0)
        await store.put("a", b"1")
        await store.close()
        await asyncio.wait_for(task, 5)
        assert [e.key for e in events] == ["a"]
        with pytest.raises(StoreError, match="closed"):
            await store.get("a")

    asyncio.run(main())


def test_two_users_of_one_store_see_each_others_writes_and_leases():
    """Two trackers in one test process share a MemoryStore: one's write is the other's read,
    and one's expired lease is a delete event in the other's watch."""

    async def main():
        clock = Clock()
        shared = MemoryStore(clock=clock)
        lease = await shared.grant(1)
        async with aclosing(shared.watch("swarm/")) as second_tracker_watch:
            await shared.put("swarm/nodes/a", b"a", lease=lease)  # the first tracker
            assert await shared.get("swarm/nodes/a") == b"a"  # the second tracker
            clock.now = 1.0
            shared.expire()
            kinds = [(await anext(second_tracker_watch)).kind for _ in range(2)]
        assert kinds == ["put", "delete"]

    asyncio.run(main())


def test_a_put_with_an_unknown_lease_is_refused_and_writes_nothing():
    async def main():
        store = MemoryStore()
        revision = (await store.get_prefix("")).revision
        with pytest.raises(StoreError, match="lease 99"):
            await store.put("k", b"v", lease=99)
        with pytest.raises(StoreError):
            await store.create("k", b"v", lease=99)
        with pytest.raises(StoreError):
            await store.grant(0)
        snapshot = await store.get_prefix("")
        assert snapshot.items == {} and snapshot.revision == revision

    asyncio.run(main())

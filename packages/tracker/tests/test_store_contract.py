"""The store contract (``meshnet_tracker.store.base.Store``), run against every store kit:
revisions, prefixes, create-if-absent, leases that take their keys with them, watches."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from store_kits import MemoryKit

from meshnet_tracker.store import Event, StoreError


@pytest.fixture(params=["memory"])
def kit(request):
    return MemoryKit()


def run(kit, body):
    async def main():
        store = kit.open()
        try:
            await body(store, kit.prefix())
        finally:
            await store.close()

    asyncio.run(main())


async def take(watch, count: int) -> list[Event]:
    """The next ``count`` events of a watch (each within a few seconds, or the test fails)."""
    return [await asyncio.wait_for(anext(watch), 5) for _ in range(count)]


def test_put_get_and_revisions_move_on(kit):
    async def body(store, p):
        first = await store.put(p + "a", b"1")
        second = await store.put(p + "a", b"2")
        assert second > first
        assert await store.get(p + "a") == b"2"
        assert await store.get(p + "missing") is None
        assert (await store.get_prefix(p)).revision >= second

    run(kit, body)


def test_prefix_reads_and_deletes_only_their_prefix(kit):
    async def body(store, p):
        for key in ("nodes/a", "nodes/b", "nodesX", "ranges/a"):
            await store.put(p + key, key.encode())
        snapshot = await store.get_prefix(p + "nodes/")
        assert snapshot.items == {p + "nodes/a": b"nodes/a", p + "nodes/b": b"nodes/b"}
        assert await store.delete_prefix(p + "nodes/") == 2
        assert await store.delete_prefix(p + "nodes/") == 0
        assert set((await store.get_prefix(p)).items) == {p + "nodesX", p + "ranges/a"}
        assert await store.delete(p + "nodesX") is True
        assert await store.delete(p + "nodesX") is False

    run(kit, body)


def test_create_writes_only_a_missing_key(kit):
    async def body(store, p):
        assert await store.create(p + "leader", b"one") is True
        assert await store.create(p + "leader", b"two") is False
        assert await store.get(p + "leader") == b"one"
        await store.delete(p + "leader")
        assert await store.create(p + "leader", b"two") is True
        assert await store.get(p + "leader") == b"two"

    run(kit, body)


def test_an_expired_lease_takes_its_keys_and_says_so_to_watchers(kit):
    async def body(store, p):
        lease = await store.grant(kit.ttl_s)
        await store.put(p + "nodes/a", b"alive", lease=lease)
        start = await store.put(p + "nodes/b", b"no lease")
        async with aclosing(store.watch(p, start_revision=start + 1)) as watch:
            await kit.until_gone(store, p + "nodes/a")
            [event] = await take(watch, 1)
        assert (event.kind, event.key, event.value) == ("delete", p + "nodes/a", None)
        assert await store.keepalive(lease) is False
        assert (await store.get_prefix(p)).items == {p + "nodes/b": b"no lease"}
        with pytest.raises(StoreError):  # a lease that is gone holds no new key
            await store.put(p + "nodes/c", b"late", lease=lease)

    run(kit, body)


def test_a_kept_lease_keeps_its_keys_and_a_revoked_one_deletes_them(kit):
    async def body(store, p):
        lease = await store.grant(kit.ttl_s)
        await store.put(p + "a", b"1", lease=lease)
        assert await store.create(p + "b", b"2", lease=lease) is True
        for _ in range(3):
            await kit.pass_time(kit.ttl_s / 2)
            assert await store.keepalive(lease) is True
        assert set((await store.get_prefix(p)).items) == {p + "a", p + "b"}
        await store.revoke(lease)
        await store.revoke(lease)  # already gone: no error
        assert (await store.get_prefix(p)).items == {}
        assert await store.keepalive(lease) is False

    run(kit, body)


def test_a_watch_from_a_snapshot_sees_every_later_change_once_in_order(kit):
    async def body(store, p):
        await store.put(p + "a", b"before")
        snapshot = await store.get_prefix(p)
        second = await store.put(p + "a", b"after")
        await store.put("elsewhere/" + p, b"not watched")
        async with aclosing(store.watch(p, start_revision=snapshot.revision + 1)) as watch:
            await store.delete(p + "a")
            third = await store.put(p + "b", b"new")
            events = await take(watch, 3)
        assert [(e.kind, e.key, e.value) for e in events] == [
            ("put", p + "a", b"after"),
            ("delete", p + "a", None),
            ("put", p + "b", b"new"),
        ]
        assert events[0].revision == second and events[2].revision == third
        assert events[0].revision < events[1].revision < events[2].revision

    run(kit, body)


def test_a_watch_without_a_revision_starts_now(kit):
    async def body(store, p):
        await store.put(p + "old", b"x")
        async with aclosing(store.watch(p)) as watch:
            waiting = asyncio.ensure_future(anext(watch))
            await asyncio.sleep(0.2)  # the watch is in place before the put
            await store.put(p + "new", b"y")
            event = await asyncio.wait_for(waiting, 5)
        assert (event.kind, event.key) == ("put", p + "new")

    run(kit, body)

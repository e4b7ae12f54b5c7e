"""The stores the store contract runs against, each with a way to let time pass: a
MemoryStore on a hand-driven clock, and (when the binary is here) a real etcd."""

from __future__ import annotations

import asyncio
import itertools
import os
import time

from meshnet_tracker.store import EtcdStore, MemoryStore, Store

_prefixes = itertools.count()


class MemoryKit:
    """MemoryStores on one fake clock; time passes only when a test says so."""

    name = "memory"
    ttl_s = 2.0

    def __init__(self) -> None:
        self.now = 1000.0
        self.stores: list[MemoryStore] = []

    def clock(self) -> float:
        return self.now

    def open(self) -> Store:
        store = MemoryStore(clock=self.clock)
        self.stores.append(store)
        return store

    def prefix(self) -> str:
        return f"swarm-{next(_prefixes)}/"

    async def pass_time(self, seconds: float) -> None:
        self.now += seconds
        for store in self.stores:
            store.expire()

    async def until_gone(self, store: Store, key: str) -> None:
        """Let the TTL pass until ``key``'s lease has expired."""
        await self.pass_time(self.ttl_s)
        assert await store.get(key) is None


class EtcdKit:
    """EtcdStores on one real etcd: time is the wall clock, a lease lives at least etcd's
    minimum TTL (2 s), and each test writes under a prefix of its own."""

    name = "etcd"
    ttl_s = 2.0

    def __init__(self, url: str) -> None:
        self.url = url

    def clock(self) -> float:
        return time.monotonic()

    def open(self) -> Store:
        return EtcdStore([self.url], timeout_s=5)

    def prefix(self) -> str:
        return f"test-{os.getpid()}-{next(_prefixes)}/"

    async def pass_time(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def until_gone(self, store: Store, key: str) -> None:
        """Until etcd has expired ``key``'s lease (it checks every half second or so)."""
        await asyncio.sleep(self.ttl_s)
        for _ in range(100):
            if await store.get(key) is None:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{key} outlived its lease")

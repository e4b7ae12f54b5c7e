"""The stores the store contract runs against, each with a way to let time pass: a
MemoryStore on a hand-driven clock, and (when the binary is here) a real etcd."""

from __future__ import annotations

import itertools

from meshnet_tracker.store import MemoryStore, Store

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

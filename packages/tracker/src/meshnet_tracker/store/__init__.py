"""The trackers' shared store (issue 53): one interface, kept in this process or in etcd,
and the leader election built on it."""

from meshnet_tracker.store.base import Event, Snapshot, Store, StoreError
from meshnet_tracker.store.election import Election
from meshnet_tracker.store.memory import MemoryStore

__all__ = ["Election", "Event", "MemoryStore", "Snapshot", "Store", "StoreError"]

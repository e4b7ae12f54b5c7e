"""The trackers' shared store (issue 53): one interface, kept in this process or in etcd,
and the leader election built on it."""

from meshnet_tracker.store.base import Event, Snapshot, Store, StoreError
from meshnet_tracker.store.election import Election
from meshnet_tracker.store.etcd import EtcdStore
from meshnet_tracker.store.memory import MemoryStore
from meshnet_tracker.store.spec import open_store, parse_store_url

__all__ = [
    "Election",
    "EtcdStore",
    "Event",
    "MemoryStore",
    "Snapshot",
    "Store",
    "StoreError",
    "open_store",
    "parse_store_url",
]

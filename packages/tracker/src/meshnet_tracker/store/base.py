"""The trackers' shared store: what a store holds and answers, whichever server keeps it.

Keys are plain strings (the caller puts them under its swarm's prefix), values are bytes.
Every write moves one store-wide ``revision`` on, as etcd's does: a watch started at a
revision sees every change from there, so a reader takes a snapshot with ``get_prefix`` and
then watches from ``snapshot.revision + 1`` without missing or repeating a change.
A lease is a time to live that its holder renews with ``keepalive``; the keys put with it
are deleted (as delete events) when it expires or is revoked.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

from meshnet_common.errors import MeshnetError


class StoreError(MeshnetError):
    """The store failed or refused an operation (unreachable, lease unknown, history compacted)."""

    status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str):
        super().__init__(message, code="store_unavailable")


@dataclass(frozen=True)
class Event:
    """One change under a watched prefix: a put (with its value) or a delete (value None)."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes | None
    revision: int


@dataclass(frozen=True)
class Snapshot:
    """The keys under a prefix and their values, read at one store revision."""

    items: dict[str, bytes]
    revision: int


def prefix_end(prefix: str) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's ``range_end``):
    the prefix with its last byte + 1 (trailing 0xff bytes dropped); b"\\0" for all keys."""
    end = bytearray(prefix.encode())
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


class Store(Protocol):
    """A key-value store with revisions, leases and watches, shared by a swarm's trackers."""

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """Set ``key``; with ``lease``, the key goes when the lease does. Returns the revision.
        An unknown or expired lease is a StoreError."""
        ...

    async def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it is not there."""
        ...

    async def get_prefix(self, prefix: str) -> Snapshot:
        """Every key starting with ``prefix``, with the revision they were read at."""
        ...

    async def delete(self, key: str) -> bool:
        """Delete ``key``; False when it was not there."""
        ...

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix`` (one revision); how many there were."""
        ...

    async def create(self, key: str, value: bytes, *, lease: int | None = None) -> bool:
        """Put ``key`` only if it does not exist (an etcd txn on create_revision == 0);
        False, and nothing written, when it does."""
        ...

    async def grant(self, ttl_s: float) -> int:
        """A new lease living ``ttl_s`` seconds unless kept alive (etcd rounds up to whole
        seconds, at least its minimum TTL). Returns its id."""
        ...

    async def keepalive(self, lease_id: int) -> bool:
        """Renew the lease for its full TTL; False when it is gone (expired or revoked)."""
        ...

    async def revoke(self, lease_id: int) -> None:
        """End the lease now, deleting its keys; a lease already gone is no error."""
        ...

    def watch(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[Event]:
        """The changes under ``prefix`` in revision order, from ``start_revision`` (events at
        that revision and after; a revision already compacted away is a StoreError) or, when
        None, from when the watch starts. Ends when the store closes; close it early with
        ``aclose()`` (``contextlib.aclosing``)."""
        ...

    async def close(self) -> None:
        """Release the connections and end every watch."""
        ...

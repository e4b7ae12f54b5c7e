"""What ``--store`` names, and the store it opens: nothing (or ``memory``) is this process's
own store; ``etcd://HOST:PORT[,HOST:PORT...]`` is an etcd cluster reached at any of those."""

from __future__ import annotations

import time
from collections.abc import Callable
from urllib.parse import urlsplit

from meshnet_tracker.store.base import Store
from meshnet_tracker.store.etcd import EtcdStore
from meshnet_tracker.store.memory import MemoryStore

SCHEME = "etcd://"
FORM = "etcd://HOST:PORT[,HOST:PORT...]"


def parse_store_url(spec: str) -> list[str]:
    """The ``http://host:port`` endpoint of each member ``spec`` names; a ValueError saying
    what is wrong, in one line, for anything else."""
    if not spec.startswith(SCHEME):
        raise ValueError(f"--store {spec!r}: expected {FORM} (or nothing for the in-memory store)")
    members = spec[len(SCHEME) :].rstrip("/").split(",")
    urls = []
    for member in members:
        try:
            parts = urlsplit(f"//{member.strip()}")
            host, port = parts.hostname, parts.port
        except ValueError as exc:  # a port that is no number, or out of range
            raise ValueError(f"--store {spec!r}: {member!r}: {exc}") from None
        if not host or port is None or parts.path or parts.query or parts.username:
            raise ValueError(f"--store {spec!r}: {member!r} is not HOST:PORT (expected {FORM})")
        urls.append(f"http://{f'[{host}]' if ':' in host else host}:{port}")
    return urls


def open_store(
    spec: str | None,
    *,
    timeout_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
) -> Store:
    """The store ``spec`` names (see ``parse_store_url``); None or "memory" is a MemoryStore
    on ``clock``. Opening connects nothing yet: the first call does."""
    if spec is None or spec == "memory":
        return MemoryStore(clock=clock)
    return EtcdStore(parse_store_url(spec), timeout_s=timeout_s)

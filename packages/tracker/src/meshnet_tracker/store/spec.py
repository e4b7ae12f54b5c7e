"""What ``--store`` names, and the store it opens: nothing (or ``memory``) is this process's
own store; ``etcd://HOST:PORT[,HOST:PORT...]`` is an etcd cluster reached at any of those
members over plain HTTP, ``etcds://...`` the same over TLS (verified against a CA, and with
a client certificate when etcd runs with ``--client-cert-auth``)."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from meshnet_tracker.store.base import Store
from meshnet_tracker.store.etcd import EtcdStore
from meshnet_tracker.store.memory import MemoryStore

SCHEMES = {"etcd://": "http", "etcds://": "https"}
FORM = "etcd://HOST:PORT[,HOST:PORT...] (etcds:// for TLS)"


def parse_store_url(spec: str) -> list[str]:
    """The ``http(s)://host:port`` endpoint of each member ``spec`` names; a ValueError
    saying what is wrong, in one line, for anything else."""
    scheme = next((s for s in SCHEMES if spec.startswith(s)), None)
    if scheme is None:
        raise ValueError(f"--store {spec!r}: expected {FORM} (or nothing for the in-memory store)")
    urls = []
    for member in spec[len(scheme) :].rstrip("/").split(","):
        try:
            parts = urlsplit(f"//{member.strip()}")
            host, port = parts.hostname, parts.port
        except ValueError as exc:  # a port that is no number, or out of range
            raise ValueError(f"--store {spec!r}: {member!r}: {exc}") from None
        if not host or port is None or parts.path or parts.query or parts.username:
            raise ValueError(f"--store {spec!r}: {member!r} is not HOST:PORT (expected {FORM})")
        urls.append(f"{SCHEMES[scheme]}://{f'[{host}]' if ':' in host else host}:{port}")
    return urls


def tls_context(ca: Path | None, cert: Path | None, key: Path | None) -> ssl.SSLContext:
    """What an etcds:// store verifies etcd with (``ca``; None: the system's CAs) and proves
    itself with (``cert`` and ``key``, both or neither). ValueError in one line otherwise."""
    if (cert is None) != (key is None):
        raise ValueError("the store's client certificate and key go together: both or neither")
    try:
        context = ssl.create_default_context(cafile=None if ca is None else str(ca))
        if cert is not None:
            context.load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"the store's TLS files: {exc}") from None
    return context


def open_store(
    spec: str | None,
    *,
    timeout_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    ca: Path | None = None,
    cert: Path | None = None,
    key: Path | None = None,
) -> Store:
    """The store ``spec`` names (see ``parse_store_url``); None or "memory" is a MemoryStore
    on ``clock``. ``ca``, ``cert`` and ``key`` are for etcds:// (a ValueError with plain
    etcd://, which would send none of them). Opening connects nothing: the first call does."""
    if spec is None or spec == "memory":
        return MemoryStore(clock=clock)
    urls = parse_store_url(spec)
    secure = urls[0].startswith("https://")
    if not secure and (ca, cert, key) != (None, None, None):
        raise ValueError(f"--store {spec!r}: TLS files given for plain HTTP (use etcds://)")
    return EtcdStore(urls, timeout_s=timeout_s, tls=tls_context(ca, cert, key) if secure else None)

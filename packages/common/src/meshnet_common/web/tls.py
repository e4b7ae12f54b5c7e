"""TLS between the swarm's services (docs/adr/0025): serving https/wss with ``--tls-cert``
and ``--tls-key``, verifying peers against ``--tls-ca`` (default: the system's CAs).

A process configures it once at start (``configure``); every client that talks to the swarm
(registration, heartbeats, routes, shard downloads, the tracker's proxy, hop streams) asks
``client_context()`` for what to verify against. Plain HTTP stays the default."""

from __future__ import annotations

import ssl
from pathlib import Path

_context: ssl.SSLContext | None = None  # None: the system's CAs (httpx/websockets default)


def check(cert: Path | None, key: Path | None, ca: Path | None) -> None:
    """ValueError with one clear line for an incomplete or unreadable TLS setup."""
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    if cert is not None:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"--tls-cert/--tls-key: cannot load them: {exc}") from exc


def configure(ca: Path | None) -> None:
    """Verify the swarm's certificates against ``ca`` (None: the system's CAs)."""
    global _context
    _context = None if ca is None else ssl.create_default_context(cafile=str(ca))


def client_context() -> ssl.SSLContext | bool:
    """What a swarm client verifies https peers with: ``--tls-ca``'s context, else True."""
    return _context if _context is not None else True


def stream_context() -> ssl.SSLContext | None:
    """The same for hop streams (websockets: None is its default context)."""
    return _context


def server_options(cert: Path | None, key: Path | None) -> dict:
    """uvicorn's TLS options (empty: plain HTTP)."""
    if cert is None:
        return {}
    return {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}


def scheme(cert: Path | None) -> str:
    return "https" if cert is not None else "http"

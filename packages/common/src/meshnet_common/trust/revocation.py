"""Certificates withdrawn before they expire (docs/adr/0032).

A node certificate lives ``CERT_LIFETIME_S`` (heartbeats renew it), so without more a node
the tracker removed or quarantined could still call its peers for that long. The tracker
revokes the node's key at once: it certifies it no more, its own checker refuses it, and
every heartbeat answer lists the keys revoked (``HeartbeatResponse.revoked``), which each
node's ``CallChecker`` refuses from then on. A key stays listed until every certificate
issued for it has expired; a node registering again (not quarantined) is certified anew.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from meshnet_common.trust.identity import CERT_LIFETIME_S, MAX_SKEW_S

MAX_REVOKED = 1024  # keys listed at once (a heartbeat answer carries them all)


class Revocations:
    """Node keys (``NodeKey.public``) whose certificates no longer count, each until the
    last certificate issued for it has expired; the oldest dropped past ``MAX_REVOKED``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._until: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def revoke(self, public_key: str | None) -> None:
        if not public_key:
            return
        with self._lock:
            self._until.pop(public_key, None)
            self._until[public_key] = self.clock() + CERT_LIFETIME_S + MAX_SKEW_S
            while len(self._until) > MAX_REVOKED:
                self._until.popitem(last=False)

    def lift(self, public_key: str | None) -> None:
        """The key's node registered again and is certified anew."""
        if public_key:
            with self._lock:
                self._until.pop(public_key, None)

    def keys(self) -> tuple[str, ...]:
        """The keys revoked now (expired entries dropped)."""
        now = self.clock()
        with self._lock:
            for key in [k for k, until in self._until.items() if until < now]:
                del self._until[key]
            return tuple(self._until)

    def __contains__(self, public_key: object) -> bool:
        until = self._until.get(public_key) if isinstance(public_key, str) else None
        return until is not None and until >= self.clock()

"""Leader election over a ``Store``: the leader is whoever created ``{name}/leader`` with a
lease it keeps alive. When the leader stops renewing, the lease expires, the key goes, and
the next candidate to step creates it. The caller drives ``step()`` once per heartbeat
(or runs ``run()``), so a test drives it on a fake clock."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from meshnet_tracker.store.base import Store, StoreError

log = logging.getLogger(__name__)


class Election:
    """One candidate in the election ``name``; ``is_leader`` while it holds the key and its
    lease has not run out by its own clock (so a leader cut off from the store steps down
    no later than the store lets another take over)."""

    def __init__(
        self,
        store: Store,
        name: str,
        candidate_id: str,
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store = store
        self.key = f"{name}/leader"
        self.candidate_id = candidate_id
        self.ttl_s = ttl_s
        self.clock = clock
        self._lease: int | None = None
        self._lease_until = 0.0  # by our clock, read before the renewal was sent: never late
        self._holds_key = False
        self._hold_off_until = 0.0  # after resigning: give the others a turn

    @property
    def is_leader(self) -> bool:
        """True while this candidate holds the leader key under a lease still alive."""
        return self._holds_key and self.clock() < self._lease_until

    async def leader(self) -> str | None:
        """The id of whoever holds the leader key now, or None when nobody does."""
        value = await self.store.get(self.key)
        return value.decode() if value is not None else None

    async def step(self) -> bool:
        """Keep this candidate's lease alive, check it still holds the key, and campaign
        for it when nobody does. Returns ``is_leader``. Store failures raise StoreError."""
        await self._renew()
        if self._holds_key:
            holder = await self.store.get(self.key)
            self._holds_key = holder == self.candidate_id.encode()
            if not self._holds_key:
                log.warning("%s lost the leadership of %s", self.candidate_id, self.key)
        if not self._holds_key and self.clock() >= self._hold_off_until:
            won = await self.store.create(self.key, self.candidate_id.encode(), lease=self._lease)
            if won:
                log.info("%s leads %s", self.candidate_id, self.key)
            self._holds_key = won
        return self.is_leader

    async def _renew(self) -> None:
        sent = self.clock()
        if self._lease is not None and await self.store.keepalive(self._lease):
            self._lease_until = sent + self.ttl_s
            return
        if self._lease is not None:  # expired: the key went with it
            self._holds_key = False
        sent = self.clock()
        self._lease = await self.store.grant(self.ttl_s)
        self._lease_until = sent + self.ttl_s

    async def resign(self) -> None:
        """Give the leadership up now (the key goes with the lease) and stand aside for one
        TTL, so another candidate takes over on its next step."""
        was_leader, lease = self._holds_key, self._lease
        self._holds_key, self._lease, self._lease_until = False, None, 0.0
        self._hold_off_until = self.clock() + self.ttl_s
        if lease is not None:
            await self.store.revoke(lease)
        if was_leader:
            log.info("%s resigned the leadership of %s", self.candidate_id, self.key)

    async def run(self, interval_s: float | None = None) -> None:
        """Step every ``interval_s`` (a third of the TTL by default) until cancelled; a store
        failure is logged and retried on the next step, the leadership lapsing meanwhile."""
        interval_s = self.ttl_s / 3 if interval_s is None else interval_s
        while True:
            try:
                await self.step()
            except StoreError as exc:
                log.warning("election %s: %s", self.key, exc.message)
            await asyncio.sleep(interval_s)

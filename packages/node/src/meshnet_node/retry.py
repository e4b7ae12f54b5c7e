"""One retry policy for the node (ADR-0007): bounded attempts and/or a deadline, capped
exponential backoff, and a ban list of failed peers with expiry.

Used by generation failover (``meshnet_node.head.generation``), tracker registration
(``meshnet_node.swarm.membership``), waiting for the tracker (``meshnet_node.swarm.joining``)
and resuming a shard download (``meshnet_node.swarm.fetch``), each with its own parameters.
Time is read from an injected clock (a callable returning monotonic seconds); the callers do
the waiting with their own sleep (``asyncio.sleep``, ``time.sleep``, an ``Event.wait``), so
tests drive all of it with a fake clock and no real sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]  # monotonic seconds

_MAX_DOUBLINGS = 62  # 2**62 times any sane base is past every cap; keeps floats finite


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry, and how long to wait between attempts.

    ``max_attempts``: attempts in all, the first one included (``None``: no limit on
    attempts, which must be said explicitly). ``deadline_s``: no attempt starts once this
    long has passed since ``start`` (``None``: no deadline). A policy with neither retries
    forever; see ``bounded``. The wait after the n-th failure is
    ``min(backoff_cap_s, backoff_base_s * 2 ** (n - 1))``; no jitter.
    """

    max_attempts: int | None
    deadline_s: float | None = None
    backoff_base_s: float = 0.0
    backoff_cap_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1 or None, not {self.max_attempts}")
        if self.deadline_s is not None and self.deadline_s < 0:
            raise ValueError(f"deadline_s must not be negative, not {self.deadline_s}")
        if self.backoff_base_s < 0 or self.backoff_cap_s < 0:
            raise ValueError("backoff_base_s and backoff_cap_s must not be negative")

    @property
    def bounded(self) -> bool:
        """Whether retrying ever ends by itself (an attempt limit or a deadline)."""
        return self.max_attempts is not None or self.deadline_s is not None

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure (1-based) before trying again."""
        if failures < 1:
            raise ValueError(f"failures counts from 1, not {failures}")
        doublings = min(failures - 1, _MAX_DOUBLINGS)
        return min(self.backoff_cap_s, self.backoff_base_s * 2.0**doublings)

    def start(self, clock: Clock = time.monotonic) -> RetryBudget:
        """A fresh budget for one operation, its deadline counted from now on ``clock``."""
        return RetryBudget(self, clock)


class RetryBudget:
    """One operation's use of a ``RetryPolicy``: the failures so far and its deadline."""

    def __init__(self, policy: RetryPolicy, clock: Clock = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self.started = clock()
        self.failures = 0

    @property
    def deadline(self) -> float | None:
        """Clock time from which no further attempt is made (None: no deadline)."""
        if self.policy.deadline_s is None:
            return None
        return self.started + self.policy.deadline_s

    def remaining(self) -> float | None:
        """Seconds left before the deadline, never negative (None: no deadline)."""
        deadline = self.deadline
        return None if deadline is None else max(0.0, deadline - self.clock())

    def exhausted(self) -> bool:
        """Whether the attempts are used up or the deadline has come."""
        limit = self.policy.max_attempts
        if limit is not None and self.failures >= limit:
            return True
        deadline = self.deadline
        return deadline is not None and self.clock() >= deadline

    def failed(self) -> bool:
        """Count one failed attempt; True when another attempt may be made."""
        self.failures += 1
        return not self.exhausted()

    def backoff(self) -> float:
        """Seconds to wait before the next attempt (after the failures counted so far)."""
        return self.policy.delay(max(1, self.failures))


class BanList:
    """Peers (URLs) to avoid until their ban expires, on an injected clock."""

    def __init__(self, ban_s: float, clock: Clock = time.monotonic) -> None:
        if ban_s < 0:
            raise ValueError(f"ban_s must not be negative, not {ban_s}")
        self.ban_s = ban_s
        self.clock = clock
        self._until: dict[str, float] = {}  # URL -> clock time its ban ends

    def ban(self, url: str, until: float | None = None) -> None:
        """Avoid ``url`` until ``until`` (default: ``ban_s`` from now); a new ban replaces
        an older one."""
        self.expire()
        self._until[url] = self.clock() + self.ban_s if until is None else until

    def banned(self, now: float | None = None) -> frozenset[str]:
        """The URLs whose ban has not expired at ``now`` (default: the clock's now)."""
        now = self.clock() if now is None else now
        return frozenset(url for url, until in self._until.items() if until > now)

    def lift(self, url: str) -> None:
        """End ``url``'s ban now (it answered again: a restarted node)."""
        self._until.pop(url, None)

    def until(self, url: str) -> float | None:
        """When ``url``'s ban ends (None: not banned, or never was)."""
        return self._until.get(url)

    def expire(self, now: float | None = None) -> None:
        """Forget bans that have ended."""
        now = self.clock() if now is None else now
        for url in [u for u, until in self._until.items() if until <= now]:
            del self._until[url]

    def __len__(self) -> int:
        return len(self.banned())

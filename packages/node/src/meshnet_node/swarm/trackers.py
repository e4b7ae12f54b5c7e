"""The trackers of one swarm a node was given (``--tracker URL1,URL2``) and the one it talks
to now.

Every call a node makes to its swarm's control plane (registration, heartbeats, leaving,
assignment, routes, verdicts, manifests and the tracker key) goes to the current tracker; a
tracker that does not answer (connection refused or broken, a timeout, a 5xx) makes the next
one current, round robin, and the same call is made there. A 4xx is an answer (the swarm's
word: wrong token, unknown node, bad request) and is never sent elsewhere. The trackers of one
swarm share its signing key (docs/adr/0032), so the node's kept tracker key and certificate
stay good on every one of them. A node stays with the tracker that answered until that one
fails in turn: no flapping back.

Each call makes one round over the trackers by default; with a ``RetryPolicy`` it makes
further rounds after that policy's backoff (``meshnet_node.retry``), and when all are down it
ends with the last failure: the transport error raised, or the last 5xx answer returned.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

import httpx

from meshnet_node.retry import Clock, RetryBudget, RetryPolicy

logger = logging.getLogger(__name__)

ONE_ROUND = RetryPolicy(max_attempts=1)  # each tracker asked once, no waiting


class Trackers:
    """The tracker URLs of one swarm, in the order given, and which one is current."""

    def __init__(self, urls: Sequence[str], *, clock: Clock = time.monotonic) -> None:
        cleaned = tuple(url.rstrip("/") for url in urls)
        if not cleaned:
            raise ValueError("no tracker URL")
        if len(set(cleaned)) != len(cleaned):
            raise ValueError(f"a tracker URL is given twice: {', '.join(cleaned)}")
        self.urls = cleaned
        self.clock = clock
        self._index = 0
        self._down: set[str] = set()  # failed since they last answered (said once each)
        self._lock = threading.Lock()  # the membership thread and the event loop share it

    @classmethod
    def of(cls, trackers: Trackers | str | Sequence[str]) -> Trackers:
        """``trackers`` itself, or the trackers of a URL (comma-separated list) or sequence."""
        if isinstance(trackers, Trackers):
            return trackers
        if isinstance(trackers, str):
            trackers = [u.strip() for u in trackers.split(",") if u.strip()]
        return cls(trackers)

    @property
    def current(self) -> str:
        """The tracker calls go to now."""
        return self.urls[self._index]

    def __len__(self) -> int:
        return len(self.urls)

    def describe(self) -> str:
        return ", ".join(self.urls)

    def failed(self, url: str, why: str = "no answer") -> str:
        """``url`` did not answer: when it is still current, the next one becomes current
        (one that failed meanwhile on another thread is not skipped twice). The current one."""
        with self._lock:
            url = url.rstrip("/")
            if url == self.urls[self._index] and len(self.urls) > 1:
                self._index = (self._index + 1) % len(self.urls)
                level = logging.DEBUG if url in self._down else logging.WARNING
                logger.log(level, "tracker %s did not answer (%s); now asking %s",
                           url, why, self.urls[self._index])  # fmt: skip
            self._down.add(url)
            return self.urls[self._index]

    def answered(self, url: str) -> None:
        """``url`` answered: a later failure of it is news again."""
        if url in self._down:
            with self._lock:
                self._down.discard(url)
            if len(self.urls) > 1:
                logger.info("tracker %s answers", url)

    def in_order(self) -> tuple[str, ...]:
        """Every tracker once, the current one first, then the others in order."""
        start = self._index
        return tuple(self.urls[(start + n) % len(self.urls)] for n in range(len(self.urls)))

    # -- calls ---------------------------------------------------------------------------

    def send(
        self, call: Callable[[str], httpx.Response], *, retry: RetryPolicy = ONE_ROUND,
        answers: frozenset[int] = frozenset(), sleep: Callable[[float], None] = time.sleep,
    ) -> httpx.Response:  # fmt: skip
        """``call(url)`` on the current tracker, moving on while none answers; ``answers``:
        the 5xx statuses that are an answer of this call (a live tracker saying no)."""
        budget = retry.start(self.clock)
        while True:
            last: httpx.Response | httpx.TransportError | None = None
            for url in self.in_order():
                try:
                    last = call(url)
                except httpx.TransportError as exc:
                    last = exc
                if self._settled(url, last, answers):
                    return last
            if not budget.failed():
                return _outcome(last)
            sleep(_pause(budget))

    def _settled(self, url: str, outcome, answers: frozenset[int]) -> bool:
        """Whether ``outcome`` (an answer or a transport error) of ``url`` is the call's
        answer; else ``url`` failed and the next tracker is asked."""
        if not isinstance(outcome, httpx.TransportError) and _answered(outcome, answers):
            self.answered(url)
            return True
        self.failed(url, _why(outcome))
        return False

    async def asend(
        self, call: Callable[[str], Awaitable[httpx.Response]], *,
        retry: RetryPolicy = ONE_ROUND, answers: frozenset[int] = frozenset(),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> httpx.Response:  # fmt: skip
        """``send`` for an async client (the head's routes and verdicts, on the loop)."""
        budget = retry.start(self.clock)
        while True:
            last: httpx.Response | httpx.TransportError | None = None
            for url in self.in_order():
                try:
                    last = await call(url)
                except httpx.TransportError as exc:
                    last = exc
                if self._settled(url, last, answers):
                    return last
            if not budget.failed():
                return _outcome(last)
            await sleep(_pause(budget))


def _answered(resp: httpx.Response, answers: frozenset[int]) -> bool:
    return resp.status_code < 500 or resp.status_code in answers


def _why(last: httpx.Response | httpx.TransportError | None) -> str:
    if last is not None and not isinstance(last, httpx.TransportError):
        return f"HTTP {last.status_code}"
    return type(last).__name__


def _outcome(last: httpx.Response | httpx.TransportError | None) -> httpx.Response:
    """What the caller gets once every round failed: the last 5xx, else the last error."""
    if last is not None and not isinstance(last, httpx.TransportError):
        return last
    assert last is not None  # a round asks at least one tracker (checked at __init__)
    raise last


def _pause(budget: RetryBudget) -> float:
    """The policy's backoff, cut short at its deadline."""
    remaining = budget.remaining()
    return budget.backoff() if remaining is None else min(budget.backoff(), remaining)

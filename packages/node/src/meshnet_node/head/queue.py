"""Requests wait instead of failing: when the chain is full (a node's KV budget or session
limit), a request that has produced nothing yet waits here for a turn, then runs again.

Bounded (``--max-queued-requests``; beyond: 503 with ``Retry-After``), with a deadline
(``--queue-timeout``), and fair: clients take turns (round robin) and each client's requests
keep their order (FIFO), so one client's burst cannot starve the others. A client is who the
server knows, not what a request says (``routes.client_of``: the API key it authenticated
with, else its address); the request's ``user`` field only takes turns within its client's
share. A turn comes when a generation on this head ends, or every ``poll_s`` (capacity may
free on nodes other heads use)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from meshnet_common.errors import CapacityExceeded

CAPACITY_CODES = frozenset({"kv_budget_full", "too_many_sessions"})


class QueueFull(CapacityExceeded):
    """503 with a ``Retry-After`` header: the wait queue is full or the wait timed out."""

    def __init__(self, message: str, *, retry_after_s: float, code: str) -> None:
        super().__init__(message, code=code)
        self.headers = {"retry-after": str(max(1, round(retry_after_s)))}


class RequestQueue:
    """Waiting requests by client; ``wait`` returns on the caller's turn."""

    def __init__(
        self,
        *,
        max_waiting: int = 64,
        timeout_s: float = 30.0,
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.clock = clock
        # client -> user -> waiting turns; both levels in turn order
        self._clients: OrderedDict[str, OrderedDict[str, deque[asyncio.Future]]] = OrderedDict()
        self._poller: asyncio.Task | None = None

    @property
    def waiting(self) -> int:
        return sum(len(line) for users in self._clients.values() for line in users.values())

    def busy(self) -> bool:
        """Someone is waiting: a new request queues behind them rather than jump ahead."""
        return self.waiting > 0

    async def wait(
        self, client: str, deadline: float, *, again: bool = False, user: str = ""
    ) -> None:
        """Wait for ``client``'s turn, and within it ``user``'s (``again``: it just had one
        and found no room, so it keeps its place at the front of its own line). QueueFull
        when the queue is full or ``deadline`` passes."""
        if self.waiting >= self.max_waiting:
            raise QueueFull(
                f"{self.waiting} requests are already waiting for room (limit "
                f"{self.max_waiting}); retry later", retry_after_s=self.poll_s * 4,
                code="queue_full",
            )  # fmt: skip
        remaining = deadline - self.clock()
        if remaining <= 0:
            raise self._timed_out()
        turn: asyncio.Future = asyncio.get_running_loop().create_future()
        line = self._clients.setdefault(client, OrderedDict()).setdefault(user, deque())
        if again:
            line.appendleft(turn)
        else:
            line.append(turn)
        self._ensure_poller()
        try:
            await asyncio.wait_for(asyncio.shield(turn), remaining)
        except TimeoutError:
            raise self._timed_out() from None
        finally:
            self._forget(client, user, turn)

    def wake(self) -> None:
        """Give the next client in turn (and its next user in turn) its first waiting
        request's turn."""
        for _ in range(len(self._clients)):
            client, users = next(iter(self._clients.items()))
            self._clients.move_to_end(client)  # the next wake goes to the next client
            if _next_turn(users):
                return

    def _forget(self, client: str, user: str, turn: asyncio.Future) -> None:
        users = self._clients.get(client)
        line = None if users is None else users.get(user)
        if line is not None:
            with contextlib.suppress(ValueError):  # already gone
                line.remove(turn)
            if not line:
                del users[user]
            if not users:
                del self._clients[client]

    def _timed_out(self) -> QueueFull:
        return QueueFull(
            f"no room in the chain within {self.timeout_s:g} s of waiting; retry later",
            retry_after_s=self.timeout_s / 4, code="queue_timeout",
        )  # fmt: skip

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        while self.waiting:
            await asyncio.sleep(self.poll_s)
            self.wake()


def _next_turn(users: OrderedDict[str, deque[asyncio.Future]]) -> bool:
    """Start the first waiting turn of the next user in ``users``' turn order."""
    for _ in range(len(users)):
        user, line = next(iter(users.items()))
        users.move_to_end(user)
        for turn in line:
            if not turn.done():
                turn.set_result(None)
                return True
    return False

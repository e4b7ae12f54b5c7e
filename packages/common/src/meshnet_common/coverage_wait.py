"""Waiting out a coverage gap that is expected to heal (docs/adr/0023).

When no chain of serving nodes covers a model but one is expected back (a node of the
missing range is joining or loading, or a node the caller failed on is still on the map:
it may be restarting), the tracker's 503 carries the code ``coverage_pending``. Heads and
the tracker then ask again every ``poll_s`` for up to ``wait_s`` (``--coverage-wait``) and
within the request's deadline; any other 503 fails at once, naming the gap. Pure: the clock
and the sleep are injected (tests run it on a fake clock).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from meshnet_common.errors import ModelNotCovered

COVERAGE_PENDING = "coverage_pending"  # the 503's code when the gap is expected to heal
POLL_S = 0.5

T = TypeVar("T")


def expected_back(exc: BaseException) -> bool:
    return isinstance(exc, ModelNotCovered) and exc.code == COVERAGE_PENDING


async def wait_for_coverage(
    ask: Callable[[], Awaitable[T]],
    *,
    wait_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]],
    deadline: float | None = None,
    poll_s: float = POLL_S,
    between: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """``await ask()`` until it succeeds; ask again while it raises ``coverage_pending``, for
    at most ``wait_s`` seconds (and not past ``deadline``, on ``clock``). ``between`` runs
    before each new attempt (a head re-checks the hops it banned there)."""
    started = clock()
    limit = started + max(0.0, wait_s)
    if deadline is not None:
        limit = min(limit, deadline)
    while True:
        try:
            return await ask()
        except ModelNotCovered as exc:
            if not expected_back(exc):
                raise
            now = clock()
            if now + poll_s > limit:
                waited = now - started
                raise ModelNotCovered(
                    f"{exc} (waited {waited:.1f} s for it to come back)" if waited else str(exc),
                    code="model_not_covered",
                ) from exc
        await sleep(poll_s)
        if between is not None:
            await between()

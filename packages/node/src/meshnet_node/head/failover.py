"""Failover: when a hop of a generation's route dies, ban it, free what the chain held,
find another route (waiting for missing layers expected back: ``--coverage-wait``), and
rebuild the fresh chain's caches by running the lost computation again, pass for pass, so
the text goes on exactly as it would have (docs/adr/0007, 0023). ``Failover`` is the half of
``HeadGenerator`` that does it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshnet_common.coverage_wait import wait_for_coverage
from meshnet_common.errors import CapacityExceeded, HopError, ModelNotCovered
from meshnet_node.engine.stage import Stage
from meshnet_node.retry import RetryBudget, RetryPolicy

if TYPE_CHECKING:
    from meshnet_node.head.generation import GenerationRequest

logger = logging.getLogger("meshnet_node.head.generation")

# Failover policy (ADR 0007), per request: the first try and up to 4 failovers within 120 s,
# backing off 0.2 s doubling to at most 2 s; a failed hop is banned for 30 s.
FAILOVER_POLICY = RetryPolicy(
    max_attempts=1 + 4, deadline_s=120.0, backoff_base_s=0.2, backoff_cap_s=2.0
)
FAILOVER_BAN_S = 30.0


class ComputedWrong(HopError):
    """An audit found a hop of the chain computing wrong (docs/adr/0026)."""


def _still_alive(exc: HopError) -> bool:
    """The failed hop still answers (it computed wrong, or was quarantined for it): free the
    chain's session there too, not only on the hops after it."""
    if isinstance(exc, ComputedWrong):
        return True
    body = exc.body if isinstance(exc.body, dict) else {}
    return (body.get("error") or {}).get("code") == "quarantined"


@dataclass
class _Chain:
    """The current session of one generation along its route (replaced on failover)."""

    route: tuple[str, ...]
    session_id: str = ""
    key: str = ""
    replay: bool = False  # the next step must rebuild the chain's caches from the history
    budget: RetryBudget | None = None  # the request's failovers and deadline (set once)
    # Every decode pass the chain ran after the prompt, as (position, input ids, drafts):
    # a replay runs them again exactly as they ran (docs/adr/0023).
    passes: list[tuple[int, list[int], int]] = field(default_factory=list)
    auditing: asyncio.Task | None = None  # the verifier's audit of this chain (ADR-0026)
    convicted: str | None = None  # a hop an audit found computing wrong: fail over off it

    @property
    def failovers(self) -> int:
        return 0 if self.budget is None else self.budget.failures


class Failover:
    """Provided by ``HeadGenerator``: ``service``, ``bans``, ``clock``, ``sleep``,
    ``coverage_wait_s``, ``avoided``, ``suspects``, ``_prefill``, ``_local``, ``_send``,
    ``_close``, ``_open_local``."""

    async def _replay(self, stage: Stage, chain: _Chain, request: GenerationRequest) -> None:
        """Rebuild a fresh session's caches with the computation the lost one ran: the
        prompt in the same chunks and pieces, then each decode pass with the same inputs
        (drafts included, so every hop rewinds where it rewound). Run as a single prefill,
        the history would be other arithmetic: in bfloat16 near-ties flip, and the text
        after a failover would differ from an undisturbed run's.

        Every input is known in advance, so nothing waits for an answer: the head runs each
        pass through its own layers and sends it on at once, numbered (``replay_pass``), and
        each hop runs pass n once it ran pass n - 1. The tail's answers are known already
        and dropped; the replay ends when the last one is in."""
        started, passes = time.perf_counter(), list(chain.passes)
        sends: list[asyncio.Future] = []
        sid, key, route = chain.session_id, chain.key, chain.route
        try:
            await self._prefill(stage, sid, key, request, route, sends=sends)
            for number, (position, inputs, drafts) in enumerate(passes, start=1):
                out = await self._local(stage, sid, key, inputs, position, True, drafts)
                sends.append(asyncio.ensure_future(self._send(
                    out, sid, key, position, route, 0, True, None,
                    ids=tuple(inputs), drafts=drafts,
                    replay_pass=number,
                )))  # fmt: skip
            await asyncio.gather(*sends)
        except BaseException:
            for task in sends:
                task.cancel()
            raise
        seconds = time.perf_counter() - started
        self.service.metrics.replay_seconds.observe(seconds)
        logger.info("replayed the prompt and %d decode passes in %.2f s", len(passes), seconds)

    async def _abandon(self, stage: Stage, chain: _Chain, exc: HopError, phase: str) -> None:
        """Ban the failed hop, free the chain's session on the hops still alive, back off."""
        failed = exc.failed_url
        logger.warning(
            "hop %s failed during %s (%s); failing over (attempt %d)",
            failed, phase, exc, chain.failovers,
        )  # fmt: skip
        self.service.metrics.failovers.inc()
        self.bans.expire()
        if failed and exc.status != 503:  # a full node is busy, not broken: avoid, don't ban
            self.bans.ban(failed)
        old_session, old_key, old_route = chain.session_id, chain.key, chain.route
        gone = None if _still_alive(exc) else failed
        await self._close(stage, old_session, old_key, tuple(u for u in old_route if u != gone))
        await self.sleep(chain.budget.backoff())

    async def _reroute(
        self, stage: Stage, chain: _Chain, request: GenerationRequest, exc: HopError, reroute
    ) -> None:
        """A new route avoiding banned hops, then a fresh session to replay into.

        The tracker may briefly lack a replacement (a busy node that missed heartbeats
        re-registers on its next one): asking again is bounded by the same attempt budget
        and deadline; once they are spent the client gets the tracker's 503.
        """
        failed = exc.failed_url

        async def ask() -> tuple[str, ...]:
            exclude = self.avoided()
            if failed and exc.status == 503:
                exclude |= {failed}
            return await reroute(exclude)

        while True:
            try:
                # Missing layers expected back (a node loading or restarting): wait for them
                # for up to --coverage-wait within the request's deadline (docs/adr/0023).
                chain.route = await wait_for_coverage(
                    ask, wait_s=self.coverage_wait_s, clock=self.clock, sleep=self.sleep,
                    deadline=chain.budget.deadline, between=self._lift_bans_of_the_living,
                )  # fmt: skip
                break
            except ModelNotCovered as missing:
                full = _capacity_code(exc)
                if full is not None:  # the only chain is full: wait for room, not for a node
                    raise CapacityExceeded(
                        f"the chain is full ({full} at {failed}); no other route has room",
                        code=full,
                    ) from missing
                if not chain.budget.failed():
                    raise
                logger.warning("no replacement route yet (%s); asking again", missing)
                await self.sleep(chain.budget.backoff())
        self._open_local(stage, chain, request)
        chain.replay = True

    async def _lift_bans_of_the_living(self) -> None:
        """A banned hop that answers again (a node restarted at its address) is routable
        again: its ban would otherwise keep a request waiting on coverage it has."""
        for url in self.bans.banned() - self.suspects():  # a node computing wrong stays out
            if await self.service.reachable(url):
                logger.info("hop %s answers again; no longer avoided", url)
                self.bans.lift(url)


def _capacity_code(exc: HopError) -> str | None:
    """``kv_budget_full`` / ``too_many_sessions`` when a hop refused for lack of room."""
    if exc.status != 503 or not isinstance(exc.body, dict):
        return None
    code = (exc.body.get("error") or {}).get("code")
    return code if code in ("kv_budget_full", "too_many_sessions") else None

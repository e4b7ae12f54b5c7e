"""Failover: when a hop of a generation's route dies, ban it, free what the chain held,
find another route (waiting for missing layers expected back: ``--coverage-wait``), and
rebuild the fresh chain's caches by running the lost computation again, pass for pass, so
the text goes on exactly as it would have (docs/adr/0007, 0023)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from meshnet_common.coverage_wait import wait_for_coverage
from meshnet_common.errors import CapacityExceeded, HopError, ModelNotCovered
from meshnet_common.protocol import StepResult
from meshnet_node.dataplane.service import NodeService
from meshnet_node.dataplane.steps import Step
from meshnet_node.engine.ahead import Ahead
from meshnet_node.engine.stage import Stage
from meshnet_node.head.chain import Chain, GenerationRequest, HeadPasses
from meshnet_node.retry import BanList, Clock, RetryPolicy

logger = logging.getLogger(__name__)

# Failover policy (ADR 0007), per request: the first try and up to 4 failovers within 120 s,
# backing off 0.2 s doubling to at most 2 s; a failed hop is banned for 30 s.
FAILOVER_POLICY = RetryPolicy(
    max_attempts=1 + 4, deadline_s=120.0, backoff_base_s=0.2, backoff_cap_s=2.0
)
FAILOVER_BAN_S = 30.0

# The hops to avoid -> URLs of the hops after this head
Reroute = Callable[[frozenset[str]], Awaitable[tuple[str, ...]]]


class ComputedWrong(HopError):
    """An audit found a hop of the chain computing wrong (docs/adr/0026)."""


def _still_alive(exc: HopError) -> bool:
    """The failed hop still answers (it computed wrong, or was quarantined for it): free the
    chain's session there too, not only on the hops after it."""
    if isinstance(exc, ComputedWrong):
        return True
    body = exc.body if isinstance(exc.body, dict) else {}
    return (body.get("error") or {}).get("code") == "quarantined"


def _no_suspects() -> frozenset[str]:
    return frozenset()


class Failover:
    """Runs a generation's passes through ``passes`` and, when a hop dies, moves the chain
    to another route: bans the hop for ``ban_s``, within ``policy``'s attempts and deadline
    per request. Owns the bans of this head; ``suspects``: the hops an audit found
    computing wrong (avoided, never forgiven here)."""

    def __init__(
        self,
        passes: HeadPasses,
        service: NodeService,
        *,
        policy: RetryPolicy = FAILOVER_POLICY,
        ban_s: float = FAILOVER_BAN_S,
        clock: Clock = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        coverage_wait_s: float = 30.0,
        suspects: Callable[[], frozenset[str]] = _no_suspects,
    ) -> None:
        self.passes = passes
        self.service = service  # its metrics, and whether a banned hop answers again
        self.policy = policy
        self.clock = clock
        self.sleep = sleep
        self.bans = BanList(ban_s, clock)  # failed hops, per head process
        self.coverage_wait_s = coverage_wait_s  # how long a failover waits for missing layers
        self.suspects = suspects

    def avoided(self) -> frozenset[str]:
        """Hops new routes must avoid: failed ones (banned for a while) and suspects."""
        return self.bans.banned() | self.suspects()

    async def first_route(self, reroute: Reroute) -> tuple[str, ...]:
        """A route for a new request, avoiding the hops to avoid; missing layers expected
        back are waited for, for up to --coverage-wait (docs/adr/0023)."""

        async def ask() -> tuple[str, ...]:
            return await reroute(self.avoided())

        return await wait_for_coverage(
            ask, wait_s=self.coverage_wait_s, clock=self.clock, sleep=self.sleep,
            between=self.lift_bans_of_the_living,
        )  # fmt: skip

    async def advance(
        self,
        stage: Stage,
        chain: Chain,
        request: GenerationRequest,
        history: list[int],
        token: int | None,
        reroute: Reroute | None,
        drafts: list[int] | None = None,
        ahead: Ahead | None = None,
    ) -> StepResult:
        """Prefill (``token`` None) or one decode step (with ``drafts`` for the chain to
        verify, or running ``ahead`` where the head is the tail: ADR-0047), failing over to
        a new route if a hop dies: bounded attempts, capped exponential backoff, an overall
        deadline. A replay verifies no drafts."""
        if chain.budget is None:  # the limits hold for the whole request, not per step
            chain.budget = self.policy.start(self.clock)
        while True:
            phase = "prefill" if token is None or chain.replay else "decode"
            try:
                if chain.convicted is not None:  # an audit found it computing wrong
                    convicted, chain.convicted = chain.convicted, None
                    raise ComputedWrong(f"hop {convicted} computed wrong (an audit, "
                                        "docs/adr/0026)", hop=convicted)  # fmt: skip
                if token is None:  # the prompt (again, in a fresh session, after a failover)
                    chain.replay = False
                    return await self.passes.prefill(
                        stage, chain.session_id, chain.key, request, chain.route
                    )
                if chain.replay:  # a fresh session: rebuild every cache as it was built
                    await self._replay(stage, chain, request)
                    chain.replay = False
                inputs = [token, *(drafts or ())]
                result = await self.passes.step(
                    stage, chain.session_id, chain.key, inputs, len(history), chain.route,
                    drafts=len(drafts or ()), ahead=ahead,
                )  # fmt: skip
                chain.passes.append((len(history), inputs, len(drafts or ())))  # ahead: no route
                return result
            except HopError as exc:
                may_retry = chain.budget.failed()
                if reroute is None or not exc.recoverable or not may_retry:
                    raise
                await self.fail_over(stage, chain, request, exc, reroute, phase)

    async def fail_over(
        self,
        stage: Stage,
        chain: Chain,
        request: GenerationRequest,
        exc: HopError,
        reroute: Reroute,
        phase: str,
    ) -> None:
        """Move ``chain`` off the hop ``exc`` names, once the request's budget allowed it:
        free the old session, back off, find a new route and open a fresh session there,
        which the next step replays into."""
        await self._abandon(stage, chain, exc, phase)
        await self._reroute(stage, chain, request, exc, reroute)

    async def lift_bans_of_the_living(self) -> None:
        """A banned hop that answers again (a node restarted at its address) is routable
        again: its ban would otherwise keep a request waiting on coverage it has."""
        for url in self.bans.banned() - self.suspects():  # a node computing wrong stays out
            if await self.service.reachable(url):
                logger.info("hop %s answers again; no longer avoided", url)
                self.bans.lift(url)

    async def _replay(self, stage: Stage, chain: Chain, request: GenerationRequest) -> None:
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
            await self.passes.prefill(stage, sid, key, request, route, sends=sends)
            for number, (position, inputs, drafts) in enumerate(passes, start=1):
                step = Step(sid, key, position, route=route, sample=True,
                            ids=tuple(inputs), drafts=drafts, replay_pass=number)  # fmt: skip
                out = await self.passes.local(stage, step)
                step = replace(step, route=route[1:])
                sends.append(asyncio.ensure_future(self.passes.send(route[0], out, step)))
            await asyncio.gather(*sends)
        except BaseException:
            for task in sends:
                task.cancel()
            raise
        seconds = time.perf_counter() - started
        self.service.metrics.replay_seconds.observe(seconds)
        logger.info("replayed the prompt and %d decode passes in %.2f s", len(passes), seconds)

    async def _abandon(self, stage: Stage, chain: Chain, exc: HopError, phase: str) -> None:
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
        alive = tuple(u for u in old_route if u != gone)
        await self.passes.close(stage, old_session, old_key, alive)
        await self.sleep(chain.budget.backoff())

    async def _reroute(
        self,
        stage: Stage,
        chain: Chain,
        request: GenerationRequest,
        exc: HopError,
        reroute: Reroute,
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
                    deadline=chain.budget.deadline, between=self.lift_bans_of_the_living,
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
        self.passes.open(stage, chain, request)
        chain.replay = True


def _capacity_code(exc: HopError) -> str | None:
    """``kv_budget_full`` / ``too_many_sessions`` when a hop refused for lack of room."""
    if exc.status != 503 or not isinstance(exc.body, dict):
        return None
    code = (exc.body.get("error") or {}).get("code")
    return code if code in ("kv_budget_full", "too_many_sessions") else None

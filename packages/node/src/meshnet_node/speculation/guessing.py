"""Guess steps (docs/adr/0019): over a chain, a greedy generation's next decode steps are
sent before the answers they depend on, each carrying the head's guess of its input token
(the same n-gram lookup that proposes drafts).

A decode step waits for the token before it, so a single generation keeps every hop idle
for all but its own share of a traversal: the links, the other hops' compute. Guess steps
fill that idle time. Step ``p`` carries the token the head knows; step ``p + 1`` carries
its guess of the token the tail will sample at ``p``, sent right behind it; and so on, up
to ``depth`` steps in flight. Every hop computes them in order, one row each, as it would
the steps sent one by one. The tail knows what it sampled: a guess step whose token is not
that one (or that follows one that was not) is *stale* and the tail answers so without
computing. When the answer to step ``p`` shows the guess for ``p + 1`` right, that step's
answer is already on its way; when wrong, the head drops the steps after ``p`` and sends the
right token, and every hop rewinds its cache to that position (the guess steps said how
far back a later step may go).

Each row a hop computes is the row of a one-token step at that position with that input,
so the text is exactly that of one-at-a-time decoding (bit for bit, in bfloat16 too).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from meshnet_common.errors import HopError
from meshnet_common.metrics import Metrics
from meshnet_common.protocol import StepResult

DEFAULT_DEPTH = 8  # decode steps of one generation in flight at most (--guess-steps)
UNMEASURED_DEPTH = 4  # at most this many while the link or the pass is not yet timed


class InFlight(NamedTuple):
    position: int  # the step's position
    token: int  # its input token: known, or the head's guess
    task: asyncio.Future  # its answer (a StepResult)


class GuessFlight:
    """One generation's decode steps in flight, oldest first: the first one's input is known
    (or its guess was confirmed), the others' are guesses."""

    def __init__(self, depth: int = DEFAULT_DEPTH) -> None:
        self.depth = depth
        self.steps: deque[InFlight] = deque()
        self.guessed = 0  # guess steps sent
        self.confirmed = 0  # guess steps whose guess was the tail's token
        # tokens of the traversal under way: its step, waited for from the start, and the
        # right guesses whose answers rode along behind it
        self.riding = 0

    def __len__(self) -> int:
        return len(self.steps)

    def take(self, position: int, token: int) -> InFlight | None:
        """The step in flight for input ``token`` at ``position`` (a right guess), else
        None: then every step in flight is stale (``drop`` them)."""
        if self.steps and self.steps[0].position == position and self.steps[0].token == token:
            self.confirmed += 1
            return self.steps.popleft()
        return None

    def cancel(self) -> list[asyncio.Future]:
        """Cancel every step in flight, without waiting: for a generation that ends (its
        sessions close next, so the hops drop whatever of those steps still reaches them).
        Returns the cancelled steps."""
        stale = [step.task for step in self.steps]
        self.steps.clear()
        for task in stale:
            task.cancel()
        return stale

    async def drop(self) -> None:
        """Cancel every step in flight and wait until they let go (their answers, still
        coming, are dropped by the link)."""
        if stale := self.cancel():
            await asyncio.gather(*stale, return_exceptions=True)

    def traversal(self, fresh: bool) -> int:
        """Count one step's token. A step waited for from the start (``fresh``) begins a
        traversal: returns the tokens of the one it ends (0 for the first), else 0."""
        done = self.riding if fresh else 0
        self.riding = 1 if fresh else self.riding + 1
        return done

    def finish(self) -> int:
        """The tokens of the traversal under way, which ends with the generation."""
        done, self.riding = self.riding, 0
        return done

    def rewind_from(self, position: int) -> int:
        """How far back a later step may take the hops, for a guess step at ``position``:
        to the first guess still unanswered."""
        return self.steps[0].position if self.steps else position

    def guessed_tokens(self) -> list[int]:
        return [step.token for step in self.steps]

    def add(self, position: int, token: int, task: asyncio.Future) -> None:
        self.steps.append(InFlight(position, token, task))
        self.guessed += 1


SLOW_LINK_MS = 5.0  # a round trip this long keeps the steps asked for while passes are unknown


def guess_depth(
    configured: int,
    stages: int,
    concurrent: int,
    rtt_ms: float | None,
    pass_ms: float | None,
    lane: bool = False,
) -> int:
    """How many steps of one greedy generation to keep in flight (``--guess-steps``) over
    a chain of ``stages``: guesses fill stages that would otherwise wait.

    Stages that compute apart (as many at once as there are stages) keep up to
    ``UNMEASURED_DEPTH`` steps in flight, more where the links measured need more. Stages
    sharing this host's cores (fewer compute at once than there are stages:
    ``concurrent``, from ``micro_batches``) do not wait for each other's compute, they take
    turns on the cores: a guess beyond ``concurrent`` only takes a core from the step it
    runs ahead of (measured on a 2-core host with 3 local stages over loopback: a third of
    decode speed). But while a step crosses a link no stage computes it, and a guess can
    use that time: a traversal spends ``stages`` one-way link delays (about ``rtt_ms / 2``
    each, the measured round trip to the first hop) beside ``stages`` passes of about
    ``pass_ms`` (this stage's last decode pass), so a pipeline of right guesses needs
    ``1 + rtt / (2 x pass)`` steps in flight; a guess is right about half the time (n-gram
    lookup: 1.1-1.7 tokens a pass), so twice the extra: ``1 + ceil(rtt / pass)``, less a
    fifth for a loopback's fraction of a pass; at most ``configured``. Unknown times: the
    round trip alone decides (a link not yet measured, unreachable, or slower than
    ``SLOW_LINK_MS`` keeps ``configured``, but no more than ``UNMEASURED_DEPTH``: only a
    measured fill goes further).

    ``lane``: the chain's first hop offers a decode lane (ADR-0058). Stages sharing cores
    then keep no more steps in flight than the links need, and links faster than
    ``SLOW_LINK_MS`` (a host's, a LAN's, even busy) need none: a lone step down the lane, run ahead
    from the head (ADR-0059), was measured faster than two steps in flight on the streams
    (2-core Xeon, three local stages: SmolLM2 Q4_1 at one thread each 87-91 tok/s against
    83-85, at their own threads 87-102 against 80-100; bf16 equal)."""
    unmeasured = min(configured, UNMEASURED_DEPTH)
    apart = concurrent >= stages  # every stage computes at once: none takes another's turn
    shared = 1 if lane else concurrent  # the floor of stages taking turns on the cores
    if rtt_ms is None or math.isinf(rtt_ms):
        return unmeasured
    if pass_ms is None or pass_ms <= 0:
        return unmeasured if apart or rtt_ms >= SLOW_LINK_MS else min(configured, shared)
    fill = 1 + math.ceil(rtt_ms / pass_ms - 0.2)
    if lane and not apart and rtt_ms < SLOW_LINK_MS:
        fill = 1  # a host's or a LAN's links: the lane's step is quicker than guesses
    return max(1, min(configured, max(unmeasured if apart else shared, fill)))


# One decode step along the chain: (stage, session id, key, token ids, position, route,
# guess_from=...) -> the chain's answer (``HeadPasses.step``)
StepSender = Callable[..., Awaitable[StepResult]]


class GuessSteps:
    """Sends a greedy generation's next decode steps before the tokens they carry are known
    (their guesses), through ``send_step``, counting them in ``metrics``. ``quiet``:
    whether this head may guess now (no audit under way, few generations running)."""

    def __init__(self, send_step: StepSender, metrics: Metrics, quiet: Callable[[], bool]) -> None:
        self.send_step = send_step
        self.metrics = metrics
        self.quiet = quiet

    def allowed(self, chain) -> bool:
        """Whether this generation's next steps may be guesses: over a chain, with no
        replay or audit under way, and few generations on this head (with many, batched
        decoding keeps the hops busy already, and a stale guess would cost them a row)."""
        return bool(chain.route) and not chain.replay and chain.convicted is None and self.quiet()

    def _launch(self, stage, chain, token: int, position: int, guess_from=None):
        return asyncio.ensure_future(self.send_step(
            stage, chain.session_id, chain.key, [token], position, chain.route,
            guess_from=guess_from,
        ))  # fmt: skip

    async def step(
        self, stage, chain, history, token, flight: GuessFlight, speculation, room: int, timings,
    ) -> StepResult:  # fmt: skip
        """The step for input ``token`` at ``len(history)``: already in flight when it was
        guessed right, else sent now (the guesses in flight were wrong); then more guesses
        behind it, up to ``flight.depth`` steps in flight. Returns its answer. A hop that
        fails drops every step in flight and raises (the caller fails over and steps again
        plainly)."""
        metrics = self.metrics
        position, started = len(history), time.perf_counter()
        current = flight.take(position, token)
        fresh = current is None
        if current is None:
            await flight.drop()
            current = InFlight(position, token, self._launch(stage, chain, token, position))
        else:
            metrics.accepted_tokens.inc()
            speculation.accepted += 1
        if not self.allowed(chain):
            await flight.drop()
        elif (want := min(flight.depth - 1, room) - len(flight)) > 0:
            have = flight.guessed_tokens()
            proposal = speculation.propose([*history, token], len(have) + want)
            if proposal[: len(have)] == have:  # the guesses go on from those in flight
                at = position + 1 + len(have)
                for guess in proposal[len(have) :]:
                    task = self._launch(stage, chain, guess, at, guess_from=flight.rewind_from(at))
                    flight.add(at, guess, task)
                    at += 1
                metrics.draft_tokens.inc(len(proposal) - len(have))
                speculation.drafted += len(proposal) - len(have)
        try:
            result = await current.task
            if result.stale:  # cannot happen: its input is the tail's token; start afresh
                await flight.drop()
                fresh, result = True, await self._launch(stage, chain, token, position)
        except HopError:
            await flight.drop()
            raise
        except BaseException:  # cancelled (the client left): the flight is dropped by then
            current.task.cancel()
            raise
        elapsed = time.perf_counter() - started
        metrics.decode_seconds.observe(elapsed)
        if done := flight.traversal(fresh):  # tokens per traversal waited for
            metrics.tokens_per_step.observe(done)
        chain.passes.append((position, [token], 0))  # what a replay runs again
        if fresh:  # a step sent now: its time is a step's (one sent early is not)
            timings.add(elapsed, result.compute_ms, len(chain.route))
        return result

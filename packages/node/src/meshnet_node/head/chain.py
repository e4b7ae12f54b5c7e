"""One generation's chain: the request, its session along the route, and the passes the head
runs for it: through its own layers, then on down the chain (``HeadPasses``).

The head holds the first layers locally; every later hop is reached through
``NodeService.send``. A prompt is computed in calls as the unsplit model computes it (one
for a prompt up to ``--prompt-call-tokens``) and travels in wire chunks; nodes put
early-arriving chunks back in order and gather a call's chunks (ADR-0053).
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from meshnet_common import wire
from meshnet_common.logs import bind_session
from meshnet_common.protocol import SamplingSpec, StepResult
from meshnet_node.caching.api import PrefixClient
from meshnet_node.caching.blocks import BLOCK_TOKENS
from meshnet_node.caching.reuse import PrefixReuse
from meshnet_node.dataplane.lane_burst import LaneBurst
from meshnet_node.dataplane.lanes import LaneStep
from meshnet_node.dataplane.service import NodeService
from meshnet_node.dataplane.steps import OpenSpec, Step
from meshnet_node.engine.ahead import Ahead
from meshnet_node.engine.stage import Stage, StepOutput
from meshnet_node.retry import RetryBudget
from meshnet_node.scheduling.micro_batches import micro_batches


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()  # token ids that end the generation (not text)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # False: special tokens are text (harmony channels)
    client: str = "anonymous"  # who asked: the wait queue takes turns between clients
    user: str = ""  # the request's ``user`` field: turns within the client's share
    cache_salt: str | None = None  # prompts share cached blocks only under one salt (ADR-0035)
    tenant: str | None = None  # ... and one tenant, its API key's (``web.auth.tenant_of``)


@dataclass
class Chain:
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


class HeadPasses:
    """Runs a generation's passes: through the head's own layers on ``service``, then on to
    the chain's first hop. ``audited``: every hop keeps the sessions' inputs for audits
    (docs/adr/0026)."""

    def __init__(self, service: NodeService, *, audited: bool = False) -> None:
        self.service = service
        self.audited = audited
        self._bursts: dict[str, LaneBurst] = {}  # sessions' steps running ahead (ADR-0059)
        # The prefix cache (docs/adr/0035); sessions a verifier audits start from scratch.
        self.prefixes = None
        if service.settings.prefix_cache and not audited:
            client = PrefixClient(service.settings.swarm_token, service.identity)
            self.prefixes = PrefixReuse(service.model_id, client)

    def bursting(self, session_id: str) -> bool:
        """Whether the session's steps run ahead down its lane now (ADR-0059): its next
        steps are the burst's, plain, neither drafts nor guesses."""
        return session_id in self._bursts

    def open(self, stage: Stage, chain: Chain, request: GenerationRequest) -> None:
        """A fresh session on ``stage`` for ``chain`` (the hops open theirs with its first
        pass)."""
        chain.session_id = uuid.uuid4().hex
        chain.key = secrets.token_hex(16)
        bind_session(chain.session_id)  # this generation's log lines carry its session
        stage.open_session(
            chain.session_id,
            sampling=request.sampling,
            owner=chain.key,
            keep=self.prefixes.plan(request) if self.prefixes else None,
            score_end=request.sampling.score_end,
        )

    async def prefill(
        self,
        stage: Stage,
        session_id: str,
        key: str,
        request: GenerationRequest,
        route: tuple[str, ...],
        sends: list[asyncio.Future] | None = None,
    ) -> StepResult:
        """Run the prompt through the local layers and send it on in wire chunks.

        The prompt is computed in calls of the session's ``prompt_call`` rows from where it
        starts (one call for a prompt up to that long; a scored prompt's first call ends
        before its last row), as the unsplit model computes it; every hop gathers a call's
        wire chunks and computes them as one call too (ADR-0053). A call's chunks are sent
        as soon as it is computed, overlapping the next call.
        ``sends``: collect the chunks' sends there and return without waiting for them (a
        replay, docs/adr/0023).
        """
        chunk_tokens = stage.max_chunk_tokens
        ids = request.prompt_ids
        prefix: tuple[str, ...] = ()  # cached blocks every hop starts after (ADR-0035)
        scored = request.sampling.prompt_logprobs is not None  # every prompt row is needed
        if self.prefixes is not None and sends is None and not scored:
            prefix = await self.prefixes.restore(stage, session_id, ids, route)
        begin = len(prefix) * BLOCK_TOKENS
        head = stage.sessions.peek(session_id)
        call = stage.prompt_call(None) if head is None else head.prompt_call
        bounds = [begin]
        while bounds[-1] < len(ids):  # the calls every hop cuts alike (``Session.call_end``)
            end = bounds[-1] + call if head is None else head.call_end(bounds[-1])
            bounds.append(min(end, len(ids)))
        # The first chunk opens the session on every hop (``audited``: each keeps its inputs).
        opening = OpenSpec.of(
            request.sampling, start_layer=stage.shard.layers.end, audit=self.audited,
            prefix_seed=head.keep.seed if head is not None and head.keep else None, prefix=prefix,
            prompt_call=call,
        )  # fmt: skip
        pending: list[asyncio.Future] = [] if sends is None else sends
        try:
            result = StepResult()
            index = 0
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                last = hi == len(ids)
                piece = Step(session_id, key, lo, route=route, sample=last, ids=tuple(ids[lo:hi]))
                out = await self.local(stage, piece)
                if not route:
                    result = as_result(out)
                    continue
                for start in range(lo, hi, chunk_tokens):
                    end = min(start + chunk_tokens, hi)
                    part = replace(out, hidden=out.hidden[:, start - lo : end - lo])
                    step = Step(
                        session_id, key, start, chunk=index, route=route[1:],
                        open_spec=opening if index == 0 else None, sample=last and end == hi,
                        ids=tuple(ids[start:end]),  # the tail's penalties, head audits
                    )  # fmt: skip
                    pending.append(asyncio.ensure_future(self.send(route[0], part, step)))
                    index += 1
            if pending and sends is None:
                result = (await asyncio.gather(*pending))[-1]
            return result
        except BaseException:
            if sends is None:
                for task in pending:
                    task.cancel()
            raise

    async def local(
        self, stage, step: Step, ahead: Ahead | None = None, lane: LaneStep | None = None
    ) -> StepOutput:
        """``step`` through the head's own layers: its "hop 0", the same type every hop
        runs (its ``ids`` the input, its ``route`` the hops after the head); a sampled step
        puts a token out of it (more where it ran ``ahead``, ADR-0047); ``lane``: the compute
        thread writes it on its decode lane too (ADR-0058)."""
        # The stage is fixed per generation: a reshard swaps service.stage for new sessions.
        self.service.count_served(int(step.sample))  # a sampled step: one more token here
        ids = list(step.ids or ())
        # Made a tensor on the compute thread, which also encodes the output for the next hop
        # (a torch call costs ~0.1 ms on the loop, docs/adr/0011).
        encode = self.service.encoder(step.route[0]) if step.route else None
        if lane is not None:  # and writes the step on its lane
            encode = lane.encoder(encode)  # type: ignore[arg-type]
        out = await self.service.run(stage, step, wire.WireTensor.of_ids(ids), ahead, encode)
        if ahead is not None and out.more:  # the steps it ran ahead: their inputs cached too
            ids += [t.token_id for t in [out.token, *out.more][:-1]]  # type: ignore[union-attr]
        self.note_ids(stage, step, ids)
        return out

    @staticmethod
    def note_ids(stage, step: Step, ids: list[int]) -> None:
        """The ids of the positions from ``step``'s on: they name its cached blocks."""
        if (session := stage.sessions.peek(step.session_id)) is not None:
            stage.sessions.note_ids(session, step.position, ids)

    async def send(self, hop: str, out: StepOutput, step: Step) -> StepResult:
        """``out`` of the head's layers on to ``hop``, the route's first (``step.route``: the
        hops after it); the chain's answer."""
        # A sampled step over 2+ hops: the tail answers here directly too (ADR-0020), where
        # the links are slow enough for it to pay; over one hop the chain's answer is
        # already the direct one.
        if step.sample and step.route and self.service.direct_pays(hop):
            step = replace(step, answer_to=self.service.answer_url)
        return await self.service.send(hop, out.hidden, step, out.frame)

    def concurrent_stages(self, route: tuple[str, ...]) -> int:
        """How many stages of a chain through ``route`` can compute at the same time."""
        threads = self.service.scheduler.threads or torch.get_num_threads()
        return micro_batches(route, threads)

    async def step(
        self, stage, session_id, key, token_ids, position, route, drafts=0, guess_from=None,
        ahead: Ahead | None = None, lanes: bool = True,
    ) -> StepResult:  # fmt: skip
        """One decode step (its last ``drafts`` tokens to verify): local layers, then the
        rest of the chain. Its ids always go along: the tail's penalties count them, and the
        hop after this head audits it with them (docs/adr/0032). ``ahead``: with no route,
        the step may run ahead (ADR-0047). ``lanes``: a plain step may take a decode lane
        (ADR-0058); not while other steps of the session may be in flight on the stream
        (guess steps): the hops must see a session's steps in the order they were sent."""
        # The head splits concurrent sessions into one micro-batch per stage that can compute
        # at the same time as the others (stages sharing this machine: as many as its CPUs run).
        self.service.set_micro_batches(self.concurrent_stages(route))
        step = Step(
            session_id, key, position, route=route, sample=True, ids=tuple(token_ids),
            drafts=drafts, guess_from=guess_from,
        )  # fmt: skip
        onward = replace(step, route=route[1:])
        links = self.service.links
        if route and (running := self._bursts.get(session_id)) is not None:
            # A burst of this session runs ahead down the lane (ADR-0059): its answer.
            if drafts or guess_from is not None:  # never while one runs (``bursting``)
                self._end_burst(session_id)
            elif (result := await self._burst_step(stage, running, step)) is not None:
                return result
        # A lone session's plain step takes a decode lane (ADR-0058), written after the
        # pass; concurrent sessions' steps take the streams, where the hops batch them.
        # One that may run ahead runs ahead down the lane (a burst, ADR-0059).
        lane = None
        direct = step.sample and self.service.answer_url is not None  # ``send`` asks then
        alone = len(stage.sessions) == 1
        if lanes and route and alone and not (direct and self.service.direct_pays(route[0])):
            lane = links.lane_step(route[0], onward, burst=ahead is not None)
            if isinstance(lane, LaneBurst):
                return await self._burst(stage, lane, step, ahead)  # type: ignore[arg-type]
        try:
            out = await self.local(stage, step, None if route else ahead, lane)
        except BaseException:
            if lane is not None:
                lane.forget()
            raise
        if not route:  # head is also the tail
            return as_result(out)
        result = None
        if lane is not None:
            result = await links.lane_answer(route[0], lane)
        return await self._sent(out, step, result)

    async def _sent(self, out: StepOutput, step: Step, result: StepResult | None) -> StepResult:
        """``result``, or, where there is none (no lane, or the hops sent the step back to
        the stream unrun), the chain's answer to ``out`` sent on the stream; the head's
        compute first."""
        if result is None:
            result = await self.send(step.route[0], out, replace(step, route=step.route[1:]))
        result.compute_ms.insert(0, out.compute_s * 1000)
        return result

    async def _burst(self, stage, burst: LaneBurst, step: Step, ahead: Ahead) -> StepResult:
        """``step`` run ahead down its lane (ADR-0059): the pass that runs the burst goes
        on after this step's answer, which comes back as soon as it is in."""
        self._bursts[step.session_id] = burst
        task = asyncio.ensure_future(self.local(stage, step, replace(ahead, down=burst)))
        burst.started(task)
        task.add_done_callback(functools.partial(self._burst_ended, step.session_id, burst))
        result = await self._burst_step(stage, burst, step, first=True)
        if result is not None:
            return result
        out = await task  # it ran as a plain step, or the first hop refused it: the stream
        return await self._sent(out, step, None)

    async def _burst_step(
        self, stage, burst: LaneBurst, step: Step, first: bool = False
    ) -> StepResult | None:
        """The answer of a burst's step at ``step.position``; None where the burst ended
        before it (or was refused there): the step runs the plain way."""
        result = None
        try:
            got = await burst.take(step.position)
            if got is not None:
                result = self.service.links.burst_step(step.route[0], got)
        finally:
            if result is None:  # ended, refused, failed or left: no later step follows
                self._end_burst(step.session_id)
        if result is None:
            return None
        if not first:  # counted and named as ``local`` does the first step
            self.service.count_served(int(step.sample))
            self.note_ids(stage, step, list(step.ids or ()))
            self.service.metrics.lane_ahead_steps.inc()
        result.compute_ms.insert(0, got.head_ms)  # type: ignore[union-attr]
        return result

    def _end_burst(self, session_id: str, then: Callable[[], None] | None = None) -> None:
        """Stop the session's burst, if one runs (it is forgotten once its pass ended);
        ``then()`` once that pass ended, at once where none runs."""
        burst = self._bursts.get(session_id)
        task = None if burst is None else burst.task
        if burst is not None:
            burst.forget()
        if then is None:
            return
        if task is None or task.done():
            then()
        else:
            task.add_done_callback(lambda _: then())

    def _burst_ended(self, session_id: str, burst: LaneBurst, task: asyncio.Future) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: raised where the step is taken (``_burst``)
        if self._bursts.get(session_id) is burst:
            del self._bursts[session_id]

    async def close(self, stage, session_id: str, key: str, route: tuple[str, ...]) -> None:
        """Free the session here and on every hop of ``route`` (its prefix stays cached);
        here once a burst of its steps (ADR-0059) stopped."""
        self._end_burst(session_id, lambda: stage.close_session(session_id, keep=True))
        if route:
            # Shielded: a client disconnect cancels us, but the hops must still be freed.
            await asyncio.shield(self.service.close_remote(route[0], session_id, key, route[1:]))


def as_result(out: StepOutput) -> StepResult:
    """A pass of a head that is also the tail, as the chain's answer (built from the
    sampler's own values, unvalidated: pydantic's checks cost ~70 us a token on a CPU that
    idled, as ``answer_bytes.decode`` does for a hop's answer)."""
    compute_ms = [out.compute_s * 1000]
    if out.token is None:
        return StepResult.model_construct(compute_ms=compute_ms)
    token = out.token
    return StepResult.model_construct(
        token_id=token.token_id,
        logprob=token.logprob,
        top_logprobs=token.top_logprobs,
        prompt_logprobs=token.prompt_logprobs,
        more=None
        if out.more is None
        else [(t.token_id, t.logprob, t.top_logprobs) for t in out.more],  # fmt: skip
        compute_ms=compute_ms,
    )

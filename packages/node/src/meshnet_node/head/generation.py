"""Head-side generation: tokenize, stream the prompt down the chain in chunks, decode.

The head holds the first layers locally; every later hop is reached over HTTP through
``NodeService.send``. Prefill is pipelined: chunk ``i`` travels downstream while the head
computes chunk ``i + 1`` (nodes put early-arriving chunks back in order).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import torch

from meshnet_common.errors import HopError, ModelNotCovered
from meshnet_common.logs import bind_session
from meshnet_common.protocol import SamplingSpec, StepResult
from meshnet_node.dataplane.batching import micro_batches
from meshnet_node.dataplane.service import NodeService
from meshnet_node.engine.stage import Stage, StepOutput
from meshnet_node.head.failover import (
    FAILOVER_BAN_S,
    FAILOVER_POLICY,
    ComputedWrong,
    Failover,
    _Chain,
)
from meshnet_node.head.params import sampling_defaults
from meshnet_node.head.text import TextAssembler, skips_special_tokens
from meshnet_node.head.timings import RouteTimes, StepTimings
from meshnet_node.retry import BanList, Clock, RetryPolicy
from meshnet_node.speculation.drafting import (
    DraftPolicy,
    Speculation,
    SpeculationSettings,
    speculates,
)
from meshnet_node.speculation.guessing import GuessFlight, GuessSteps

logger = logging.getLogger(__name__)


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


@dataclass
class GeneratedToken:
    """One step of output: the token, the text it adds, and why generation ended (if it did)."""

    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    timing: dict | None = None  # on the last token: where decode time went (StepTimings)
    # on the first token, when the request scores its prompt: the tail's entries, one per
    # prompt token after the first (log-probability, top alternatives)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


def eos_ids(tokenizer, generation_config) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return ids


Reroute = Callable[[frozenset[str]], Awaitable[tuple[str, ...]]]

# Prefill: tokens the head runs through its layers per pass before sending them on in wire
# chunks (ADR 0010). Larger passes cost less per token; smaller ones start the next hop sooner.
PREFILL_PIECE_TOKENS = 512


class HeadGenerator(Failover, GuessSteps):
    """Drives generation from a head stage through the hops of a route (failing over to
    another when a hop dies: ``Failover``)."""

    def __init__(
        self,
        service: NodeService,
        tokenizer,
        generation_config=None,
        *,
        failover: RetryPolicy = FAILOVER_POLICY,
        ban_s: float = FAILOVER_BAN_S,
        clock: Clock = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        speculation: SpeculationSettings = SpeculationSettings(),
        draft_model=None,
        coverage_wait_s: float = 30.0,
        verifier=None,
    ) -> None:
        if not service.stage.shard.is_head:
            raise ValueError("only a head stage can drive generation")
        self.service = service
        self.tokenizer = tokenizer
        self.eos = eos_ids(tokenizer, generation_config)
        self.skip_special_tokens = skips_special_tokens(tokenizer)  # the model's default
        self.sampling_defaults = sampling_defaults(generation_config)
        self.failover = failover
        self.clock = clock
        self.sleep = sleep
        self.bans = BanList(ban_s, clock)  # failed hops, per head process
        self.speculation = speculation
        self.draft_policy = DraftPolicy(speculation.max_draft)  # this head's step costs
        self.draft_model = draft_model  # proposes drafts instead of the n-gram lookup
        self.running = 0  # generations under way (drafting pauses when many are)
        self.coverage_wait_s = coverage_wait_s  # how long a failover waits for missing layers
        self.verifier = verifier  # audits a fraction of decode steps (docs/adr/0026)
        self.route_times = RouteTimes()  # plain decode steps per route, for heartbeats

    def suspects(self) -> frozenset[str]:
        """Hops an audit of this head found computing wrong."""
        return self.verifier.suspects() if self.verifier is not None else frozenset()

    def avoided(self) -> frozenset[str]:
        """Hops new routes must avoid: failed ones (banned for a while) and suspects."""
        return self.bans.banned() | self.suspects()

    @property
    def context_window(self) -> int:
        return self.service.stage.max_positions

    async def generate(
        self,
        request: GenerationRequest,
        route: tuple[str, ...],
        reroute: Reroute | None = None,
    ) -> AsyncIterator[GeneratedToken]:
        """Yield tokens until max_tokens, EOS or a stop string; frees sessions on every exit.

        When a hop fails, ``reroute`` (given the hops to avoid) supplies a new route and the
        chain is rebuilt by replaying the history — prompt plus tokens so far — from position
        0 in a fresh session, so every hop's positions and KV cache stay consistent.
        """
        stage = self.service.stage
        if not stage.shard.is_head:  # resharded away from the first layers
            raise ModelNotCovered("this node no longer serves the first layers", code="not_head")
        if not route and not stage.shard.is_tail:
            raise ValueError("a head that is not the tail needs a route")
        chain = _Chain(route=route)
        self._open_local(stage, chain, request)
        assembler = TextAssembler(
            self.tokenizer, request.stop, skip_special_tokens=request.skip_special_tokens
        )
        history = list(request.prompt_ids)  # the tokens every hop's cache holds
        metrics = self.service.metrics
        timings = StepTimings()
        speculation = None
        if speculates(request.sampling, self.speculation.mode):
            model = self.draft_model
            speculation = Speculation(self.draft_policy, model.session() if model else None)
        flight = None  # guess steps in flight (ADR-0019): greedy n-gram speculation only
        if speculation is not None and speculation.model_session is None:
            depth = self.speculation.guess_depth
            flight = GuessFlight(depth) if depth > 1 else None
        self.running += 1
        try:
            with metrics.timer(metrics.prefill_seconds):
                result = await self._advance(stage, chain, request, history, None, reroute)
            scored = result.prompt_logprobs  # a replay scores it again: the first one counts
            produced = 0
            while True:
                outputs = _tokens_of(result)  # one, or the drafts the tail kept and one more
                for token, logprob, top in outputs:
                    produced += 1
                    ends = (token in self.eos and not request.ignore_eos) or (
                        token in request.stop_ids
                    )
                    # the end-of-sequence token is never text, even when special tokens are
                    delta, hit_stop = ("", False) if ends else assembler.add(token)
                    finish = None
                    if hit_stop or ends:
                        finish = "stop"
                    elif produced == request.max_tokens:
                        finish = "length"
                    if finish is not None:
                        delta += assembler.finish()
                    yield GeneratedToken(
                        token, delta, logprob, top, finish,
                        timings.summary() if finish is not None else None,
                        scored if produced == 1 else None,
                    )  # fmt: skip
                    if finish is not None:
                        return
                history.extend(t for t, _, _ in outputs[:-1])  # kept drafts: in every cache
                token = outputs[-1][0]  # the next step's input
                if flight is not None and (len(flight) or self._guesses(chain)):
                    room = min(request.max_tokens - produced - 1,
                               self.context_window - len(history) - 2)  # fmt: skip
                    result = await self._guessed_step(
                        stage, chain, request, history, token, reroute, flight,
                        speculation, room, timings,
                    )  # fmt: skip
                    history.append(token)
                    continue
                drafts: list[int] = []
                started, failovers = time.perf_counter(), chain.failovers
                if speculation is not None and self.running <= self.speculation.max_running:
                    room = min(
                        request.max_tokens - produced - 1,
                        self.context_window - len(history) - 2,
                    )  # fmt: skip
                    k = speculation.length(room)
                    if k and speculation.model_session is not None:  # compute: not here
                        drafts = await self.service.compute(
                            speculation.propose, [*history, token], k
                        )
                    else:
                        drafts = speculation.propose([*history, token], k)
                drafted_at = time.perf_counter()
                try:
                    result = await self._advance(
                        stage, chain, request, history, token, reroute, drafts
                    )
                finally:
                    elapsed = time.perf_counter() - started
                    metrics.decode_seconds.observe(elapsed)
                drafting_s = drafted_at - started  # a draft model's time: part of the step
                if self.verifier is not None:
                    self.verifier.after_step(chain)
                if chain.failovers == failovers:  # a replayed step says nothing of overhead
                    if drafts and result.more is None:
                        raise HopError(
                            "the tail did not verify the step's drafts (a node of an older "
                            "version?); start it with the swarm's version or the head with "
                            "--speculative off", status=502,
                        )  # fmt: skip
                    timings.add(elapsed - drafting_s, result.compute_ms, len(chain.route))
                    if not drafts:  # a plain step: what the tracker's cost model predicts
                        self.route_times.add(chain.route, elapsed - drafting_s)
                    kept = len(result.more or ())
                    self.service.tokens_served += kept  # the kept drafts: tokens here too
                    if speculation is not None:
                        compute_s = (  # every hop's compute, and the drafting
                            sum(result.compute_ms) / 1000 + drafting_s
                            if result.compute_ms else None
                        )  # fmt: skip
                        speculation.settle(len(drafts), kept, elapsed, compute_s)
                    if drafts:
                        metrics.draft_tokens.inc(len(drafts))
                        metrics.accepted_tokens.inc(kept)
                    metrics.tokens_per_step.observe(1 + kept)
                history.append(token)
        finally:
            self.running -= 1
            if flight is not None:
                # Not awaited: a client that left cancels every await from here on (the
                # server's cancel scope), and the sessions must close all the same.
                flight.cancel()
                if rest := flight.finish():
                    metrics.tokens_per_step.observe(rest)
            await self._close(stage, chain.session_id, chain.key, chain.route)

    def _open_local(self, stage: Stage, chain: _Chain, request: GenerationRequest) -> None:
        chain.session_id = uuid.uuid4().hex
        chain.key = secrets.token_hex(16)
        bind_session(chain.session_id)  # this generation's log lines carry its session
        stage.open_session(
            chain.session_id,
            sampling=request.sampling,
            owner=chain.key,
        )

    async def _advance(
        self,
        stage: Stage,
        chain: _Chain,
        request: GenerationRequest,
        history: list[int],
        token: int | None,
        reroute: Reroute | None,
        drafts: list[int] | None = None,
    ) -> StepResult:
        """Prefill (``token`` None) or one decode step (with ``drafts`` for the chain to
        verify), failing over to a new route if a hop dies: bounded attempts, capped
        exponential backoff, an overall deadline. A replay verifies no drafts."""
        if chain.budget is None:  # the limits hold for the whole request, not per step
            chain.budget = self.failover.start(self.clock)
        while True:
            phase = "prefill" if token is None or chain.replay else "decode"
            try:
                if chain.convicted is not None:  # an audit found it computing wrong
                    convicted, chain.convicted = chain.convicted, None
                    raise ComputedWrong(f"hop {convicted} computed wrong (an audit, "
                                        "docs/adr/0026)", hop=convicted)  # fmt: skip
                if token is None:  # the prompt (again, in a fresh session, after a failover)
                    chain.replay = False
                    return await self._prefill(
                        stage, chain.session_id, chain.key, request, chain.route
                    )
                if chain.replay:  # a fresh session: rebuild every cache as it was built
                    await self._replay(stage, chain, request)
                    chain.replay = False
                inputs = [token, *(drafts or ())]
                result = await self._step(
                    stage, chain.session_id, chain.key, inputs, len(history), chain.route,
                    drafts=len(drafts or ()),
                )  # fmt: skip
                chain.passes.append((len(history), inputs, len(drafts or ())))
                return result
            except HopError as exc:
                may_retry = chain.budget.failed()
                if reroute is None or not exc.recoverable or not may_retry:
                    raise
                await self._abandon(stage, chain, exc, phase)
                await self._reroute(stage, chain, request, exc, reroute)

    async def _prefill(
        self,
        stage: Stage,
        session_id: str,
        key: str,
        request: GenerationRequest,
        route: tuple[str, ...],
        sends: list[asyncio.Future] | None = None,
    ) -> StepResult:
        """Run the prompt through the local layers in pieces and send it on in wire chunks.

        The first piece is one wire chunk, so the next hops start early; later pieces are
        ``PREFILL_PIECE_TOKENS`` long, since one pass over several chunks is much cheaper
        than several passes. Each wire chunk's send overlaps the next piece's compute (the
        next hop merges chunks that wait for it the same way). With no route, the whole
        prompt runs in passes as large as the stage allows. ``sends``: collect the chunks'
        sends there and return without waiting for them (a replay, docs/adr/0023).
        """
        chunk_tokens = stage.max_chunk_tokens
        ids = request.prompt_ids
        if route:
            piece = max(chunk_tokens, PREFILL_PIECE_TOKENS // chunk_tokens * chunk_tokens)
            bounds = [0, *range(chunk_tokens, len(ids), piece), len(ids)]
        else:
            bounds = [*range(0, len(ids), stage.max_merge_tokens), len(ids)]
        bounds = sorted(set(b for b in bounds if b <= len(ids)))
        open_spec = {
            **request.sampling.model_dump(),
            "start_layer": stage.shard.layers.end,
        }
        if self.verifier is not None:  # every hop keeps the session's inputs for audits
            open_spec["audit"] = True
        pending: list[asyncio.Future] = [] if sends is None else sends
        try:
            result = StepResult()
            index = 0
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                last = hi == len(ids)
                out = await self._local(stage, session_id, key, ids[lo:hi], lo, last)
                if not route:
                    result = _as_result(out)
                    continue
                for start in range(lo, hi, chunk_tokens):
                    end = min(start + chunk_tokens, hi)
                    part = replace(out, hidden=out.hidden[:, start - lo : end - lo])
                    send = self._send(
                        part, session_id, key, start, route, index, last and end == hi,
                        open_spec if index == 0 else None,
                        ids=tuple(ids[start:end]),  # the tail's penalties, head audits
                    )  # fmt: skip
                    pending.append(asyncio.ensure_future(send))
                    index += 1
            if pending and sends is None:
                result = (await asyncio.gather(*pending))[-1]
            return result
        except BaseException:
            if sends is None:
                for task in pending:
                    task.cancel()
            raise

    async def _local(
        self, stage, session_id, key, token_ids, position, sample, drafts=0, guess_from=None
    ) -> StepOutput:
        # The stage is fixed per generation: a reshard swaps service.stage for new sessions.
        self.service.tokens_served += sample  # a sampled step: one more token through the head
        return await self.service.run_stage(
            stage,
            session_id,
            position,
            token_ids=torch.tensor([token_ids], dtype=torch.int64),
            owner=key,
            sample=sample,
            drafts=tuple(token_ids[len(token_ids) - drafts :]) if drafts else (),
            guess_from=guess_from,
        )

    async def _send(
        self, out, session_id, key, position, route, chunk, sample, open_spec, ids=None,
        drafts=0, replay_pass=0, guess_from=None,
    ):  # fmt: skip
        # A sampled step over 2+ hops: the tail answers here directly too (ADR-0020), where
        # the links are slow enough for it to pay; over one hop the chain's answer is
        # already the direct one.
        direct = None
        if sample and len(route) >= 2 and self.service.direct_pays(route[0]):
            direct = self.service.answer_url
        return await self.service.send(
            route[0],
            out.hidden,
            session_id=session_id,
            session_key=key,
            position=position,
            chunk=chunk,
            route=route[1:],
            sample=sample,
            open_spec=open_spec,
            ids=ids,
            drafts=drafts,
            answer_to=direct,
            replay_pass=replay_pass,
            guess_from=guess_from,
        )

    async def _step(
        self, stage, session_id, key, token_ids, position, route, drafts=0, guess_from=None,
    ):  # fmt: skip
        """One decode step (its last ``drafts`` tokens to verify): local layers, then the
        rest of the chain. Its ids always go along: the tail's penalties count them, and the
        hop after this head audits it with them (docs/adr/0032)."""
        # The head splits concurrent sessions into one micro-batch per stage that can compute
        # at the same time as the others (stages sharing this machine: as many as its CPUs run).
        self.service.batcher.depth = micro_batches(
            route, self.service.settings.threads or torch.get_num_threads()
        )
        out = await self._local(
            stage, session_id, key, token_ids, position, True, drafts, guess_from
        )
        if not route:  # head is also the tail
            return _as_result(out)
        result = await self._send(
            out, session_id, key, position, route, 0, True, None, drafts=drafts,
            ids=tuple(token_ids),
            guess_from=guess_from,
        )  # fmt: skip
        result.compute_ms.insert(0, out.compute_s * 1000)
        return result

    async def _close(self, stage, session_id: str, key: str, route: tuple[str, ...]) -> None:
        stage.close_session(session_id)
        if route:
            # Shielded: a client disconnect cancels us, but the hops must still be freed.
            await asyncio.shield(self.service.close_remote(route[0], session_id, key, route[1:]))


def _as_result(out: StepOutput) -> StepResult:
    compute_ms = [out.compute_s * 1000]
    if out.token is None:
        return StepResult(compute_ms=compute_ms)
    token = out.token
    return StepResult(
        token_id=token.token_id,
        logprob=token.logprob,
        top_logprobs=token.top_logprobs,
        prompt_logprobs=token.prompt_logprobs,
        more=None
        if out.more is None
        else [(t.token_id, t.logprob, t.top_logprobs) for t in out.more],  # fmt: skip
        compute_ms=compute_ms,
    )


def _tokens_of(result: StepResult) -> list[tuple[int, float | None, list]]:
    """A step's tokens in order: the first, then those after it (kept drafts, one more)."""
    first = (int(result.token_id), result.logprob, result.top_logprobs)
    return [first, *((int(t), lp, list(top)) for t, lp, top in result.more or ())]

"""Head-side generation: tokenize, run the prompt and every decode step down the chain
(``HeadPasses``), turn the tail's tokens into text, with drafts, guess steps
(``GuessSteps``) and failover (``Failover``) as the request allows."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from transformers import GenerationConfig

from meshnet_common.errors import HopError, ModelNotCovered
from meshnet_common.protocol import StepResult
from meshnet_node.dataplane.lane_burst import LANE_AHEAD_TOKENS
from meshnet_node.dataplane.service import NodeService
from meshnet_node.engine.ahead import AHEAD_TOKENS, Ahead
from meshnet_node.head.chain import Chain, GenerationRequest, HeadPasses
from meshnet_node.head.failover import FAILOVER_BAN_S, FAILOVER_POLICY, Failover, Reroute
from meshnet_node.head.params import sampling_defaults
from meshnet_node.head.text import TextAssembler, skips_special_tokens
from meshnet_node.head.timings import RouteTimes, StepTimings
from meshnet_node.retry import Clock, RetryPolicy
from meshnet_node.speculation.drafting import (
    DraftPolicy,
    Speculation,
    SpeculationSettings,
    speculates,
)
from meshnet_node.speculation.guessing import GuessFlight, GuessSteps, guess_depth


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
    cached_tokens: int | None = None  # on the first token: prompt tokens from the prefix cache


# Tokens that end a generation by their text, in a GGUF (llama.cpp's list, llama-vocab.cpp):
# llama.cpp's converter writes only the end-of-text id for most chat models, and llama.cpp
# stops at the end of a turn by its token's text (Gemma's <end_of_turn>, ChatML's <|im_end|>).
GGUF_END_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)  # fmt: skip


def gguf_generation_config(config, tokenizer) -> GenerationConfig:
    """A GGUF's generation config: from its model config (its token ids are in its metadata),
    ending where llama.cpp ends a generation (``gguf_end_ids``)."""
    generation_config = GenerationConfig.from_model_config(config)
    generation_config.eos_token_id = gguf_end_ids(tokenizer, generation_config.eos_token_id)
    return generation_config


def gguf_end_ids(tokenizer, eos: int | list[int] | None) -> list[int]:
    """A GGUF's end-of-generation tokens, as llama.cpp has them: the ids its metadata names
    (``eos``: end of text, turn, message) and every token whose text is one of
    ``GGUF_END_TEXTS``."""
    ids = [eos] if isinstance(eos, int) else list(eos or ())
    vocab = tokenizer.get_vocab()
    ids += [vocab[text] for text in GGUF_END_TEXTS if text in vocab]
    return sorted(set(ids))


def eos_ids(tokenizer, generation_config) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return ids


class HeadGenerator:
    """Drives generation from a head stage through the hops of a route. Its parts: the
    passes it runs (``passes``), failing over when a hop dies (``failover``), and guess
    steps (``guess_steps``)."""

    def __init__(
        self,
        service: NodeService,
        tokenizer,
        generation_config=None,
        *,
        failover_policy: RetryPolicy = FAILOVER_POLICY,
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
        self.settings = service.settings  # the node's: what requests may ask, for serving
        self.metrics = service.metrics
        self.speculation = speculation
        self.draft_policy = DraftPolicy(speculation.max_draft)  # this head's step costs
        self.draft_model = draft_model  # proposes drafts instead of the n-gram lookup
        self.running = 0  # generations under way (drafting pauses when many are)
        self.verifier = verifier  # audits a fraction of decode steps (docs/adr/0026)
        self.route_times = RouteTimes()  # plain decode steps per route, for heartbeats
        self.passes = HeadPasses(service, audited=verifier is not None)
        self.failover = Failover(
            self.passes, service, policy=failover_policy, ban_s=ban_s, clock=clock, sleep=sleep,
            coverage_wait_s=coverage_wait_s, suspects=self.suspects,
        )  # fmt: skip
        # Guess steps are in flight together: all on the stream, in order (no decode lane).
        guessing = functools.partial(self.passes.step, lanes=False)
        self.guess_steps = GuessSteps(guessing, service.metrics, self._may_guess)

    def suspects(self) -> frozenset[str]:
        """Hops an audit of this head found computing wrong."""
        return self.verifier.suspects() if self.verifier is not None else frozenset()

    def _may_guess(self) -> bool:
        """No audit under way and few generations on this head (with many, batched decoding
        keeps the hops busy already, and a stale guess would cost them a row)."""
        return self.verifier is None and self.running <= self.speculation.max_running

    async def route(self, reroute: Reroute) -> tuple[str, ...]:
        """A route for a new request from ``reroute``, avoiding the hops this head avoids
        and waiting for missing layers expected back (``Failover.first_route``)."""
        return await self.failover.first_route(reroute)

    @property
    def context_window(self) -> int:
        """The model's context: the longest sequence its positions allow."""
        return self.service.stage.max_positions

    @property
    def kv_budget_tokens(self) -> int:
        """Tokens this node's KV budget holds: no sequence can be longer, even alone."""
        return self.service.stage.sessions.kv_budget_tokens

    @property
    def vocab_size(self) -> int:
        return self.service.stage.shard.vocab_size

    @property
    def draining(self) -> str | None:
        """Why this node takes no new requests (it leaves the swarm), else None."""
        return self.service.draining

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
        speculation = None
        if speculates(request.sampling, self.speculation.mode):
            model = self.draft_model
            speculation = Speculation(self.draft_policy, model.session() if model else None)
        flight = None  # guess steps in flight (ADR-0019): greedy n-gram speculation only
        if speculation is not None and speculation.model_session is None:
            rtt_ms = await self.service.links.round_trip_ms(route[0]) if route else 0.0
            decode_s = self.service.scheduler.decode_s  # this stage's last decode pass
            depth = guess_depth(
                self.speculation.guess_depth, len(route) + 1,
                self.passes.concurrent_stages(route), rtt_ms,
                None if decode_s is None else decode_s * 1000,
                bool(route) and self.service.links.lane_expected(route[0]),
            )  # fmt: skip
            flight = GuessFlight(depth) if depth > 1 else None
        chain = Chain(route=route)  # from here every exit frees its sessions
        self.passes.open(stage, chain, request)
        assembler = TextAssembler(
            self.tokenizer, request.stop, skip_special_tokens=request.skip_special_tokens
        )
        history = list(request.prompt_ids)  # the tokens every hop's cache holds
        metrics = self.metrics
        timings = StepTimings()
        self.running += 1
        try:
            with metrics.timer(metrics.prefill_seconds):
                result = await self.failover.advance(stage, chain, request, history, None, reroute)
            # A step's time is from the answer before it to its own, less the time the client
            # held the generator (``paused``, at its yields): where a burst runs ahead
            # (ADR-0059) a step's answer may be in before the loop asks for it.
            answered, paused = time.perf_counter(), 0.0
            scored = result.prompt_logprobs  # a replay scores it again: the first one counts
            head = stage.sessions.peek(chain.session_id)
            cached = head.cached_tokens if head is not None else 0  # docs/adr/0035
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
                    held = time.perf_counter()
                    yield GeneratedToken(
                        token, delta, logprob, top, finish,
                        timings.summary() if finish is not None else None,
                        scored if produced == 1 else None, cached if produced == 1 else None,
                    )  # fmt: skip
                    paused += time.perf_counter() - held
                    if finish is not None:
                        return
                history.extend(t for t, _, _ in outputs[:-1])  # kept drafts: in every cache
                token = outputs[-1][0]  # the next step's input
                # While its steps run ahead down the lane (ADR-0059), the next are plain.
                bursting = self.passes.bursting(chain.session_id)
                guess = flight is not None and not bursting
                if guess and (len(flight) or self.guess_steps.allowed(chain)):  # type: ignore[arg-type]
                    room = min(request.max_tokens - produced - 1,
                               self.context_window - len(history) - 2)  # fmt: skip
                    result = await self._guessed_step(
                        stage, chain, request, history, token, reroute, flight,
                        speculation, room, timings,
                    )  # fmt: skip
                    history.append(token)
                    answered, paused = time.perf_counter(), 0.0
                    continue
                drafts: list[int] = []
                started, failovers = time.perf_counter(), chain.failovers
                drafting = speculation is not None and not bursting
                if drafting and self.running <= self.speculation.max_running:
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
                ahead = self._ahead(chain, request, produced, history) if not drafts else None
                try:
                    result = await self.failover.advance(
                        stage, chain, request, history, token, reroute, drafts, ahead
                    )
                finally:
                    now = time.perf_counter()
                    elapsed = now - answered - paused
                    answered, paused = now, 0.0
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
                    kept = len(result.more or ())
                    timings.add(elapsed - drafting_s, result.compute_ms, len(chain.route),
                                steps=1 if drafts else 1 + kept)  # fmt: skip
                    if not drafts:  # a plain step: what the tracker's cost model predicts
                        self.route_times.add(chain.route, (elapsed - drafting_s) / (1 + kept))
                    self.service.count_served(kept)  # the kept drafts: tokens here too
                    if speculation is not None:
                        compute_s = (  # every hop's compute, and the drafting
                            sum(result.compute_ms) / 1000 + drafting_s
                            if result.compute_ms else None
                        )  # fmt: skip
                        steps = 1 if drafts else 1 + kept  # ran ahead (ADR-0047): per step
                        speculation.settle(
                            len(drafts), kept if drafts else 0, elapsed / steps,
                            None if compute_s is None else compute_s / steps,
                        )  # fmt: skip
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
            await self.passes.close(stage, chain.session_id, chain.key, chain.route)

    def _ahead(
        self, chain: Chain, request: GenerationRequest, produced: int, history: list[int]
    ) -> Ahead | None:
        """How far a plain step may run ahead (ADR-0047; with a route, down its decode lane:
        ADR-0059): only where no audit replays steps one by one."""
        if self.verifier is not None:
            return None
        most = LANE_AHEAD_TOKENS if chain.route else AHEAD_TOKENS
        room = min(request.max_tokens - produced - 1, self.context_window - len(history) - 2, most)
        if room < 1:
            return None
        ends = request.stop_ids if request.ignore_eos else request.stop_ids | self.eos
        return Ahead(room, frozenset(ends))

    async def _guessed_step(
        self, stage, chain: Chain, request: GenerationRequest, history: list[int], token: int,
        reroute: Reroute | None, flight: GuessFlight, speculation: Speculation, room: int,
        timings: StepTimings,
    ) -> StepResult:  # fmt: skip
        """The step for ``token`` through the guess steps; when a hop fails, the chain
        fails over and the step runs again, plainly."""
        try:
            return await self.guess_steps.step(
                stage, chain, history, token, flight, speculation, room, timings
            )
        except HopError as exc:
            if reroute is None or not exc.recoverable or not chain.budget.failed():
                raise
            await self.failover.fail_over(stage, chain, request, exc, reroute, "decode")
            return await self.failover.advance(stage, chain, request, history, token, reroute)


def _tokens_of(result: StepResult) -> list[tuple[int, float | None, list]]:
    """A step's tokens in order: the first, then those after it (kept drafts, one more)."""
    first = (int(result.token_id), result.logprob, result.top_logprobs)
    return [first, *((int(t), lp, list(top)) for t, lp, top in result.more or ())]

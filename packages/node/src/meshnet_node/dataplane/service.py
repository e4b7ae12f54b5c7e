"""The node's data path: run a forward step on the local stage and relay it down the chain;
pipelined prefill chunks taken in order (and merged into one pass when they wait).

``NodeService`` receives, submits and relays: it holds its parts by reference, each owning
its data: the compute scheduler (``scheduler``: where and when every pass runs, docs/adr/0039)
and the links to other nodes (``links``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import replace

import torch

from meshnet_common import wire
from meshnet_common.errors import (
    Draining,
    InvalidRequest,
    MeshnetError,
    NotFound,
    Quarantined,
)
from meshnet_common.metrics import Metrics
from meshnet_common.protocol import H_OPEN, H_ROUTE, StepResult, append_compute, format_compute
from meshnet_common.trust.identity import Identity
from meshnet_common.web import tls
from meshnet_common.web.auth import swarm_headers
from meshnet_node.caching.blocks import BLOCK_TOKENS, PrefixPlan
from meshnet_node.dataplane import answer_bytes
from meshnet_node.dataplane.chunk_order import ChunkOrder, Waiting
from meshnet_node.dataplane.link_speeds import LinkSpeeds
from meshnet_node.dataplane.links import HopLinks
from meshnet_node.dataplane.steps import Step, StepAnswer, stale_guess
from meshnet_node.dataplane.streams import StreamHops
from meshnet_node.engine.ahead import Ahead
from meshnet_node.engine.stage import DecodeItem, Stage, StepOutput
from meshnet_node.engine.step_io import is_decode_input
from meshnet_node.scheduling.scheduler import ComputeScheduler
from meshnet_node.settings import NodeSettings


class NodeService:
    """Owns the stage, its compute scheduler and its links to the next hops.

    ``before_pass``: a fault composed at start-up for tests (``engine.faults.SlowCompute``,
    ``--step-delay-ms``), run before every compute pass; None in a real node."""

    def __init__(
        self, stage: Stage, settings: NodeSettings, *, model_id: str,
        metrics: Metrics | None = None, identity: Identity | None = None,
        before_pass: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.stage = stage
        self.retiring: Stage | None = None  # the previous shard, kept until its sessions end
        self.settings = settings
        self.model_id = model_id
        level = settings.zstd_level  # None: 1, raw on links measured fast (ADR-0057)
        self.wire_options = wire.WireOptions(zstd_level=1 if level is None else level)
        self.metrics = metrics or Metrics()
        self.identity = identity  # signs this node's calls to peers (docs/adr/0032)
        self.scheduler = ComputeScheduler(
            max_batch=settings.max_decode_batch, turn_max_s=settings.turn_max_ms / 1000.0,
            before_pass=before_pass,
        )  # fmt: skip
        t = settings.timeouts
        hops = StreamHops(
            headers=swarm_headers(settings.swarm_token), connect_timeout=t.connect,
            ping_interval=settings.stream_ping_s, ssl=tls.stream_context(),
            https_only=settings.tls_cert is not None, identity=identity)  # fmt: skip
        self.links = HopLinks(
            hops, metrics=self.metrics, timeouts=t, direct_min_rtt_ms=settings.direct_min_rtt_ms,
            speeds=LinkSpeeds(self.wire_options, auto=level is None),
        )  # fmt: skip
        # Prompt chunks in order, gathered into their calls; a replay's passes in order.
        self.order = ChunkOrder(lambda sid: self.stage_for(sid).sessions.peek(sid), settings)
        # Tail: each session's latest step, done once it computed (or was found stale): a
        # guess step is judged only after the session's earlier steps ran here.
        self._tail_steps: dict[str, asyncio.Future] = {}
        self._generated = 0  # sampled here (tail), beside those of lanes
        self._served = 0  # sampled steps run here: tokens generated through this stage
        self.answer_url: str | None = None  # where tails answer this head (set when it is one)
        self.draining: str | None = None  # this node's URL once it drains (docs/adr/0024)
        self.quarantined: tuple[str, str] | None = None  # (its URL, why) once quarantined: ADR-0026
        self.head_audit = None  # audits of the head feeding this node (docs/adr/0032)
        self.lanes = None  # its decode lanes (``lane_ends.LaneEnds``, docs/adr/0058), if any

    # -- what the head and the heartbeat use -------------------------------------------------

    def set_micro_batches(self, depth: int) -> None:
        """How many micro-batches a head keeps in flight (``micro_batches``)."""
        self.scheduler.set_depth(depth)

    def count_served(self, tokens: int) -> None:
        """``tokens`` more generated through this stage (sampled steps, kept drafts)."""
        self._served += tokens

    @property
    def tokens_served(self) -> int:
        """Tokens generated through this stage: sampled steps run here (lanes' too)."""
        relay = self.lanes.relay if self.lanes is not None else None
        return self._served + (relay.served if relay is not None else 0)

    @property
    def tokens_generated(self) -> int:
        """Tokens sampled here (a tail), lanes' too."""
        relay = self.lanes.relay if self.lanes is not None else None
        return self._generated + (relay.generated if relay is not None else 0)

    @property
    def layer_ms(self) -> float | None:
        """The last decode pass's compute per layer of this stage, in ms (None: unknown)."""
        decode_s = self.scheduler.decode_s
        if decode_s is None:
            return None
        return decode_s * 1000 / max(1, len(self.stage.shard.layers))

    def compute(self, fn, *args, **kwargs) -> Awaitable:
        """Run ``fn`` on the compute thread, in its turn."""
        return self.scheduler.run(fn, *args, **kwargs)

    # The head's calls to the next hops, handed to ``links`` as they are (no coroutine of
    # their own: a decode step pays per call on the path, docs/adr/0011).

    def send(
        self, hop: str, hidden: torch.Tensor, step: Step, frame: bytes | None = None
    ) -> Awaitable[StepResult]:
        return self.links.send(hop, hidden, step, frame)

    def encoder(self, hop: str) -> Callable[[torch.Tensor], bytes]:
        return self.links.encoder(hop)

    def direct_pays(self, hop: str) -> bool:
        return self.links.direct_pays(hop)

    def reachable(self, url: str) -> Awaitable[bool]:
        return self.links.reachable(url)

    def close_remote(self, hop: str, session_id: str, key: str, route) -> Awaitable[None]:
        return self.links.close_remote(hop, session_id, key, route)

    def stage_for(self, session_id: str) -> Stage:
        """The stage holding ``session_id``: sessions opened before a reshard stay put."""
        retiring = self.retiring
        if retiring is not None and retiring.sessions.peek(session_id) is not None:
            return retiring
        return self.stage

    def swap(self, stage: Stage) -> None:
        """Serve new sessions from ``stage``; the old one drains its sessions."""
        self.retiring, self.stage = self.stage, stage
        self.scheduler.queue.forget_times()

    async def aclose(self) -> None:
        if self.lanes is not None:
            self.lanes.close()
        await self.links.aclose()
        self.scheduler.shutdown()

    async def run_stage(
        self,
        stage: Stage,
        session_id: str,
        position: int,
        *,
        token_ids: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        owner: str | None = None,
        sample: bool = True,
        drafts: tuple[int, ...] = (),
        guess_from: int | None = None,
        ahead: Ahead | None = None,
        encode: Callable[[torch.Tensor], bytes] | None = None,
    ) -> StepOutput:
        """Submit a step to the scheduler; single-token decode steps may be batched (or, on
        a stage that is head and tail, run ahead: ``ahead``, ADR-0047). A decode step's
        input may be a ``wire.WireTensor``, made a tensor on the compute thread, which also
        encodes its output with ``encode`` (the next hop's frame: ``StepOutput.frame``)."""
        tensor = token_ids if token_ids is not None else hidden
        if tensor is not None and len(tensor.shape) >= 2 and tensor.shape[1] == 1:
            item = DecodeItem(
                session_id, position, token_ids, hidden, owner, sample, guess_from, ahead,
                encode,
            )  # fmt: skip
            return await self.scheduler.decode(stage, item)
        if isinstance(token_ids, wire.WireTensor):
            token_ids = token_ids.tensor()
        if isinstance(hidden, wire.WireTensor):
            hidden = hidden.tensor()
        tensor = token_ids if token_ids is not None else hidden
        rows = tensor.shape[1] if tensor is not None and tensor.dim() >= 2 else 1
        return await self.rows_pass(
            stage, session_id, position, rows=rows, token_ids=token_ids, hidden=hidden,
            owner=owner, sample=sample, drafts=drafts,
        )  # fmt: skip

    def rows_pass(
        self, stage: Stage, session_id: str, position: int, *, rows: int, **step
    ) -> Awaitable[StepOutput]:
        """A pass of several rows on the compute thread: a prompt's call of more than a wire
        chunk a layer at a time, other sessions' decode passes running between its layers
        (ADR-0053: the same bits, shorter waits); drafts to verify, or a short prompt, whole."""
        if not step.get("drafts") and rows > stage.max_chunk_tokens:
            return self.scheduler.stepwise(stage.stepping(session_id, position, **step))
        return self.scheduler.rows(stage.step, session_id, position, rows=rows, **step)

    async def run(
        self, stage: Stage, step: Step, tensor: torch.Tensor | wire.WireTensor,
        ahead: Ahead | None = None, encode: Callable[[torch.Tensor], bytes] | None = None,
    ) -> StepOutput:  # fmt: skip
        """Run ``step`` on ``stage`` with its input ``tensor`` (token ids on a head, hidden
        states elsewhere): a hop's parsed step, or the head's own "hop 0" (its route the
        hops after it), the one type every hop's pass starts from (docs/adr/0040).
        ``ahead``: a head that is the tail lets the step run ahead (ADR-0047)."""
        token_ids, hidden = (tensor, None) if stage.shard.is_head else (None, tensor)
        return await self.run_stage(
            stage, step.session_id, step.position, token_ids=token_ids, hidden=hidden,
            owner=step.session_key, sample=step.sample, drafts=step.draft_ids,
            guess_from=step.guess_from, ahead=ahead, encode=encode,
        )  # fmt: skip

    # -- one step ----------------------------------------------------------------------------

    async def handle_step(self, req: Step, tensor: torch.Tensor | wire.WireTensor) -> StepAnswer:
        """Run one step received (its tensor: the body, read or made) here and relay it on
        down the route; the tail's answer, with this hop's compute time first."""
        if req.replay_pass:  # a replay's passes come back to back: run them in order
            await self.order.wait_for_pass(req)
        elif req.chunk and req.open_spec is None:
            await self.order.wait_for_open(req)
        stage = self.stage if req.open_spec is not None else self.stage_for(req.session_id)
        # Everything checkable without running layers is checked first: a rejected step
        # must leave the session exactly as it was.
        if stage.shard.is_tail and req.route:
            raise InvalidRequest("the tail is the last hop; route must be empty", param=H_ROUTE)
        if not stage.shard.is_tail and not req.route:
            raise InvalidRequest(
                "this stage is not the tail: the route needs a next hop", param=H_ROUTE
            )
        if self.quarantined is not None:  # replicas disagreed with it: heads fail over
            raise Quarantined(*self.quarantined)
        opened, audits = False, self.head_audit  # HeadAuditor: chooses, after_step
        if req.open_spec is not None:
            if self.draining is not None:  # leaving: sessions it holds finish, no new ones
                raise Draining(self.draining)
            spec = req.open_spec
            if req.position != len(spec.prefix) * BLOCK_TOKENS:
                raise InvalidRequest(
                    "a session opens at position 0, or after its cached blocks", param=H_OPEN
                )
            # A session restored from the prefix cache has no inputs to record for audits.
            record = not spec.prefix and (
                (audits is not None and audits.chooses(stage, req)) or req.audit
            )
            session = stage.open_session(
                req.session_id, sampling=spec.sampling if stage.shard.is_tail else None,
                owner=req.session_key, start_layer=req.start_layer, record=record,
                keep=PrefixPlan(spec.prefix_seed, spec.prompt_tokens) if spec.prefix_seed else None,
                prompt_call=spec.prompt_call, score_end=spec.score_end,
            )  # fmt: skip
            opened = True
            if spec.prefix:  # docs/adr/0035: the cached blocks, then the rest of the prompt
                try:
                    stage.sessions.restore(session, spec.prefix)
                except MeshnetError:
                    stage.close_session(req.session_id)
                    raise
            elif stage.sessions.prefix is not None:  # the chain agreed on none: no promise
                stage.sessions.prefix.release(req.session_id)
            if self.order.watched(req.session_id):  # later chunks that overtook it wait
                await self.order.advance(req.session_id)
        mine = await self._after_earlier_steps(stage, req) if stage.shard.is_tail else None
        try:
            if req.guess_from is not None and mine is not None and stale_guess(stage, req):
                return StepAnswer(answer_bytes.STALE, format_compute(0.0))  # computes nothing
            if req.ids is not None and stage.shard.is_tail:  # before any later step samples
                stage.sessions.observe(
                    req.session_id, req.position, req.ids, owner=req.session_key
                )  # fmt: skip
            out = await self._run_step(stage, req, tensor)
        except MeshnetError:
            if opened:  # an opening step that failed leaves no session behind
                stage.close_session(req.session_id)
            raise
        finally:
            if mine is not None:
                mine.set_result(None)
                if self._tail_steps.get(req.session_id) is mine:
                    del self._tail_steps[req.session_id]
        if audits is not None:  # beside the step: notes its ids, may start an audit
            audits.after_step(stage, req)
        if req.ids is not None:  # what its blocks are named by in the prefix cache
            session = stage.sessions.peek(req.session_id)
            if session is not None:
                stage.sessions.note_ids(session, req.position, req.ids)
        if req.replay_pass:
            stage.sessions.get(req.session_id, owner=req.session_key).replayed = req.replay_pass
            await self.order.advance(req.session_id)
        elif opened and self.order.watched(req.session_id):  # a one-row prompt: a pass may wait
            await self.order.advance(req.session_id)
        self.count_served(req.sample)  # a sampled step: one more token through this stage
        own_ms = out.compute_s * 1000
        if stage.shard.is_tail:
            if out.token is None:
                return StepAnswer(answer_bytes.EMPTY, format_compute(own_ms))
            self._generated += 1 + len(out.more or ())
            self.count_served(len(out.more or ()))  # the drafts it kept: tokens too
            body = answer_bytes.encode(out.token, out.more)
            if req.answer_to is not None:  # straight to the head too; the chain still answers
                self.links.answer_head(req, body, append_compute(req.compute_before, own_ms))
            return StepAnswer(body, format_compute(own_ms))
        # The next hop's step: the route after it, opening where this stage ends.
        opening = req.open_spec
        if opening is not None:
            opening = opening.entering(stage.shard.layers.end)
        if self.lanes is not None:  # its next steps may come on a lane: one to the next hop
            self.lanes.want(req.route[0])
        before = None if req.answer_to is None else append_compute(req.compute_before, own_ms)
        onward = replace(req, route=req.route[1:], open_spec=opening, compute_before=before)
        resp = await self.links.relay(req.route[0], out.hidden, onward, out.frame)
        if req.drafts:  # the drafts the tail kept went through this stage too
            with contextlib.suppress(ValueError):
                self.count_served(answer_bytes.kept(resp.body))
        # The tail's answer goes back as it came: only the compute header grows.
        return StepAnswer(resp.body, format_compute(own_ms, resp.compute_ms))

    async def _after_earlier_steps(self, stage: Stage, req: Step) -> asyncio.Future:
        """On a tail: note ``req`` as its session's latest step and, for a guess step, wait
        until the session's earlier steps computed here (they arrived first, but may still
        be queued for the compute thread): whether its guess is stale depends on what they
        sampled. Returns the future to set once ``req`` computed (or was found stale)."""
        mine = asyncio.get_running_loop().create_future()
        before = self._tail_steps.get(req.session_id)
        self._tail_steps[req.session_id] = mine
        if req.guess_from is not None and before is not None and not before.done():
            try:
                await before  # set once that step is done, whatever its outcome
            except BaseException:  # cancelled: the steps after this one wait no longer
                mine.set_result(None)
                if self._tail_steps.get(req.session_id) is mine:
                    del self._tail_steps[req.session_id]
                raise
        return mine

    async def _run_step(
        self, stage: Stage, req: Step, tensor: torch.Tensor | wire.WireTensor
    ) -> StepOutput:
        if isinstance(tensor, wire.WireTensor):
            if req.chunk == 0 and not req.drafts and is_decode_input(stage.shard, tensor):
                # A decode step: checked without a torch call, made a tensor and its output
                # encoded for the next hop on the compute thread (engine/step_io).
                encode = None if stage.shard.is_tail else self.links.encoder(req.route[0])
                return await self.run(stage, req, tensor, encode=encode)
            tensor = tensor.tensor()
        is_head = stage.shard.is_head
        token_ids, hidden = (tensor, None) if is_head else (None, tensor)
        # One wire chunk at most. Values (token ranges, finiteness) are checked where the
        # step runs: a decode step is never merged with another's input, and each torch
        # call here costs tens of microseconds per hop on a CPU that idled (docs/adr/0011).
        tensor = stage.check_inputs(token_ids, hidden, values=False)
        if (tensor.shape[1] == 1 or req.drafts) and req.chunk == 0:  # a decode step
            return await self.run(stage, req, tensor)
        stage.check_inputs(token_ids, hidden)  # a bad chunk must not spoil a merged pass
        me = self.order.enter(req, tensor)
        try:
            if req.chunk:  # an earlier chunk's pass may be waiting for it (ADR-0053)
                await self.order.advance(req.session_id)
            await self.order.wait_for_turn(req, me)
            if me.taken:  # an earlier chunk's pass ran this one too
                return await me.future
            return await self._merged_pass(stage, me)
        finally:
            await self.order.leave(me)

    async def _merged_pass(self, stage: Stage, me: Waiting) -> StepOutput:
        """Run ``me`` with the chunks after it that its session's prompt call takes, in one
        pass (``ChunkOrder.call_chunks``).

        Each chunk still travels on to the next hop on its own; only the compute merges:
        the unsplit model computes a prompt in one call (ADR-0053), and one pass over the
        weights is far cheaper than several small ones on a CPU.
        """
        session = stage.sessions.peek(me.req.session_id)
        position = me.req.position
        end = position + stage.max_chunk_tokens if session is None else session.call_end(position)
        run = await self.order.call_chunks(me, end)
        self.order.take(run)
        is_head = stage.shard.is_head
        merged = me.tensor if len(run) == 1 else torch.cat([m.tensor for m in run], dim=1)
        try:
            out = await self.rows_pass(
                stage, me.req.session_id, me.req.position, rows=merged.shape[1],
                token_ids=merged if is_head else None, hidden=None if is_head else merged,
                owner=me.req.session_key, sample=run[-1].req.sample,
            )  # fmt: skip
        except BaseException as exc:
            for member in run[1:]:
                if not member.future.done():
                    member.future.set_exception(exc)
            raise
        offset = 0
        outs = []
        for member in run:
            width = member.tensor.shape[1]
            last = member is run[-1]
            outs.append(
                StepOutput(
                    hidden=None if out.hidden is None else out.hidden[:, offset : offset + width],
                    logits=out.logits if last else None,
                    token=out.token if last else None,
                    compute_s=out.compute_s,
                )
            )
            offset += width
        for member, member_out in zip(run[1:], outs[1:], strict=True):
            if not member.future.done():
                member.future.set_result(member_out)
        return outs[0]

    async def close_session(self, session_id: str, session_key: str | None, route) -> None:
        """Free a session here and (best effort) on every later hop."""
        stage = self.stage_for(session_id)
        session = stage.sessions.peek(session_id)
        if session is None and stage.sessions.prefix is not None:
            stage.sessions.prefix.release(session_id)  # its opening never came (ADR-0035)
        if session is None or session.owner not in (None, session_key):  # not the caller's
            raise NotFound(f"unknown session {session_id!r}", param="session_id")
        stage.close_session(session_id, keep=True)  # finished: its prefix stays cached
        await self.order.drop(session_id)
        self._tail_steps.pop(session_id, None)
        if route:
            await self.links.close_remote(route[0], session_id, session_key or "", route[1:])

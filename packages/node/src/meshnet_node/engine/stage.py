"""Execute one stage (a loaded shard) for many sessions, one chunk or decode step at a time."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Generator

import torch

from meshnet_common.config import defaults
from meshnet_common.errors import InvalidRequest, MeshnetError
from meshnet_common.protocol import SamplingSpec
from meshnet_node.caching.blocks import PrefixPlan
from meshnet_node.caching.store import PrefixCache
from meshnet_node.engine.bf16_upcast import torch_products
from meshnet_node.engine.constraints import ConstraintFactory
from meshnet_node.engine.families import (
    attention_module,
    build_masks,
    eager_call_rows,
    final_logits,
    row_contexts,
)
from meshnet_node.engine.loader import LoadedShard
from meshnet_node.engine.row_attention import together_plain
from meshnet_node.engine.sampling import DeferredRows
from meshnet_node.engine.sessions import Session, SessionStore, crop_cache
from meshnet_node.engine.step_io import DecodeItem, StepOutput, step_input
from meshnet_node.lowbit.packed import prompt_calls
from meshnet_node.programs import StageLayers, drain
from meshnet_node.programs.graphs import DecodeGraphs, Recorder
from meshnet_node.programs.native import final_norm

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = defaults.CHUNK_TOKENS


class Stage:
    """A loaded shard plus its sessions; ``step`` runs one chunk through the shard's layers."""

    def __init__(
        self,
        shard: LoadedShard,
        *,
        max_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        prompt_call_tokens: int = defaults.PROMPT_CALL_TOKENS,
        kv_budget_tokens: int = defaults.KV_BUDGET_TOKENS,
        idle_timeout_s: float = 300.0,
        max_sessions: int = 256,
        output_fault: Callable[[torch.Tensor], torch.Tensor] | None = None,
        prefix_cache: PrefixCache | None = None,  # finished sessions' prefixes (ADR-0035)
        engine: str = "native",  # the stage's passes' path (ADR-0041, 0044: StageLayers)
        graphs: Recorder | None = None,  # one-token steps replayed from graphs (ADR-0056)
    ) -> None:
        self.shard = shard
        adapter = shard.adapter
        self.layers = StageLayers(
            shard.modules.layers, shard.layer_types, adapter.call_layer, adapter.call_layer_batched,
            engine,
        )  # fmt: skip
        self.final_norm = final_norm(shard.modules.norm, self.layers.native) or shard.modules.norm
        # Tests only (``engine.faults``): applied to every output this stage computes.
        self.output_fault = output_fault
        self.max_chunk_tokens = max_chunk_tokens  # one step from the wire
        # The most rows of a prompt one call computes: a prompt up to this long is one call
        # on every hop, as the unsplit model computes it (ADR-0053); a whole number of chunks.
        calls = min(max(max_chunk_tokens, prompt_call_tokens), eager_call_rows(shard.config))
        self.prompt_call_tokens = max(max_chunk_tokens, calls - calls % max_chunk_tokens)
        positions = [
            getattr(shard.config, n, 0) for n in ("max_position_embeddings", "n_positions")
        ]
        self.max_positions = int(positions[0] or positions[1] or 1 << 20)
        self.graphs: DecodeGraphs | None = None
        if graphs is not None and self.layers.engine == "program":
            mods = shard.modules
            self.graphs = DecodeGraphs(
                self.layers.programs, shard.layer_types,  # type: ignore[arg-type]
                lambda h, p, types: adapter.position_embeddings(mods.rotary, h, p, types),
                graphs, limit=self.max_positions,
            )  # fmt: skip
        self.sessions = SessionStore(
            shard.stage_config,
            kv_budget_tokens=kv_budget_tokens,
            idle_timeout_s=idle_timeout_s,
            max_sessions=max_sessions,
            constraints=ConstraintFactory(shard.snapshot) if shard.is_tail else None,
            prefix_cache=prefix_cache,
        )

    def open_session(
        self,
        session_id: str,
        *,
        sampling: SamplingSpec | None = None,
        owner: str | None = None,
        start_layer: int | None = None,
        record: bool = False,
        keep: PrefixPlan | None = None,
        prompt_call: int | None = None,
        score_end: int | None = None,
    ) -> Session:
        """Open a session; ``start_layer`` (global) lets a chain enter mid-shard; ``record``
        keeps its inputs for audits (docs/adr/0026); ``keep``: docs/adr/0035;
        ``prompt_call``: the most rows of its prompt one call computes, as its head chose
        (ADR-0053; at most this stage's ``prompt_call_tokens``, its default); ``score_end``:
        a scored prompt's first call ends there (``SamplingSpec.score_end``)."""
        layers = self.shard.layers
        start_layer = layers.start if start_layer is None else start_layer
        if not isinstance(start_layer, int) or start_layer not in layers:
            raise InvalidRequest(
                f"start layer {start_layer} is outside this stage's layers {layers}",
                param="start_layer",
            )
        if start_layer != layers.start and self.shard.is_head:
            raise InvalidRequest("a head stage runs from layer 0", param="start_layer")
        if sampling is None and self.shard.is_tail:
            sampling = SamplingSpec()
        return self.sessions.open(
            session_id,
            sampling=sampling if self.shard.is_tail else None,
            owner=owner,
            first_layer=start_layer - layers.start,
            record=record and not self.shard.is_head,  # a head's input is the head's own
            keep=keep,
            prompt_call=self.prompt_call(prompt_call),
            score_end=score_end,
        )

    def prompt_call(self, asked: int | None) -> int:
        """The rows of a session's prompt calls: as asked (a head's choice, on the wire),
        within this stage's ``prompt_call_tokens`` and whole wire chunks."""
        calls = self.prompt_call_tokens if asked is None else min(asked, self.prompt_call_tokens)
        return max(self.max_chunk_tokens, calls - calls % self.max_chunk_tokens)

    def close_session(self, session_id: str, *, keep: bool = False) -> bool:  # keep: ADR-0035
        return self.sessions.close(session_id, keep=keep)

    # -- validation -------------------------------------------------------------------------

    def check_inputs(
        self,
        token_ids: torch.Tensor | None,
        hidden: torch.Tensor | None,
        *,
        limit: int | None = None,
        values: bool = True,
    ) -> torch.Tensor:
        """Validate a step's input and return it shaped (1, T) ids or (1, T, H) hidden.

        ``limit``: most tokens in one step (default: a wire chunk, ``max_chunk_tokens``).
        ``values=False`` checks types and shapes only, not token ranges or finiteness: for a
        caller that hands the tensor to ``step``/``step_batch``, which check it all again
        before any layer runs.
        """
        limit = self.max_chunk_tokens if limit is None else limit
        return step_input(self.shard, token_ids, hidden, limit=limit, values=values)

    # -- execution --------------------------------------------------------------------------

    def step(self, session_id: str, position: int, **step) -> StepOutput:
        """``stepping`` run whole: ``T`` tokens from absolute ``position`` through this
        stage."""
        return drain(self.stepping(session_id, position, **step))

    def stepping(
        self,
        session_id: str,
        position: int,
        *,
        token_ids: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        owner: str | None = None,
        sample: bool = True,
        drafts: tuple[int, ...] = (),
        guess_from: int | None = None,
    ) -> Generator[None, None, StepOutput]:
        """Run ``T`` tokens starting at absolute ``position`` through this stage, yielding
        between the layers of a prompt's pass (ADR-0053): its driver may run other sessions'
        passes there (``ComputeScheduler.stepwise``, which keeps the pass's context its
        own), and the pass computes the same either way; returns the step's output. A
        driver that stops it (``close``) drops the session.

        ``drafts``: the step's last ``k`` input tokens are drafts to verify (speculative
        decoding, ADR-0019): the tail samples every position and keeps drafts up to the
        first it would not have produced; the next step may start inside the span.

        Every check happens before any layer runs, so a rejected step leaves the session
        exactly as it was (except that it may drop drafts the tail did not keep).

        ``guess_from``: a guess step (its input is the head's guess, ADR-0019): a later step
        may go back to any position from ``guess_from`` on.
        """
        shard = self.shard
        session = self.sessions.get(session_id, owner=owner)
        if not isinstance(position, int) or position < 0:
            raise InvalidRequest("position must be a non-negative integer", param="position")
        tensor = self.check_inputs(token_ids, hidden, limit=self.prompt_call_tokens)
        num_tokens = tensor.shape[1]
        if drafts and (len(drafts) >= num_tokens or not sample):
            raise InvalidRequest("a step's drafts follow its first token", param="drafts")
        if position + num_tokens > self.max_positions:
            raise InvalidRequest(
                f"positions up to {position + num_tokens} exceed the model's context of "
                f"{self.max_positions}",
                param="position",
            )
        if shard.is_head and session.sampler is not None and session.sampler.wants_history:
            # head and tail in one: the input ids are the history
            session.sampler.observe(position, tensor.reshape(-1).tolist())
        with session.lock:
            self.sessions.rewind(session, position)
            self.sessions.reserve(session, position, num_tokens)
            ok = False
            rewinds = position + 1 if drafts else guess_from  # where a next step may go back to
            if rewinds is not None and not session.recording:  # sliding windows keep it
                session.cache.activate_past_recording()
                session.recording = True
            # Verification reads the logits of a pass's rows in order and stops at the first
            # draft it rejects: later rows need no lm_head (unless audited: the record).
            deferred = bool(drafts) and session.sampler is not None and session.record is None
            rows = len(drafts) + 1
            # A prompt's pass is its calls of ``prompt_call`` rows (ADR-0053).
            prompt = session.prompt_call if not drafts and num_tokens > 1 else 0
            try:
                with prompt_calls(prompt):
                    out = yield from self._forward(
                        session, position, tensor, rows, defer_logits=deferred
                    )
                ok = True
                if session.record is not None:
                    session.record.add(position, tensor, _last_row(out))
            except Exception:
                # A failure inside the layers may have left a partial chunk in the cache.
                logger.exception("step failed; dropping session %s", session_id)
                self.sessions.close(session_id)
                raise
            except GeneratorExit:  # its driver stopped it between layers: a partial chunk
                self.sessions.close(session_id)
                raise
            finally:
                self.sessions.commit(session, num_tokens, ok=ok)
            session.rewind_from = rewinds
            if session.recording and rewinds is None:
                crop_cache(session.cache, 0)  # nothing to go back to: windows trimmed
            if out.logits is not None and sample and session.sampler is not None:
                if drafts:
                    kept = session.sampler.verify(out.logits, drafts)
                    out.token, out.more = kept[0], kept[1:]
                    if isinstance(out.logits, DeferredRows):
                        out.logits = out.logits.computed()
                else:
                    out.token = session.sampler(out.logits)
                session.expect_next(position + num_tokens - len(drafts), out)
            return out

    def step_batch(self, items: list[DecodeItem]) -> list[StepOutput | Exception]:
        """One decode token for each of several sessions in one pass over the weights.

        Each item is validated on its own; a rejected item gets its exception in the result
        list and leaves its session untouched, the others still run.
        """
        results: list[StepOutput | Exception | None] = [None] * len(items)
        ready: list[tuple[int, Session, torch.Tensor]] = []
        seen: set[str] = set()
        for i, item in enumerate(items):
            try:
                if item.session_id in seen:
                    raise InvalidRequest("one step per session in a batch", param="session_id")
                session = self.sessions.get(item.session_id, owner=item.owner)
                tensor = self.check_inputs(item.token_ids, item.hidden)
                if tensor.shape[1] != 1 or item.position + 1 > self.max_positions:
                    raise InvalidRequest("a batched step is one token inside the context")
                self.sessions.rewind(session, item.position)
                self.sessions.reserve(session, item.position, 1)
                if item.guess_from is not None and not session.recording:
                    session.cache.activate_past_recording()
                    session.recording = True
                sampler = session.sampler
                if self.shard.is_head and sampler is not None and sampler.wants_history:
                    sampler.observe(item.position, tensor.reshape(-1).tolist())
            except MeshnetError as exc:
                results[i] = exc
                continue
            seen.add(item.session_id)
            ready.append((i, session, tensor))
        groups: dict[int, list[tuple[int, Session, torch.Tensor]]] = {}
        for entry in ready:  # sessions entering mid-shard run a different set of layers
            groups.setdefault(entry[1].first_layer, []).append(entry)
        for group in groups.values():
            sessions = [session for _, session, _ in group]
            ok = False
            for session in sessions:  # idle expiry skips locked sessions
                session.lock.acquire()
            try:
                outs = self._forward_batch(
                    sessions, [items[i].position for i, _, _ in group], [t for _, _, t in group]
                )
                ok = True
            except Exception as exc:
                logger.exception("batched step failed; dropping %d sessions", len(sessions))
                for session in sessions:
                    self.sessions.close(session.session_id)
                outs = [exc] * len(group)
            finally:
                for session in sessions:
                    session.lock.release()
            for (i, session, tensor), out in zip(group, outs, strict=True):
                self.sessions.commit(session, 1, ok=ok)
                if ok and session.record is not None:
                    session.record.add(items[i].position, tensor, _last_row(out))
                session.rewind_from = items[i].guess_from
                if session.recording and session.rewind_from is None:
                    crop_cache(session.cache, 0)
                if ok and out.logits is not None and items[i].sample and session.sampler:
                    out.token = session.sampler(out.logits)
                    session.expect_next(items[i].position + 1, out)
                results[i] = out
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def _forward_batch(
        self,
        sessions: list[Session],
        positions: list[int],
        inputs: list[torch.Tensor],
        logits: bool = True,
    ) -> list[StepOutput]:
        """One pass over the layers for several rows, each a one-token step of its session:
        norms, MLPs and projections run on all rows at once, attention row by row against
        the row's own session cache, in row order (``attend_rows``).

        Rows may repeat a session at consecutive positions (a verification pass): row ``i``
        then attends to the positions before it exactly as a one-token step would, with its
        own mask (``RowMasks``), so every row's output is the one-token step's, bit for bit
        (linear kernels give each row the same result whatever the number of rows).

        ``logits=False``: a tail returns each row's final-norm state as ``hidden`` instead,
        for ``DeferredRows``."""
        shard, mods, device = self.shard, self.shard.modules, self.shard.device
        position_ids = [torch.tensor([[p]], device=device) for p in positions]  # B x (1, 1)
        if shard.is_head:
            hidden = mods.embed(torch.cat(inputs).to(device))  # (B, 1, H)
            if mods.position_embed is not None:
                hidden = hidden + mods.position_embed(torch.cat(position_ids))
        else:
            hidden = torch.cat(inputs).to(device=device, dtype=shard.activation_dtype)
        first = sessions[0].first_layer
        caches = [session.cache for session in sessions]
        replayed = None
        if self.graphs is not None:  # distinct sessions' rows (not drafts): ADR-0056
            replayed = self.graphs.rows(hidden, positions, caches, first)
        if replayed is not None:
            hidden = replayed
        else:
            rows_for = row_contexts(shard.adapter, mods.rotary, shard.stage_config, shard.layer_types,
                                    caches, hidden, position_ids, first)  # fmt: skip
            together = all(together_plain(attention_module(lay), caches) for lay in mods.layers[first:])  # fmt: skip
            hidden = self.layers.run_batch(
                hidden, first=first, rows_for=rows_for, together=together
            )
        if not shard.is_tail:
            out = self._emit(hidden.to(shard.activation_dtype))
            return [StepOutput(hidden=out[b : b + 1]) for b in range(len(sessions))]
        states = self.final_norm(hidden)  # (B, 1, H)
        if not logits:
            return [StepOutput(hidden=states[b : b + 1]) for b in range(len(sessions))]
        out = self._logits(states)
        return [StepOutput(logits=out[b].reshape(-1)) for b in range(len(sessions))]

    @torch.inference_mode()
    def _logits(self, states: torch.Tensor) -> torch.Tensor:
        """Final-norm states (B, 1, H) -> float32 logits (B, 1, V)."""
        shard = self.shard
        return self._emit(final_logits(shard.config, shard.modules.lm_head, states).float().cpu())

    @torch_products  # rows as the one-token steps, in bf16 too: never widened (ADR-0027)
    def _forward_drafts(
        self, session: Session, position: int, inputs: torch.Tensor, defer_logits: bool = False
    ) -> StepOutput:
        """A verification pass (a token and its drafts): the positions run as rows of one
        batched pass (``_forward_batch``), so each gives what a one-token step there gives,
        in bfloat16 too (ADR-0019). ``defer_logits``: a tail's logits are ``DeferredRows``."""
        rows, defer = inputs.shape[1], defer_logits and self.shard.is_tail
        outs = self._forward_batch(
            [session] * rows,
            list(range(position, position + rows)),
            [inputs[:, i : i + 1] for i in range(rows)],  # rows x (1, 1) ids or (1, 1, H)
            logits=not defer,
        )
        if defer:
            states = torch.cat([out.hidden for out in outs])  # (rows, 1, H)
            logits = DeferredRows(torch_products(self._logits), states)
            return StepOutput(logits=logits)  # type: ignore[arg-type]
        if outs[0].hidden is not None:
            return StepOutput(hidden=torch.cat([out.hidden for out in outs], dim=1))
        return StepOutput(logits=torch.stack([out.logits for out in outs]))  # (rows, V)

    @torch.inference_mode()
    def _forward(
        self,
        session: Session,
        position: int,
        inputs: torch.Tensor,
        rows: int = 1,
        defer_logits: bool = False,
    ) -> Generator[None, None, StepOutput]:
        shard = self.shard
        mods = shard.modules
        device = shard.device
        num_tokens = inputs.shape[1]
        if rows > 1 and rows == num_tokens:
            return self._forward_drafts(session, position, inputs, defer_logits)
        position_ids = torch.arange(position, position + num_tokens, device=device).unsqueeze(0)
        if shard.is_head:
            hidden = mods.embed(inputs.to(device))  # (1, T, H)
            if mods.position_embed is not None:
                hidden = hidden + mods.position_embed(position_ids)
        else:
            hidden = inputs.to(device=device, dtype=shard.activation_dtype)  # (1, T, H)
        cache = session.cache
        first = session.first_layer
        replayed = None
        if num_tokens == 1 and self.graphs is not None:
            replayed = self.graphs.step(hidden, position, cache, first)
        if replayed is not None:
            hidden = replayed
        else:
            masks = (  # the native engine attends by position: it reads no mask
                {}
                if self.layers.native is not None
                else build_masks(shard.stage_config, shard.layer_types, hidden, cache, position_ids, first)
            )  # fmt: skip
            rotary = shard.adapter.position_embeddings(
                mods.rotary, hidden, position_ids, shard.layer_types[first:]
            )
            args = {"first": first, "masks": masks, "rotary": rotary,
                    "position_ids": position_ids, "cache": cache}  # fmt: skip
            if num_tokens > 1:  # a prompt's pass: others may run between its layers (ADR-0053)
                hidden = yield from self.layers.stepping(hidden, **args)
            else:
                hidden = self.layers.run(hidden, **args)
        if not shard.is_tail:
            return StepOutput(hidden=self._emit(hidden.to(shard.activation_dtype)))
        scores = None if session.sampler is None else session.sampler.prompt
        if scores is not None and scores.rows(position, num_tokens):
            self._score_prompt(session, hidden, position, scores.rows(position, num_tokens))
        last = self.final_norm(hidden[:, -rows:, :])  # (1, rows, H)
        logits = self._emit(final_logits(shard.config, mods.lm_head, last).float().cpu()[0])
        return StepOutput(logits=logits.reshape(-1) if rows == 1 else logits)

    def _emit(self, out: torch.Tensor) -> torch.Tensor:
        """An output as it leaves the stage: as computed, unless a fault was injected."""
        fault = self.output_fault
        return out if fault is None else fault(out)

    def recompute(self, inputs: torch.Tensor, start_layer: int) -> torch.Tensor:
        """The output row of the last of ``inputs``' positions (hidden states; a head's token
        ids, from layer 0), computed from scratch in a throwaway session entering at
        ``start_layer`` (global): a replica's side of an audit (docs/adr/0026, 0032). Held to
        the KV budget like any session while it runs."""
        kind = "token_ids" if self.shard.is_head else "hidden"
        session_id = f"audit-{uuid.uuid4().hex}"
        self.open_session(session_id, start_layer=start_layer)
        try:
            out = None
            for lo in range(0, inputs.shape[1], self.prompt_call_tokens):
                piece = inputs[:, lo : lo + self.prompt_call_tokens]
                out = self.step(session_id, lo, **{kind: piece}, sample=False)
            if out is None:
                raise InvalidRequest("nothing to recompute", param=kind)
            return _last_row(out)
        finally:
            self.close_session(session_id)

    def _score_prompt(self, session: Session, hidden: torch.Tensor, position: int, rows) -> None:
        """Log-probs of the prompt's own tokens (``echo``), the pass's rows in one call: a
        scored prompt's first call is its rows before the last (ADR-0053), as a scorer's
        forward computes them."""
        mods, sampler = self.shard.modules, session.sampler
        for lo in range(rows.start, rows.stop, session.prompt_call):
            hi = min(lo + session.prompt_call, rows.stop)
            states = self.final_norm(hidden[:, lo - position : hi - position, :])
            logits = final_logits(self.shard.config, mods.lm_head, states).float()[0]
            sampler.prompt.add(lo, torch.log_softmax(logits, dim=-1), sampler.history)


def _last_row(out: StepOutput) -> torch.Tensor:
    """The output row of a step's last position: its hidden state, or the tail's logits."""
    if out.hidden is not None:
        return out.hidden[0, -1].detach().to("cpu", copy=True)  # (H,)
    return out.logits.reshape(-1, out.logits.shape[-1])[-1].clone()  # (V,)

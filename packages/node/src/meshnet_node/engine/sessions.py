"""Per-session KV caches on one stage, with an idle timeout and a token budget."""

from __future__ import annotations

import logging
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedConfig

from meshnet_common.config import defaults
from meshnet_common.errors import CapacityExceeded, Conflict, InvalidRequest, NotFound
from meshnet_common.protocol import SamplingSpec, validate_session_id
from meshnet_node.caching.blocks import BLOCK_TOKENS, PrefixPlan, block_hashes
from meshnet_node.caching.store import PrefixCache, copy_prefix, cut_to_blocks, reusable
from meshnet_node.engine.growing_cache import session_cache
from meshnet_node.engine.sampling import Sampler

logger = logging.getLogger(__name__)

# Who asks for the session being opened: the calling node's address, set by the data path
# for the step in hand (None: this node's own head). One peer holds at most
# ``SessionStore.max_per_peer`` sessions, so that it cannot fill the stage (docs/adr/0032).
opening_peer: ContextVar[str | None] = ContextVar("opening_peer", default=None)


@dataclass
class InputRecord:
    """What an audited session received and what it last produced (docs/adr/0026): every
    input row by position, and the output row of its last position (hidden state, or the
    tail's logits), so that a replica can recompute it from the same input."""

    pieces: list[torch.Tensor] = field(default_factory=list)  # (1, T, H) each, in order
    length: int = 0
    last: torch.Tensor | None = None  # (H,) or (V,): the output row of position length - 1
    # The token ids of the positions, for a hop that audits the head feeding it (docs/adr/
    # 0032): filled by position from the steps' ids (-1: not known), by the data path.
    ids: list[int] = field(default_factory=list)

    def add(self, position: int, inputs: torch.Tensor, last: torch.Tensor) -> None:
        self.truncate(position)
        self.pieces.append(inputs)
        self.length = position + inputs.shape[1]
        self.last = last

    def note_ids(self, position: int, ids) -> None:
        """The token ids of the positions from ``position`` on (a step's ids header)."""
        end = position + len(ids)
        if len(self.ids) < end:
            self.ids.extend([-1] * (end - len(self.ids)))
        self.ids[position:end] = [int(i) for i in ids]

    def known(self) -> tuple[list[int], torch.Tensor | None]:
        """The ids of the positions ``0..T-1`` that the record has rows and ids for, and the
        input row of position ``T - 1``: what the head sent for it (None when ``T`` is 0)."""
        ids = self.ids[: self.length]
        if -1 in ids:
            ids = ids[: ids.index(-1)]
        at = 0
        for piece in self.pieces:
            if at + piece.shape[1] >= len(ids) > 0:
                return ids, piece[0, len(ids) - 1 - at].clone()
            at += piece.shape[1]
        return [], None

    def truncate(self, position: int) -> None:
        """Forget the rows from ``position`` on (a rewind past rejected drafts)."""
        del self.ids[position:]
        while self.pieces and self.length > position:
            piece = self.pieces[-1]
            start = self.length - piece.shape[1]
            if start >= position:
                self.pieces.pop()
                self.length = start
            else:
                self.pieces[-1] = piece[:, : position - start]
                self.length = position
            self.last = None

    def inputs(self) -> torch.Tensor:
        return self.pieces[0] if len(self.pieces) == 1 else torch.cat(self.pieces, dim=1)


@dataclass
class Session:
    """One generation's state on one stage: its KV cache and how many tokens it holds."""

    session_id: str
    cache: DynamicCache
    length: int = 0  # tokens already in the cache == position of the next token
    sampler: Sampler | None = None  # tail only
    last_used: float = field(default_factory=time.monotonic)
    owner: str | None = None  # who opened it; steps from anyone else are refused
    peer: str | None = None  # the address it was opened from (None: this node's head)
    first_layer: int = 0  # local index of the first layer this session runs (overlapping hops)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # After a step that carried drafts (speculative decoding): the first position the next
    # step may start at, dropping the cache past it (drafts the tail did not keep).
    rewind_from: int | None = None
    recording: bool = False  # sliding-window layers keep what a rewind needs (ADR-0019)
    record: InputRecord | None = None  # an audited session's inputs (docs/adr/0026)
    replayed: int = 0  # decode passes of a replay run here so far (docs/adr/0023)
    # Tail: the position and input token of the step that follows the last one sampled
    # here; a guess step (ADR-0019) that does not start there is stale.
    expect: tuple[int, int] | None = None
    # The prefix cache (docs/adr/0035): what the session leaves in it (None: nothing), the
    # ids of its positions so far, and how many of them came from the cache.
    keep: PrefixPlan | None = None
    ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    # The most rows of its prompt one call computes (ADR-0053): its head's choice, the same
    # on every hop, so that each hop computes the prompt in the same calls; a scored
    # prompt's first call ends before its last row (``SamplingSpec.score_end``).
    prompt_call: int = defaults.PROMPT_CALL_TOKENS
    score_end: int | None = None

    def call_end(self, position: int) -> int:
        """Where the prompt call starting at ``position`` ends (the prompt's own end may
        come first)."""
        end = position + self.prompt_call
        if self.score_end is not None and position < self.score_end < end:
            return self.score_end
        return end

    def expect_next(self, after: int, out) -> None:
        """After the tail sampled ``out`` (a StepOutput) for a step whose tokens (drafts
        not counted) end before ``after``."""
        if out.token is not None:
            last = out.more[-1] if out.more else out.token
            self.expect = (after + len(out.more or ()), int(last.token_id))


def crop_cache(cache, tokens: int) -> None:
    """Drop the last ``tokens`` positions of every layer that holds any; ``0`` trims
    sliding-window layers that kept extra positions back to their window."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", True) and layer.keys is not None:
            layer.crop(-tokens)


def check_session_id(session_id: object) -> str:
    """Session ids are short URL-safe tokens chosen by the head (one rule, in protocol)."""
    return validate_session_id(session_id if isinstance(session_id, str) else None)


class SessionStore:
    """All sessions of a stage. Thread-safe; enforces the KV token budget and idle expiry."""

    def __init__(
        self,
        stage_config: PreTrainedConfig,
        *,
        kv_budget_tokens: int,
        idle_timeout_s: float = 300.0,
        max_sessions: int = 256,
        max_per_peer: int | None = None,
        constraints=None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self._stage_config = stage_config
        self._constraints = constraints  # GrammarSpec -> Constraint (tail stages)
        self.kv_budget_tokens = kv_budget_tokens
        self.idle_timeout_s = idle_timeout_s
        self.max_sessions = max_sessions
        # Default: a quarter of the stage stays for other peers (all of it when tiny).
        self.max_per_peer = max_per_peer or max_sessions - max_sessions // 4
        self._sessions: dict[str, Session] = {}
        # Finished sessions' prefixes (docs/adr/0035), where this stage's caches can be cut
        # back to a block boundary; they count in the KV budget and give way to sessions.
        empty = session_cache(stage_config)
        self.prefix = prefix_cache if prefix_cache is not None and reusable(empty) else None
        self._reserved_tokens = 0  # tokens promised to steps in flight
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def tokens_held(self) -> int:
        with self._lock:
            return sum(s.length for s in self._sessions.values())

    def open(
        self,
        session_id: str,
        *,
        sampling: SamplingSpec | None = None,
        owner: str | None = None,
        first_layer: int = 0,
        record: bool = False,
        keep: PrefixPlan | None = None,
        prompt_call: int = defaults.PROMPT_CALL_TOKENS,
        score_end: int | None = None,
    ) -> Session:
        """Create a session (``record``: keep its inputs for audits; ``keep``: what it
        leaves in the prefix cache when it closes; ``prompt_call``: its prompt's calls);
        refuse (retryably) when the stage is full."""
        check_session_id(session_id)
        self.expire_idle()
        constraint = None
        if sampling is not None and sampling.grammar is not None:
            if self._constraints is None:
                raise InvalidRequest("this stage cannot constrain output", param="response_format")
            constraint = self._constraints(sampling.grammar)  # before any state changes
        with self._lock:
            if session_id in self._sessions:
                raise Conflict(f"session {session_id} already exists", param="session_id")
            if len(self._sessions) >= self.max_sessions:
                raise CapacityExceeded(
                    f"stage holds {len(self._sessions)} sessions (limit {self.max_sessions}); "
                    "retry later",
                    code="too_many_sessions",
                )
            peer = opening_peer.get()
            held = peer is not None and self._held_by(peer)
            if held and held >= self.max_per_peer:
                raise CapacityExceeded(
                    f"{peer} holds {held} sessions here (limit {self.max_per_peer} per peer); "
                    "retry later",
                    code="too_many_sessions",
                )
            if not self._room(1):
                raise CapacityExceeded(
                    f"KV budget of {self.kv_budget_tokens} tokens is full; retry later",
                    code="kv_budget_full",
                )
            session = Session(
                session_id=session_id,
                cache=session_cache(self._stage_config),
                sampler=Sampler(sampling, constraint) if sampling is not None else None,
                owner=owner,
                peer=peer,
                first_layer=first_layer,
                record=InputRecord() if record else None,
                keep=keep if self.prefix is not None else None,
                prompt_call=prompt_call,
                score_end=score_end,
            )
            self._sessions[session_id] = session
            return session

    def peek(self, session_id: str) -> Session | None:
        """The session if it exists (no ownership check: for bookkeeping, not for steps)."""
        return self._sessions.get(session_id)

    def get(self, session_id: str, *, owner: str | None = None) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"unknown session {session_id!r}", param="session_id")
        if session.owner is not None and owner != session.owner:
            raise NotFound(f"unknown session {session_id!r}", param="session_id")
        return session

    def observe(self, session_id: str, position: int, ids, *, owner: str | None = None) -> None:
        """Record a step's token ids in the session's sampler (tail): what the penalties
        count. Steps of a session may arrive out of order; positions place them."""
        session = self.get(session_id, owner=owner)
        if session.sampler is not None:
            session.sampler.observe(position, ids)

    def close(self, session_id: str, *, keep: bool = False) -> bool:
        """Drop a session; ``keep``: it finished well, its prefix stays in the cache."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is not None and keep:
            self._keep(session)
        return session is not None

    # -- the prefix cache (docs/adr/0035) ---------------------------------------------------

    def restore(self, session: Session, hashes: tuple[str, ...]) -> None:
        """Start ``session``, just opened, after the cached blocks ``hashes``: a copy of
        their keys and values, their ids in its sampler. Conflict ``prefix_miss`` when this
        stage does not hold them all (any more)."""
        entry = None
        if self.prefix is not None:
            entry = self.prefix.take(session.session_id, hashes, session.first_layer)
        if entry is None:
            raise Conflict(
                f"this stage does not hold the {len(hashes)} cached blocks asked for",
                param="prefix_blocks", code="prefix_miss",
            )  # fmt: skip
        tokens = len(hashes) * BLOCK_TOKENS
        with self._lock:
            if session.length or not self._room(tokens):
                raise CapacityExceeded(
                    f"KV budget of {self.kv_budget_tokens} tokens would be exceeded; retry "
                    "later", code="kv_budget_full",
                )  # fmt: skip
            copy_prefix(entry, len(hashes), session.cache)
            session.length = session.cached_tokens = tokens
            session.ids = list(entry.ids[:tokens])
        if session.sampler is not None:
            session.sampler.observe(0, session.ids)

    def note_ids(self, session: Session, position: int, ids) -> None:
        """The token ids of a step that ran from ``position``: what the session's blocks
        are named by when it leaves them in the cache. Pipelined chunks may be noted out of
        order: positions place them (-1: not known yet)."""
        if session.keep is None or ids is None or position >= session.keep.tokens:
            return
        end = position + len(ids)
        if len(session.ids) < end:
            session.ids.extend([-1] * (end - len(session.ids)))
        session.ids[position:end] = [int(i) for i in ids]

    def _keep(self, session: Session) -> None:
        if self.prefix is None or session.keep is None:
            return
        if not session.lock.acquire(blocking=False):  # a step still runs in it: not whole
            return
        try:
            known = session.ids.index(-1) if -1 in session.ids else len(session.ids)
            blocks = min(session.length, known, session.keep.tokens) // BLOCK_TOKENS
            if blocks:
                ids = session.ids[: blocks * BLOCK_TOKENS]
                cut_to_blocks(session.cache, session.length, blocks)
                hashes = block_hashes(session.keep.seed, ids)
                self.prefix.save(hashes, ids, session.cache, session.first_layer)
        finally:
            session.lock.release()

    def _room(self, tokens: int) -> bool:
        """Whether ``tokens`` more fit in the budget, evicting cached prefixes for them
        (under the lock)."""
        over = self._used_tokens() + tokens - self.kv_budget_tokens
        if over > 0 and self.prefix is not None:
            self.prefix.evict(over)
        return self._used_tokens() + tokens <= self.kv_budget_tokens

    def _held_by(self, peer: str) -> int:
        return sum(1 for s in self._sessions.values() if s.peer == peer)

    def _used_tokens(self) -> int:
        cached = self.prefix.tokens if self.prefix is not None else 0
        return sum(s.length for s in self._sessions.values()) + self._reserved_tokens + cached

    def reserve(self, session: Session, position: int, num_tokens: int) -> None:
        """Check a step before it runs: right position, and room in the KV budget."""
        if position != session.length:
            raise Conflict(
                f"session {session.session_id} is at position {session.length}, "
                f"step starts at {position}",
                param="position",
                code="wrong_position",
            )
        with self._lock:
            if not self._room(num_tokens):
                raise CapacityExceeded(
                    f"KV budget of {self.kv_budget_tokens} tokens would be exceeded; retry later",
                    code="kv_budget_full",
                )
            self._reserved_tokens += num_tokens

    def rewind(self, session: Session, position: int) -> None:
        """Start the next step at ``position``, dropping the cache past it: only inside the
        span of the last step that carried drafts (the chain's verification of them)."""
        if position >= session.length or session.rewind_from is None:
            return
        if position < session.rewind_from:
            raise Conflict(
                f"session {session.session_id} cannot go back to {position} (its drafts "
                f"start at {session.rewind_from})",
                param="position",
                code="wrong_position",
            )
        self._drop(session, position)
        # The sampler's history needs no rewind: the steps' ids overwrite it by position,
        # and only requests whose sampling ignores the history carry drafts.

    def forget_from(self, session_id: str, position: int) -> None:
        """Drop the positions from ``position`` on: a step the rest of its chain did not
        complete (a head's burst down its decode lane, docs/adr/0059), which the head's
        next step sends again from there. The ids of later steps overwrite the sampler's
        history by position."""
        session = self._sessions.get(session_id)
        if session is not None and position < session.length:
            self._drop(session, position)

    def _drop(self, session: Session, position: int) -> None:
        with self._lock:
            crop_cache(session.cache, session.length - position)
            session.length = position
            del session.ids[position:]
            if session.record is not None:
                session.record.truncate(position)

    def commit(self, session: Session, num_tokens: int, *, ok: bool) -> None:
        """Settle a reservation once the step finished (or failed)."""
        with self._lock:
            self._reserved_tokens -= num_tokens
            if ok:
                session.length += num_tokens
                session.last_used = time.monotonic()

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Drop sessions idle longer than the timeout; returns their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [
                sid
                for sid, s in self._sessions.items()
                if now - s.last_used > self.idle_timeout_s and not s.lock.locked()
            ]
            for sid in stale:
                del self._sessions[sid]
        if stale:
            logger.info("expired %d idle sessions", len(stale))
        return stale

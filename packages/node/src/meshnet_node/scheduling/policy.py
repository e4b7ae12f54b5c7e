"""What a node's compute thread runs next, decided in one place on a clock it is given
(docs/adr/0039).

Passes run one at a time, in the order they arrived. A decode step at the front waits a
moment for other sessions' steps, which then share its pass (``Stage.step_batch``: weights
read once for the whole batch):

- up to ``gather_s`` from when the compute thread came free (or the step arrived, if later),
  less once every open session of its stage (on a head with micro-batches: of its slot)
  has a step queued. Sessions decode in lockstep along a chain: when one session's step
  reaches a node, the others' are usually a few milliseconds behind it;
- on a head, longer for members of its micro-batch whose last step is still down the
  chain (up to a cycle: a pass per micro-batch, or the chain's measured return time when
  its stages take turns on shared cores): a pass without them would split the micro-batch
  for good (docs/adr/0029).

A head splits its sessions into ``depth`` micro-batches, ``depth`` being the stages of its
chains that can compute at once (``micro_batches``): one batch of every session would move
down the chain in lockstep, one stage computing while the others wait. A session keeps its
micro-batch (*slot*) from its first decode step on, given the least filled one (as vLLM
gives a request one virtual engine); a pass takes the steps of one slot.

A prompt pass is one of its calls (ADR-0053: the whole prompt, up to ``--prompt-call-tokens``),
submitted a layer at a time when longer than a wire chunk (``ComputeScheduler.stepwise``):
other sessions' decode steps run between its layers.
A pass known to be short takes one of the host's compute turns (``turn_max_s``), so that the
nodes sharing a host do not compute at once; a long one, or one of unknown length, takes
none: no node waits long behind another's prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from meshnet_node.engine.stage import DecodeItem, Stage

DECODE = "decode"  # one session's single-token step: may share a pass with other sessions'
ROWS = "rows"  # a pass of several rows (a prompt's chunks, drafts to verify)
WORK = "work"  # anything else run on the compute thread (audits, a draft model's guesses)


@dataclass(eq=False)
class Pass:
    """A pass waiting for the compute thread: ``item`` (decode steps) or ``call``."""

    kind: str
    arrived: float
    stage: Stage | None = None
    item: DecodeItem | None = None
    call: Callable[[], object] | None = None
    rows: int = 1
    future: asyncio.Future | None = None  # the scheduler's: where its result goes
    resumed: bool = False  # a later piece of a pass that yields between layers (ADR-0053)

    @property
    def dropped(self) -> bool:
        """Its caller stopped waiting before it ran (a guess step the head dropped, a
        client that left): it never runs, as a call never made."""
        return self.future is not None and self.future.cancelled()


@dataclass
class Run:
    """Run ``passes`` now as one pass of the compute thread (several: decode steps batched);
    ``turn``: in one of the host's compute turns."""

    passes: list[Pass]
    turn: bool = False


@dataclass
class Wait:
    """Nothing to run before ``until`` (the clock's time), unless another pass arrives."""

    until: float


@dataclass
class PassTimes:
    """How long this node's last passes took (compute only, not waits for a turn)."""

    decode_s: float | None = None  # the last decode pass (None: unknown)
    row_s: float | None = None  # the last pass of several rows: its time per row

    def note(self, kind: str, rows: int, compute_s: float) -> None:
        if kind == DECODE:
            self.decode_s = compute_s
        elif kind == ROWS and rows > 1:
            self.row_s = compute_s / rows

    def expected_s(self, kind: str, rows: int) -> float | None:
        """How long such a pass should take here (None: not known yet)."""
        if kind == WORK:
            return None
        if kind == DECODE or rows <= 1:
            return self.decode_s
        if self.row_s is None:
            return None
        return max(self.decode_s or 0.0, rows * self.row_s)

    def forget(self) -> None:
        """Another shard: its pass times are not known yet."""
        self.decode_s = self.row_s = None


@dataclass
class PassQueue:
    """The passes waiting for the compute thread and every decision about them."""

    max_batch: int = 32
    gather_s: float = 0.005
    turn_max_s: float = 0.25
    depth: int = 1  # stages of the head's chains that compute at once: micro-batches
    entries: list[Pass] = field(default_factory=list)
    times: PassTimes = field(default_factory=PassTimes)
    pass_s: float = 0.0  # the last decode pass's wall time on this node
    return_s: float = 0.0  # head, one micro-batch: how long a step takes down the chain
    free_since: float = 0.0  # when the compute thread last came free
    batches: int = 0  # decode passes that merged steps of several sessions
    batched_steps: int = 0
    _slots: dict[str, int] = field(default_factory=dict)  # head: a session's micro-batch
    _out: dict[str, float] = field(default_factory=dict)  # head: steps down the chain, since

    # -- arrivals ----------------------------------------------------------------------------

    def add(self, entry: Pass) -> None:
        """Queue ``entry`` (``entry.arrived``: now, by the queue's clock)."""
        if entry.kind == DECODE and self._slotted(entry.stage):
            sid = entry.item.session_id  # type: ignore[union-attr]
            self.slot(entry.stage, sid)  # type: ignore[arg-type]
            sent = self._out.pop(sid, None)
            if sent is not None:  # its last step went down the chain and came back
                self._note_return(entry.arrived - sent)
        self.entries.append(entry)

    # -- what runs next ----------------------------------------------------------------------

    def next(self, now: float) -> Run | Wait | None:
        """What the compute thread runs now (taken off the queue), how long to wait for
        more steps to batch, or None when nothing waits."""
        self.entries = [e for e in self.entries if not e.dropped]
        if not self.entries:
            return None
        first = self.entries[0]
        if first.kind != DECODE:
            self.entries.pop(0)
            return Run([first], self._turn(first))
        stage = first.stage
        slot = self.slot(stage, first.item.session_id) if self._slotted(stage) else None
        if slot is None:
            want = min(len(stage.sessions), self.max_batch)  # type: ignore[union-attr]
        else:
            want = min(self._members(stage, slot), self.max_batch)
        joining = self._joining(stage, slot)
        waiting_too = any(e.kind != DECODE for e in self.entries)  # runs next: no wait
        if len(joining) < want and not waiting_too:
            start = max(first.arrived, self.free_since)
            if now < start + self.gather_s:
                return Wait(start + self.gather_s)
            late = start + self._cycle_s()
            if slot is not None and now < late and self._coming(slot, now):
                return Wait(late)
        taken = set(joining)
        self.entries = [e for e in self.entries if e not in taken]
        return Run(joining, self._turn(first))

    def ran(self, run: Run, started: float, ended: float, compute_s: float | None) -> None:
        """``run`` took from ``started`` to ``ended`` (the clock's), ``compute_s`` of it
        computing (None: it failed before)."""
        self.free_since = ended
        first = run.passes[0]
        if compute_s is not None:
            self.times.note(first.kind, first.rows, compute_s)
        if first.kind != DECODE:
            return
        self.pass_s = ended - started
        if len(run.passes) > 1:
            self.batches += 1
            self.batched_steps += len(run.passes)
        if self._slotted(first.stage):
            self._out.update((p.item.session_id, ended) for p in run.passes)  # type: ignore[union-attr]

    def forget_times(self) -> None:
        """Another shard: its pass times are not known yet."""
        self.times.forget()

    # -- decisions' parts --------------------------------------------------------------------

    def _turn(self, entry: Pass) -> bool:
        expected = self.times.expected_s(entry.kind, entry.rows)
        return expected is not None and expected < self.turn_max_s

    def _joining(self, stage, slot: int | None) -> list[Pass]:
        """The first entry (a decode step of ``stage``) and the steps that would join its
        pass: of other sessions, of ``stage``, of ``slot``, queued before any pass of
        another kind (which runs first: a session's steps never overtake each other; the
        first's session may have closed since, and its step then fails in the pass)."""
        joining: list[Pass] = []
        sessions: set[str] = set()
        for entry in self.entries:
            if entry.kind != DECODE:
                break
            sid = entry.item.session_id  # type: ignore[union-attr]
            if not joining or (
                entry.stage is stage and sid not in sessions and len(joining) < self.max_batch
                and (slot is None or self._slots.get(sid) == slot)
            ):  # fmt: skip
                joining.append(entry)
            sessions.add(sid)  # taken, or left: its later steps wait for this one
        return joining

    def _coming(self, slot: int, now: float) -> bool:
        """Whether a session of ``slot`` has a step down the chain, sent within 2 cycles."""
        window = 2 * self._cycle_s()
        return any(
            self._slots.get(sid) == slot and now - since < window
            for sid, since in self._out.items()
        )  # fmt: skip

    def _note_return(self, back: float) -> None:
        """Average how long steps take down the chain and back; one slow return (a
        failover, a client that paused) moves it at most 20%."""
        if not self.return_s:
            self.return_s = back
        else:
            self.return_s = 0.8 * self.return_s + 0.2 * min(back, 2 * self.return_s)

    def _cycle_s(self) -> float:
        """How long a slot's step takes to come back: a pass per micro-batch; with one
        micro-batch (stages taking turns on shared cores), the chain's measured return."""
        if self.depth > 1:
            return self.pass_s * self.depth
        return max(self.pass_s, self.return_s)

    def _slotted(self, stage) -> bool:
        # A head of a chain keeps its sessions in slots, one slot when its stages take
        # turns (depth 1): the whole batch then moves down the chain as one.
        return stage.shard.is_head and (self.depth > 1 or not stage.shard.is_tail)

    def slot(self, stage, session_id: str) -> int:
        """The micro-batch of ``session_id`` on head ``stage``: kept once given, else the
        least filled of ``depth`` (sessions closed since are forgotten first)."""
        slot = self._slots.get(session_id)
        if slot is not None and slot < self.depth:
            return slot
        self._forget_closed(stage)
        counts = [0] * self.depth
        for s in self._slots.values():
            if s < self.depth:
                counts[s] += 1
        slot = counts.index(min(counts))
        self._slots[session_id] = slot
        return slot

    def _forget_closed(self, stage) -> None:
        self._slots = {
            sid: s for sid, s in self._slots.items() if stage.sessions.peek(sid) is not None
        }  # fmt: skip
        self._out = {sid: t for sid, t in self._out.items() if sid in self._slots}

    def _members(self, stage, slot: int) -> int:
        """Open sessions of micro-batch ``slot``."""
        self._forget_closed(stage)
        return sum(1 for s in self._slots.values() if s == slot)

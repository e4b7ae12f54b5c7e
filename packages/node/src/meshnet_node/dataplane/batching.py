"""Decode batching: single-token steps of different sessions that wait for the compute
thread run as one forward pass (``Stage.step_batch``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time

from meshnet_common.web.hosts import url_is_loopback
from meshnet_node.dataplane.compute import ComputeThread
from meshnet_node.engine.stage import DecodeItem, Stage, StepOutput


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@functools.lru_cache(maxsize=256)
def micro_batches(route: tuple[str, ...], threads: int, cpus: int | None = None) -> int:
    """How many micro-batches a head keeps in flight on a chain of its own stage and the
    hops of ``route`` (their URLs): one per stage that can compute at the same time as the
    others (docs/adr/0029).

    A stage on another machine computes in parallel with the rest: one micro-batch each.
    Stages on this machine (the head, and hops at a loopback address, which only this
    machine answers) share its ``cpus``: at most ``cpus // threads`` of them compute at
    once, and a micro-batch beyond that only repeats a pass's fixed cost (on a CPU
    without bf16 arithmetic, widening every weight again).
    """
    cpus = usable_cpus() if cpus is None else cpus
    here = 1 + sum(1 for url in route if url_is_loopback(url))
    elsewhere = len(route) + 1 - here
    return elsewhere + min(here, max(1, cpus // max(1, threads)))


class DecodeBatcher:
    """Merges decode steps of different sessions that wait for the compute thread into one
    forward pass (``Stage.step_batch``): weights are read once for the whole batch.

    A lone step runs alone (unbatched, bit-identical to ``step``); steps arriving while the
    compute thread is busy are taken together next time, after a gather window of up to
    ``gather_s`` for the other sessions' steps (see ``_gather``).

    On a head, the sessions are split into ``depth`` micro-batches, ``depth`` being the
    number of stages of its chains that can compute at once (set by the head's generator
    through ``NodeService.set_micro_batches``, from :func:`micro_batches`): one batch of every
    session would move down the chain in lockstep, one stage computing while the others
    wait; ``depth`` smaller batches keep every stage busy, each with its own (pipeline
    parallelism's micro-batches; vLLM keeps one batch per pipeline stage the same way).
    A session keeps its micro-batch (*slot*) from its first decode step on, given the
    least filled one (as vLLM gives a request one virtual engine): a pass takes the steps
    of one slot, and waits up to ``gather_s`` for the slot's other sessions, up to a cycle
    for those whose last step is still down the chain (docs/adr/0029); a head of a chain
    keeps one slot when ``depth`` is 1 (its stages take turns on shared cores), waiting up
    to the chain's measured return time for its members. Batches
    formed from whatever happened to be queued drift apart into uneven groups (8, 5 and 3
    steps where 16 sessions should run as 8 and 8), each pass paying its fixed cost.
    """

    def __init__(
        self, compute: ComputeThread, max_batch: int = 32, gather_s: float = 0.005
    ) -> None:
        self.compute = compute  # where passes run (and a lone step may run inline)
        self.max_batch = max_batch
        self._queue: list[tuple[Stage, DecodeItem, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.batches = 0
        self.batched_steps = 0
        self.gather_s = gather_s
        self.depth = 1  # stages of the head's chains: micro-batches kept in flight
        self._slots: dict[str, int] = {}  # head: a session's micro-batch, 0 .. depth - 1
        self._out: dict[str, float] = {}  # head: sessions whose step is down the chain, since
        self._pass_s = 0.0  # the last pass's wall time on this node
        self._return_s = 0.0  # head, one micro-batch: how long a step takes down the chain
        self._arrived = asyncio.Event()

    async def submit(self, stage: Stage, item: DecodeItem, *, alone: bool = False) -> StepOutput:
        """Run ``item``'s step, batched with other sessions' where they wait together.
        ``alone``: ``stage`` is the node's only stage (no retiring shard computes too)."""
        if not self._queue and alone and self.compute.inline_ok(stage):
            # The only session on an idle node: run on the event loop's thread. A hand-off
            # to the compute thread and back costs two wake-ups (milliseconds on a busy or
            # virtualized host), and with no other session there is nothing to batch with.
            out = self.compute.run_inline(
                stage.step, item.session_id, item.position, token_ids=item.token_ids,
                hidden=item.hidden, owner=item.owner, sample=item.sample,
                guess_from=item.guess_from,
            )  # fmt: skip
            # A node that is head and tail, generating alone, awaits nothing else between
            # its steps: give the loop one turn so /health and other connections are
            # answered between tokens. Any other stage awaits the next hop or its answer's
            # send next; a turn here would run the stream's next receiver first, on the
            # step's critical path (~0.1 ms a hop on a CPU whose caches the step emptied).
            if stage.shard.is_head and stage.shard.is_tail:
                await asyncio.sleep(0)
            return out
        future = asyncio.get_running_loop().create_future()
        if self._slotted(stage):
            self.slot(stage, item.session_id)
            sent = self._out.pop(item.session_id, None)
            if sent is not None:  # its last step went down the chain and came back
                self._note_return(asyncio.get_running_loop().time() - sent)
        self._queue.append((stage, item, future))
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._drain())
        return await future

    async def _gather(self) -> None:
        """Give the steps of other sessions a moment to arrive before a pass starts.

        Sessions decode in lockstep along a chain: when one session's step reaches this node,
        the others' are usually a few milliseconds behind it (still being parsed, or on the
        previous hop). Waiting up to ``gather_s`` — less once every open session (on a head
        with micro-batches: of the first step's slot) has a step queued — turns a run of
        small passes into one large one.
        """
        stage, first, _ = self._queue[0]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.gather_s
        slot = self.slot(stage, first.session_id) if self._slotted(stage) else None
        if slot is None:
            want = min(len(stage.sessions), self.max_batch)
        else:
            want = min(self._members(stage, slot), self.max_batch)
        # On a head, members of the slot whose last step is still down the chain come back
        # within a cycle (a pass per micro-batch): waiting for them puts the slot back in
        # one phase, where a pass without them would split it for good.
        late = deadline if slot is None else loop.time() + self._cycle_s()
        while self._queued(stage, slot) < want:
            now = loop.time()
            until = deadline
            if now >= deadline:
                if now >= late or not self._coming(slot, now):
                    return
                until = late
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), until - now)

    def _coming(self, slot: int | None, now: float) -> bool:
        """Whether a session of ``slot`` has a step down the chain, sent within 2 cycles."""
        window = 2 * self._cycle_s()
        return slot is not None and any(
            self._slots.get(sid) == slot and now - since < window
            for sid, since in self._out.items()
        )  # fmt: skip

    def _note_return(self, back: float) -> None:
        """Average how long steps take down the chain and back; one slow return (a
        failover, a client that paused) moves it at most 20%."""
        if not self._return_s:
            self._return_s = back
        else:
            self._return_s = 0.8 * self._return_s + 0.2 * min(back, 2 * self._return_s)

    def _cycle_s(self) -> float:
        """How long a slot's step takes to come back: a pass per micro-batch; with one
        micro-batch (stages taking turns on shared cores), the chain's measured return."""
        if self.depth > 1:
            return self._pass_s * self.depth
        return max(self._pass_s, self._return_s)

    def _slotted(self, stage: Stage) -> bool:
        # A head of a chain keeps its sessions in slots, one slot when its stages take
        # turns (depth 1): the whole batch then moves down the chain as one.
        return stage.shard.is_head and (self.depth > 1 or not stage.shard.is_tail)

    def slot(self, stage: Stage, session_id: str) -> int:
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

    def _forget_closed(self, stage: Stage) -> None:
        self._slots = {
            sid: s for sid, s in self._slots.items() if stage.sessions.peek(sid) is not None
        }  # fmt: skip
        self._out = {sid: t for sid, t in self._out.items() if sid in self._slots}

    def _members(self, stage: Stage, slot: int) -> int:
        """Open sessions of micro-batch ``slot``."""
        self._forget_closed(stage)
        return sum(1 for s in self._slots.values() if s == slot)

    def _queued(self, stage: Stage, slot: int | None) -> int:
        if slot is None:
            return len(self._queue)
        return sum(1 for s, item, _ in self._queue
                   if s is stage and self._slots.get(item.session_id) == slot)  # fmt: skip

    def _take(self) -> tuple[Stage, list[tuple[DecodeItem, asyncio.Future]]]:
        stage, first, _ = self._queue[0]
        limit = self.max_batch
        slot = self.slot(stage, first.session_id) if self._slotted(stage) else None
        taken, rest, sessions = [], [], set()
        for entry in self._queue:
            s, item, future = entry
            if (s is stage and item.session_id not in sessions and len(taken) < limit
                    and (slot is None or self._slots.get(item.session_id) == slot)):  # fmt: skip
                sessions.add(item.session_id)
                taken.append((item, future))
            else:
                rest.append(entry)
        self._queue = rest
        return stage, taken

    async def _drain(self) -> None:
        while self._queue:
            if self.gather_s > 0:
                await self._gather()
            stage, taken = self._take()
            items = [item for item, _ in taken]
            started = time.perf_counter()
            try:
                if len(items) == 1:
                    item = items[0]
                    results = [
                        await self.compute.run_decode(
                            stage.step, item.session_id, item.position, token_ids=item.token_ids,
                            hidden=item.hidden, owner=item.owner, sample=item.sample,
                            guess_from=item.guess_from,
                        )
                    ]  # fmt: skip
                else:
                    results = await self.compute.run_decode(stage.step_batch, items)
                    self.batches += 1
                    self.batched_steps += len(items)
            except Exception as exc:  # the single-step path raises instead of returning
                results = [exc] * len(items)
            self._pass_s = time.perf_counter() - started
            if self._slotted(stage):
                sent = asyncio.get_running_loop().time()
                self._out.update((item.session_id, sent) for item in items)
            for (_, future), result in zip(taken, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

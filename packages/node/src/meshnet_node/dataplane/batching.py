"""Decode batching: single-token steps of different sessions that wait for the compute
thread run as one forward pass (``Stage.step_batch``)."""

from __future__ import annotations

import asyncio
import functools
import math
import os
import time
from typing import TYPE_CHECKING

from meshnet_common.web.hosts import url_is_loopback
from meshnet_node.engine.stage import DecodeItem, Stage, StepOutput

if TYPE_CHECKING:
    from meshnet_node.dataplane.service import NodeService


def _timed(fn, *args, delay_s: float = 0.0, **kwargs):
    """Call ``fn``; StepOutputs it returns learn how long it took (a batch shares it).

    ``delay_s`` (tests only) makes the step that much slower, holding the calling thread as
    real compute would."""
    started = time.perf_counter()
    if delay_s:
        time.sleep(delay_s)
    result = fn(*args, **kwargs)
    elapsed = time.perf_counter() - started
    for out in result if isinstance(result, list) else (result,):
        if isinstance(out, StepOutput):
            out.compute_s = elapsed
    return result


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
    from :func:`micro_batches`): one batch of every
    session would move down the chain in lockstep, one stage computing while the others
    wait; ``depth`` smaller batches keep every stage busy, each with its own (pipeline
    parallelism's micro-batches; vLLM keeps one batch per pipeline stage the same way).
    """

    def __init__(self, service: NodeService, max_batch: int = 32, gather_s: float = 0.005) -> None:
        self.service = service
        self.max_batch = max_batch
        self._queue: list[tuple[Stage, DecodeItem, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.batches = 0
        self.batched_steps = 0
        self.gather_s = gather_s
        self.depth = 1  # stages of the head's chains: micro-batches kept in flight
        self._arrived = asyncio.Event()

    async def submit(self, stage: Stage, item: DecodeItem) -> StepOutput:
        if not self._queue and self.service.inline_ok(stage):
            # The only session on an idle node: run on the event loop's thread. A hand-off
            # to the compute thread and back costs two wake-ups (milliseconds on a busy or
            # virtualized host), and with no other session there is nothing to batch with.
            out = self.service.compute_inline(
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
        self._queue.append((stage, item, future))
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._drain())
        return await future

    async def _gather(self) -> None:
        """Give the steps of other sessions a moment to arrive before a pass starts.

        Sessions decode in lockstep along a chain: when one session's step reaches this node,
        the others' are usually a few milliseconds behind it (still being parsed, or on the
        previous hop). Waiting up to ``gather_s`` — less once every open session has a step
        queued — turns a run of small passes into one large one.
        """
        stage = self._queue[0][0]
        deadline = asyncio.get_running_loop().time() + self.gather_s
        while len(self._queue) < min(len(stage.sessions), self.limit(stage)):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def limit(self, stage: Stage) -> int:
        """The most steps one pass of ``stage`` takes: on a head, its sessions shared out
        over ``depth`` micro-batches."""
        if self.depth <= 1 or not stage.shard.is_head:
            return self.max_batch
        return max(1, min(self.max_batch, math.ceil(len(stage.sessions) / self.depth)))

    def _take(self) -> tuple[Stage, list[tuple[DecodeItem, asyncio.Future]]]:
        stage = self._queue[0][0]
        limit = self.limit(stage)
        taken, rest, sessions = [], [], set()
        for entry in self._queue:
            s, item, future = entry
            if s is stage and item.session_id not in sessions and len(taken) < limit:
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
            try:
                if len(items) == 1:
                    item = items[0]
                    results = [
                        await self.service.compute(
                            stage.step, item.session_id, item.position, token_ids=item.token_ids,
                            hidden=item.hidden, owner=item.owner, sample=item.sample,
                            guess_from=item.guess_from,
                        )
                    ]  # fmt: skip
                    self.service.note_decode(results)
                else:
                    results = await self.service.compute(stage.step_batch, items)
                    self.service.note_decode(results)
                    self.batches += 1
                    self.batched_steps += len(items)
            except Exception as exc:  # the single-step path raises instead of returning
                results = [exc] * len(items)
            for (_, future), result in zip(taken, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

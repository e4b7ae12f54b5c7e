"""The node's compute scheduler (docs/adr/0039): one queue of passes (``PassQueue``, which
decides) and one compute thread, which runs them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from meshnet_node.engine.ahead import run_ahead, steps_of
from meshnet_node.engine.stage import DecodeItem, Stage, StepOutput
from meshnet_node.scheduling.policy import DECODE, ROWS, WORK, Pass, PassQueue, Run, Wait

logger = logging.getLogger(__name__)

AHEAD_S = 0.05  # a pass that runs ahead (ADR-0047) stops after this long: the head streams


class Turns(Protocol):
    """The host's compute turns (``meshnet_node.swarm.host_turns.HostTurns``)."""

    def take(self) -> bool: ...
    def give(self) -> None: ...


def _timed(
    fn: Callable[[], object], before: Callable[[], None] | None, turns: Turns | None
) -> tuple[object, float]:
    """On the compute thread: ``fn()`` and how long it took. ``before`` runs first, inside
    the timed span (a fault injected at start-up: ``meshnet_node.engine.faults.SlowCompute``);
    with ``turns``, ``fn`` runs in one of the host's compute turns (the wait is not counted)."""
    started = time.perf_counter()
    if before is not None:
        before()
    took = False
    if turns is not None:
        waiting = time.perf_counter()
        took = turns.take()
        started += time.perf_counter() - waiting
    try:
        result = fn()
    finally:
        if took:
            turns.give()  # type: ignore[union-attr]
    return result, time.perf_counter() - started


def _decode_call(
    stage: Stage, items: list[DecodeItem], waiting: Callable[[], bool]
) -> Callable[[], object]:
    """The pass of decode steps ``items``: batched, one step, or one step that runs ahead
    (ADR-0047) while nothing else is ``waiting``, its session the stage's only one."""
    if len(items) > 1:
        return functools.partial(stage.step_batch, items)
    item = items[0]
    if item.ahead is not None and item.sample and len(stage.sessions) == 1:

        def ahead() -> StepOutput:
            deadline = time.perf_counter() + AHEAD_S
            return run_ahead(
                stage, item, item.ahead,  # type: ignore[arg-type]
                lambda: not waiting() and time.perf_counter() < deadline,
            )  # fmt: skip

        return ahead
    return functools.partial(
        stage.step, item.session_id, item.position, token_ids=item.token_ids,
        hidden=item.hidden, owner=item.owner, sample=item.sample, guess_from=item.guess_from,
    )  # fmt: skip


class ComputeScheduler:
    """Every pass of a node's stages, queued here and run on one compute thread.

    The compute thread is the only thread of the node that computes with the node's torch
    threads (``cpu_threads.dedicate`` gives them to it once, at start-up; every other thread
    computes with one), so a pass computes the same way whichever connection sent it and
    whenever it runs. The queue (``queue``) decides what runs next; the event loop's thread
    receives, submits and relays, and never computes a pass.

    ``before_pass``: a fault composed at start-up for tests (``engine.faults.SlowCompute``),
    run on the compute thread before every pass; ``turns``: the host's compute turns (set at
    start-up where the node has them)."""

    def __init__(
        self, *, max_batch: int = 32, turn_max_s: float = 0.25, gather_s: float = 0.005,
        before_pass: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.queue = PassQueue(max_batch=max_batch, gather_s=gather_s, turn_max_s=turn_max_s)
        self.threads: int | None = None  # the compute thread's torch threads (None: default)
        self.turns: Turns | None = None
        self.before_pass = before_pass
        self.running: Run | None = None  # the pass computing now
        self._worker: asyncio.Task | None = None
        self._arrived: asyncio.Event | None = None

    # -- what the node submits ---------------------------------------------------------------

    async def decode(self, stage: Stage, item: DecodeItem) -> StepOutput:
        """``item``'s single-token step, batched with other sessions' steps waiting too."""
        return await self._submit(Pass(DECODE, 0.0, stage=stage, item=item))

    async def rows(self, fn, *args, rows: int, **kwargs):
        """A pass of ``rows`` rows (a prompt's chunks, drafts to verify): ``fn(*args,
        **kwargs)`` on the compute thread; StepOutputs learn how long it took."""
        call = functools.partial(fn, *args, **kwargs)
        return await self._submit(Pass(ROWS, 0.0, call=call, rows=rows))

    async def run(self, fn, *args, **kwargs):
        """Other work (an audit's recomputation, a draft model's guesses) on the compute
        thread, in its turn."""
        return await self._submit(Pass(WORK, 0.0, call=functools.partial(fn, *args, **kwargs)))

    # -- what the head and the heartbeat read ------------------------------------------------

    @property
    def decode_s(self) -> float | None:
        """The last decode pass's compute time (None: unknown)."""
        return self.queue.times.decode_s

    def set_depth(self, depth: int) -> None:
        """How many micro-batches a head keeps in flight (``micro_batches``)."""
        if depth < 1:
            raise ValueError(f"micro-batches: at least 1, not {depth}")
        self.queue.depth = depth

    # -- running -----------------------------------------------------------------------------

    def _submit(self, entry: Pass) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        entry.arrived = loop.time()
        entry.future = loop.create_future()
        self.queue.add(entry)
        if self._worker is None or self._worker.done():
            self._arrived = asyncio.Event()
            self._worker = asyncio.ensure_future(self._drive())
        elif self._arrived is not None:
            self._arrived.set()
        return entry.future

    async def _drive(self) -> None:
        """Run what the queue decides until it is empty. A fault of the scheduler itself
        fails the passes waiting (their requests answer 500) rather than leaving them
        waiting forever."""
        try:
            await self._decide_and_run()
        except Exception as exc:
            logger.exception("the compute scheduler failed; the passes waiting fail")
            self._fail_waiting(exc)

    async def _decide_and_run(self) -> None:
        loop = asyncio.get_running_loop()
        arrived = self._arrived
        while True:
            decision = self.queue.next(loop.time())
            if decision is None:
                return
            if isinstance(decision, Wait):
                arrived.clear()  # type: ignore[union-attr]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(arrived.wait(), decision.until - loop.time())  # type: ignore[union-attr]
                continue
            await self._run(decision, loop)

    async def _run(self, run: Run, loop: asyncio.AbstractEventLoop) -> None:
        first = run.passes[0]
        if first.kind == DECODE:
            items = [p.item for p in run.passes]
            call = _decode_call(first.stage, items, lambda: bool(self.queue.entries))  # type: ignore[arg-type]
        else:
            call = first.call  # type: ignore[assignment]
        timed = functools.partial(_timed, call, self.before_pass, self.turns if run.turn else None)
        started, compute_s = loop.time(), None
        self.running = run
        try:
            result, compute_s = await loop.run_in_executor(self.executor, timed)
        except Exception as exc:  # the pass failed: every step it held fails with it
            results: list = [exc] * len(run.passes)
        else:
            results = result if len(run.passes) > 1 else [result]  # type: ignore[assignment]
            for out in results:
                if isinstance(out, StepOutput):
                    out.compute_s = compute_s  # a batch shares it
            if first.kind == DECODE and isinstance(result, StepOutput):
                compute_s /= steps_of(result)  # the queue's times: one step's (ADR-0047)
        finally:
            self.running = None
            self.queue.ran(run, started, loop.time(), compute_s)
        for entry, outcome in zip(run.passes, results, strict=True):
            if entry.future is None or entry.future.done():
                continue
            if isinstance(outcome, Exception):
                entry.future.set_exception(outcome)
            else:
                entry.future.set_result(outcome)

    def _fail_waiting(self, exc: Exception) -> None:
        running = self.running.passes if self.running is not None else []
        for entry in [*running, *self.queue.entries]:
            if entry.future is not None and not entry.future.done():
                entry.future.set_exception(exc)
        self.queue.entries = []

    def shutdown(self) -> None:
        """Stop: passes still queued fail, the compute thread ends after the one running."""
        self._fail_waiting(RuntimeError("the node's compute stopped"))
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

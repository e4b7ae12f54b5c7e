"""The node's compute scheduler (docs/adr/0039): one queue of passes (``PassQueue``, which
decides) and one compute thread of its own, which runs them.

The queue decides on the event loop's thread, at the end of the loop's turn in which steps
were submitted (steps that arrived together share a pass) and as soon as a pass's results
are back; the compute thread only runs what it is handed. Between them: a condition
variable one way, one callback with every result the other. No task of the loop and no
executor stand between (their wake-ups and chained futures cost ~0.1 ms each way per pass
on a CPU whose caches the pass emptied, paid at every hop of every token)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import Protocol

from meshnet_node.engine.ahead import run_ahead, steps_of
from meshnet_node.engine.stage import DecodeItem, Stage, StepOutput
from meshnet_node.scheduling.policy import DECODE, ROWS, WORK, Pass, PassQueue, Run, Wait
from meshnet_node.scheduling.sockets import SocketWatch

logger = logging.getLogger(__name__)

AHEAD_S = 0.05  # a pass that runs ahead (ADR-0047) stops after this long: the head streams


class Turns(Protocol):
    """The host's compute turns (``meshnet_node.swarm.host_turns.HostTurns``)."""

    def take(self) -> bool: ...
    def give(self) -> None: ...


def _nothing() -> None:
    pass


def _timed(
    fn: Callable[[], object], before: Callable[[], None] | None, turns: Turns | None,
    *, keep: bool = False,
) -> tuple[object, float]:  # fmt: skip
    """On the compute thread: ``fn()`` and how long it took. ``before`` runs first, inside
    the timed span (a fault injected at start-up: ``meshnet_node.engine.faults.SlowCompute``);
    with ``turns``, ``fn`` runs in one of the host's compute turns (the wait is not counted).
    ``keep``: a turn taken is kept once ``fn`` returned, for the caller to give back
    (``turns.give``) once the pass's output is on its way: a give on the critical path
    costs ~20 us on a core whose caches the pass emptied (one raised is given at once)."""
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
    except BaseException:
        if took:
            turns.give()  # type: ignore[union-attr]
        raise
    if took and not keep:
        turns.give()  # type: ignore[union-attr]
    return result, time.perf_counter() - started


def _piece(ctx: contextvars.Context, steps: Generator) -> tuple[bool, object, float]:
    """On the compute thread: ``steps`` on to its next yield, in ``ctx``: (whether it
    ended, what it returned, how long the piece took)."""
    started = time.perf_counter()
    try:
        ctx.run(next, steps)
    except StopIteration as done:
        return True, done.value, time.perf_counter() - started
    return False, None, time.perf_counter() - started


def _decode_call(
    stage: Stage, items: list[DecodeItem], waiting: Callable[[], bool],
    turns: Turns | None = None,
) -> tuple[Callable[[], object], Turns | None]:  # fmt: skip
    """The pass of decode steps ``items``: batched, one step, or one step that runs ahead
    (ADR-0047) while nothing else is ``waiting``, its session the stage's only one; and the
    turns to take around it (``turns``; none around a head's burst down its lane, which
    takes a turn for each of its own passes and none while the chain computes, ADR-0059)."""
    if len(items) > 1:
        return functools.partial(stage.step_batch, items), turns
    item = items[0]
    ahead = item.ahead
    if ahead is not None and item.sample and len(stage.sessions) == 1:
        if ahead.down is not None:  # its tokens reach the loop as they come: no deadline
            down = ahead.down
            return functools.partial(
                down.run, stage, item, lambda: not waiting(),
                lambda fn: _timed(fn, None, turns, keep=True),
                _nothing if turns is None else turns.give,
            ), None  # fmt: skip
        deadline = time.perf_counter() + AHEAD_S

        def go_on() -> bool:
            return not waiting() and time.perf_counter() < deadline

        return functools.partial(run_ahead, stage, item, ahead, go_on), turns
    return functools.partial(
        stage.step, item.session_id, item.position, token_ids=item.token_ids,
        hidden=item.hidden, owner=item.owner, sample=item.sample, guess_from=item.guess_from,
    ), turns  # fmt: skip


class ComputeScheduler:
    """Every pass of a node's stages, queued here and run on one compute thread.

    The compute thread is the only thread of the node that computes with the node's torch
    threads (``cpu_threads.dedicate`` gives them to it once, at start-up; every other thread
    computes with one), so a pass computes the same way whichever connection sent it and
    whenever it runs. The queue (``queue``) decides what runs next, on the event loop's
    thread, which receives, submits and relays, and never computes a pass.

    ``before_pass``: a fault composed at start-up for tests (``engine.faults.SlowCompute``),
    run on the compute thread before every pass; ``turns``: the host's compute turns (set at
    start-up where the node has them); ``clock``: the queue's clock."""

    def __init__(
        self, *, max_batch: int = 32, turn_max_s: float = 0.25, gather_s: float = 0.005,
        before_pass: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.queue = PassQueue(max_batch=max_batch, gather_s=gather_s, turn_max_s=turn_max_s)
        self.threads: int | None = None  # the compute thread's torch threads (None: default)
        self.turns: Turns | None = None
        self.before_pass = before_pass
        self.running: Run | None = None  # the pass computing now (set and cleared on the loop)
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None  # where passes are submitted
        self._deciding = False  # a decision is due at the end of the loop's turn
        self._timer: asyncio.TimerHandle | None = None  # a decision due after a Wait
        # The compute thread's side: what it is handed, under ``_cond``.
        self._cond = threading.Condition()
        self._job: Run | None = None
        self._calls: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self._thread: threading.Thread | None = None
        self._stopped = False
        # Sockets it reads between passes (decode lanes, docs/adr/0058); None: none, it
        # waits on ``_cond`` alone.
        self.sockets: SocketWatch | None = None

    # -- what the node submits ---------------------------------------------------------------

    async def decode(self, stage: Stage, item: DecodeItem) -> StepOutput:
        """``item``'s single-token step, batched with other sessions' steps waiting too."""
        return await self._submit(Pass(DECODE, 0.0, stage=stage, item=item))

    async def rows(self, fn, *args, rows: int, **kwargs):
        """A pass of ``rows`` rows (a prompt's chunks, drafts to verify): ``fn(*args,
        **kwargs)`` on the compute thread; StepOutputs learn how long it took."""
        call = functools.partial(fn, *args, **kwargs)
        return await self._submit(Pass(ROWS, 0.0, call=call, rows=rows))

    async def stepwise(self, steps: Generator[None, None, object]):
        """A pass that yields between its layers (``Stage.stepping`` of a prompt's call,
        ADR-0053), run a piece at a time: each piece is a pass of its own, so that the decode
        passes queued meanwhile run between a long prompt's layers rather than after all of
        them. Its pieces run in a context of their own (a prompt's product settings never
        reach another pass); a caller that leaves stops it between pieces. Returns what
        ``steps`` returns, a StepOutput learning its pieces' compute time."""
        ctx, spent, resumed = contextvars.copy_context(), 0.0, False
        try:
            while True:
                entry = Pass(WORK, 0.0, call=functools.partial(_piece, ctx, steps))
                entry.resumed, resumed = resumed, True
                done, value, took = await self._submit(entry)
                spent += took
                if done:
                    if isinstance(value, StepOutput):
                        value.compute_s = spent
                    return value
        except BaseException:
            with contextlib.suppress(RuntimeError):  # stopped: the thread closes nothing more
                self.call(functools.partial(ctx.run, steps.close))  # between passes, there
            raise

    async def run(self, fn, *args, **kwargs):
        """Other work (an audit's recomputation, a draft model's guesses) on the compute
        thread, in its turn."""
        return await self._submit(Pass(WORK, 0.0, call=functools.partial(fn, *args, **kwargs)))

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """``fn()`` on the compute thread, between passes, from any thread (the start-up's
        ``cpu_threads.dedicate``); its future, to wait on outside a loop."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("the node's compute stopped")
            self._calls.append((fn, done))
            self._start()
            self._notify()
        return done

    def read_sockets(self) -> SocketWatch:
        """The compute thread's sockets (decode lanes): from now on it waits on them
        between passes and reads them there."""
        if self.sockets is None:
            self.sockets = SocketWatch()
            with self._cond:
                self._start()
                self._cond.notify()  # a thread waiting on the condition alone: on the sockets
        return self.sockets

    def _notify(self) -> None:
        """Under ``_cond``: the compute thread has something to run."""
        self._cond.notify()
        if self.sockets is not None:
            self.sockets.wake()

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

    # -- deciding, on the loop ---------------------------------------------------------------

    def _submit(self, entry: Pass) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        entry.future = loop.create_future()
        if self._stopped:
            entry.future.set_exception(RuntimeError("the node's compute stopped"))
            return entry.future
        entry.arrived = self._clock()
        self.queue.add(entry)
        if self._loop is not loop:  # another loop (a test's next asyncio.run): start over
            self._loop, self._deciding, self._timer = loop, False, None
        if not self._deciding:  # once every step submitted in this turn of the loop is in
            self._deciding = True
            loop.call_soon(self._decide)
        return entry.future

    def _decide(self) -> None:
        """Ask the queue (the compute thread free) and hand it what to run, or come back
        when the queue says to wait; an arrival or a pass's end decides again."""
        self._deciding = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.running is not None or self._stopped:
            return  # decided again once the pass ends
        try:
            decision = self.queue.next(self._clock())
        except Exception as exc:  # a fault of the queue itself: the passes waiting fail
            logger.exception("the compute scheduler failed; the passes waiting fail")
            failed, self.queue.entries = self.queue.entries, []
            _settle([(p.future, exc) for p in failed if p.future is not None])
            return
        if decision is None:
            return
        if isinstance(decision, Wait):
            delay = max(0.0, decision.until - self._clock())
            self._timer = self._loop.call_later(delay, self._decide)  # type: ignore[union-attr]
            return
        self.running = decision
        with self._cond:
            self._job = decision
            self._start()
            self._notify()

    def _finished(self, run: Run, results: list, started: float, ended: float,
                  compute_s: float | None) -> None:  # fmt: skip
        """On the loop: a pass's results to its steps, then the next decision."""
        self.running = None
        self.queue.ran(run, started, ended, compute_s)
        _settle([(p.future, out) for p, out in zip(run.passes, results, strict=True)
                 if p.future is not None])  # fmt: skip
        self._decide()

    # -- running, on the compute thread ------------------------------------------------------

    def _start(self) -> None:
        """Start the compute thread (under ``_cond``) unless it runs."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="compute", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        """Run what it is handed, calls first, until stopped."""
        while True:
            with self._cond:
                while not (self._stopped or self._calls or self._job is not None):
                    if self.sockets is not None:
                        break  # waits on the sockets, below
                    self._cond.wait()
                if self._calls:
                    fn, done = self._calls.popleft()
                    run = None
                elif self._job is not None:
                    run, self._job = self._job, None
                elif self._stopped:
                    if self.sockets is not None:  # its lanes end with it
                        self.sockets.close()
                    return
                else:
                    run = _SOCKETS
            if run is _SOCKETS:
                self.sockets.wait()  # type: ignore[union-attr]
            elif run is None:
                if done.set_running_or_notify_cancel():
                    try:
                        done.set_result(fn())
                    except BaseException as exc:  # handed to the caller
                        done.set_exception(exc)
            else:
                self._run(run)

    def _waiting(self) -> bool:
        """On the compute thread: whether something else waits for it (a pass queued, a
        call, a lane's step): a pass that runs ahead stops for it."""
        return bool(self.queue.entries or self._calls) or (
            self.sockets is not None and self.sockets.ready()
        )

    def _run(self, run: Run) -> None:
        first = run.passes[0]
        items: list[DecodeItem] = []
        started, compute_s = self._clock(), None
        try:
            if first.kind == DECODE:  # inputs made tensors here, not on the loop
                items = [p.item.made() for p in run.passes]  # type: ignore[union-attr]
                call, turns = _decode_call(
                    first.stage, items, self._waiting,  # type: ignore[arg-type]
                    self.turns if run.turn else None,
                )  # fmt: skip
            else:
                call, turns = first.call, self.turns if run.turn else None  # type: ignore[assignment]
            before = None if first.resumed else self.before_pass  # once per pass
            result, compute_s = _timed(call, before, turns)
        except Exception as exc:  # the pass failed: every step it held fails with it
            results: list = [exc] * len(run.passes)
        else:
            results = result if len(run.passes) > 1 else [result]  # type: ignore[assignment]
            down = items[0].ahead.down if items and items[0].ahead is not None else None
            if down is not None and down.steps and isinstance(result, StepOutput):
                compute_s = result.compute_s  # a burst: the head's passes, not the chain's
            for out in results:
                if isinstance(out, StepOutput):
                    out.compute_s = compute_s  # a batch shares it
            if first.kind == DECODE and isinstance(result, StepOutput):
                # the queue's times: one step's (ADR-0047, 0059)
                compute_s /= down.steps if down is not None and down.steps else steps_of(result)
            _encode_outputs(items, results)
        try:
            self._loop.call_soon_threadsafe(  # type: ignore[union-attr]
                self._finished, run, results, started, self._clock(), compute_s
            )
        except RuntimeError:  # the loop closed meanwhile: nobody waits for these
            self.running = None
            with contextlib.suppress(RuntimeError):  # a loop that took over decides again
                self._loop.call_soon_threadsafe(self._decide)  # type: ignore[union-attr]

    def shutdown(self) -> None:
        """Stop: passes still queued fail, the compute thread ends after the one running."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
        waiting, self.queue.entries = self.queue.entries, []
        stopped = RuntimeError("the node's compute stopped")
        running = self.running.passes if self.running is not None else []
        _settle([(p.future, stopped) for p in (*running, *waiting) if p.future is not None])
        with self._cond:
            calls, self._calls = list(self._calls), deque()
            self._cond.notify_all()
            if self.sockets is not None:
                self.sockets.wake()
        for _fn, done in calls:
            if done.set_running_or_notify_cancel():
                done.set_exception(stopped)


_SOCKETS = object()  # the compute thread has nothing to run: it reads its sockets


def _encode_outputs(items: list[DecodeItem], results: list) -> None:
    """On the compute thread, where torch has just run: each decode output's hidden states
    as its next hop's frame (``DecodeItem.encode``). One that fails is left to the loop,
    which encodes it again and meets the error there."""
    for item, out in zip(items, results, strict=False):
        if (
            item.encode is not None and isinstance(out, StepOutput) and out.hidden is not None
            and out.frame is None  # a burst wrote it on its lane (ADR-0059)
        ):  # fmt: skip
            try:
                out.frame = item.encode(out.hidden)
            except Exception:  # raised again where the step is relayed
                out.frame = None


def _settle(pairs: list) -> None:
    """On the loop: set each future not yet done (a caller that left cancelled its own)."""
    for future, outcome in pairs:
        if future.done():
            continue
        with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits there
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

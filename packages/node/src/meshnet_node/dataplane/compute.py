"""The node's compute thread: where a stage's passes run, how long they take, and whether a
short pass may run on the event loop's thread instead."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from meshnet_node.cpu_threads import computing
from meshnet_node.engine.stage import Stage, StepOutput


class Turns(Protocol):
    """The host's compute turns (``meshnet_node.swarm.host_turns.HostTurns``)."""

    def take(self) -> bool: ...
    def give(self) -> None: ...


def _timed(
    fn, *args, before: Callable[[], None] | None = None, turns: Turns | None = None, **kwargs
):
    """Call ``fn``; StepOutputs it returns learn how long it took (a batch shares it).

    ``before`` runs first, inside the timed span, on the calling thread (a fault injected
    at start-up: ``meshnet_node.engine.faults.SlowCompute``). ``turns``: ``fn`` runs in one
    of the host's compute turns (the wait for it is not counted)."""
    started = time.perf_counter()
    if before is not None:
        before()
    took = False
    if turns is not None:
        waiting = time.perf_counter()
        took = turns.take()
        started += time.perf_counter() - waiting
    try:
        result = fn(*args, **kwargs)
    finally:
        if took:
            turns.give()  # type: ignore[union-attr]
    elapsed = time.perf_counter() - started
    for out in result if isinstance(result, list) else (result,):
        if isinstance(out, StepOutput):
            out.compute_s = elapsed
    return result


class ComputeThread:
    """One compute thread (torch parallelizes inside an op; passes of sessions queue here),
    the passes running now, and the last passes' times.

    A pass runs on the loop's thread only while passes like it are known to be short
    (``inline_max_s``): a long one there would stall /health, heartbeats' I/O and every other
    connection (``--inline-decode``, ``--inline-decode-max-ms``). In a node process the
    loop's thread owns the node's torch threads (``cpu_threads.dedicate``): inline passes
    run only there, and the compute thread runs each of its passes on a thread of its own
    with as many (``cpu_threads.computing``), which ends with the pass. An inline pass
    first takes one of the host's compute turns (``turns``, when the node has them), so that
    the short passes of the nodes sharing a host do not compute at once."""

    def __init__(
        self, *, inline_decode: bool, inline_max_s: float,
        before_pass: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.inline_decode = inline_decode
        self.threads: int | None = None  # torch threads passes use (None: torch's default)
        self.owner: int | None = None  # the thread owning them, where inline passes run
        self.inline_max_s = inline_max_s
        self.before_pass = before_pass  # tests only: a fault composed at start-up, or None
        self.turns: Turns | None = None  # the host's compute turns, taken by inline passes
        self.in_flight = 0  # passes computing now
        self.inline_runs = 0  # passes run on the loop's thread so far
        self.decode_s: float | None = None  # the last decode pass's compute time (None: unknown)
        self.row_s: float | None = None  # the last pass of several rows: its time per row

    def own(self, owner: int, threads: int) -> None:
        """Thread ``owner`` (the loop's) computes with ``threads`` and runs the inline passes;
        the compute thread computes with one and runs each pass on a thread of its own."""
        self.owner, self.threads = owner, threads

    async def run(self, fn, *args, **kwargs):
        """Run ``fn`` on the compute thread; StepOutputs learn how long it took."""
        call = functools.partial(_timed, fn, *args, before=self.before_pass, **kwargs)
        if self.owner is not None and self.threads is not None and self.threads > 1:
            call = functools.partial(computing, call, self.threads)  # its team ends with it
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, call)
        finally:
            self.in_flight -= 1

    async def run_decode(self, fn, *args, **kwargs):
        """A decode pass (one step, or a batch of them): on the caller's thread while decode
        passes are known to be short, else on the compute thread. Its time decides where the
        next one runs."""
        if self.may_inline(self.decode_s):
            return self.run_inline(fn, *args, **kwargs)
        out = await self.run(fn, *args, **kwargs)
        self.note_decode(out if isinstance(out, list) else (out,))
        return out

    def run_inline(self, fn, *args, **kwargs):
        """Run a decode pass on the caller's (the loop's) thread."""
        out = self._inline(fn, *args, **kwargs)
        self.note_decode(out if isinstance(out, list) else (out,))
        return out

    async def run_rows(self, fn, *args, rows: int, inline: bool = True, **kwargs):
        """Run a pass of ``rows`` rows (a prompt, drafts to verify): on the caller's thread
        where allowed (``inline``) and passes of as many rows are known to be short, else on
        the compute thread. Its time per row is remembered."""
        if inline and self.may_inline(self.expected_s(rows)):
            out = self._inline(fn, *args, **kwargs)
        else:
            out = await self.run(fn, *args, **kwargs)
        if isinstance(out, StepOutput) and out.compute_s is not None and rows > 1:
            self.row_s = out.compute_s / rows
        return out

    def _inline(self, fn, *args, **kwargs):
        self.in_flight += 1
        self.inline_runs += 1  # the loop is blocked meanwhile (a link probe's time is off)
        try:
            return _timed(fn, *args, before=self.before_pass, turns=self.turns, **kwargs)
        finally:
            self.in_flight -= 1

    def expected_s(self, rows: int) -> float | None:
        """How long a pass of ``rows`` rows should take here (None: not known yet)."""
        if rows <= 1:
            return self.decode_s
        if self.row_s is None:
            return None
        return max(self.decode_s or 0.0, rows * self.row_s)

    def may_inline(self, expected_s: float | None) -> bool:
        """Whether a pass expected to take ``expected_s`` may run on the caller's thread:
        allowed by the settings, called from the thread owning the torch threads, nothing
        else computing, and known to be short (``--inline-decode-max-ms``)."""
        return (
            self.inline_decode
            and (self.owner is None or self.owner == threading.get_ident())
            and expected_s is not None
            and expected_s < self.inline_max_s
            and self.in_flight == 0
        )

    def note_decode(self, results: Iterable) -> None:
        """Remember how long a decode pass took."""
        for out in results:
            if isinstance(out, StepOutput) and out.compute_s is not None:
                self.decode_s = out.compute_s
                return

    def forget_decode_time(self) -> None:
        """Another shard: its pass times are not known yet."""
        self.decode_s = self.row_s = None

    def inline_ok(self, stage: Stage) -> bool:
        """Whether a decode step of ``stage`` may run on the caller's thread: allowed by the
        settings, nothing else computing, no other session that could send a step to batch,
        and this stage's decode steps known to be short (``--inline-decode-max-ms``): the
        first step of a shard, and every step of a slow one, runs on the compute thread."""
        return self.may_inline(self.decode_s) and len(stage.sessions) <= 1

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

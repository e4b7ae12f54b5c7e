"""The node's compute thread: where a stage's passes run, how long they take, and whether a
lone decode step may run on the event loop's thread instead."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from meshnet_node.engine.stage import Stage, StepOutput


def _timed(fn, *args, before: Callable[[], None] | None = None, **kwargs):
    """Call ``fn``; StepOutputs it returns learn how long it took (a batch shares it).

    ``before`` runs first, inside the timed span, on the calling thread (a fault injected
    at start-up: ``meshnet_node.engine.faults.SlowCompute``)."""
    started = time.perf_counter()
    if before is not None:
        before()
    result = fn(*args, **kwargs)
    elapsed = time.perf_counter() - started
    for out in result if isinstance(result, list) else (result,):
        if isinstance(out, StepOutput):
            out.compute_s = elapsed
    return result


class ComputeThread:
    """One compute thread (torch parallelizes inside an op; steps of sessions queue here),
    the passes running now, and the last decode pass's time.

    A decode step runs on the loop's thread only while steps are known to be short
    (``inline_max_s``): a long one there would stall /health, heartbeats' I/O and every other
    connection (``--inline-decode``, ``--inline-decode-max-ms``); and in a node process only
    with one torch thread (``cpu_threads.dedicate``)."""

    def __init__(
        self, *, inline_decode: bool, inline_max_s: float,
        before_pass: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.inline_decode = inline_decode
        self.threads: int | None = None  # torch threads it computes with (None: torch's default)
        self.inline_max_s = inline_max_s
        self.before_pass = before_pass  # tests only: a fault composed at start-up, or None
        self.in_flight = 0  # passes computing now
        self.inline_runs = 0  # passes run on the loop's thread so far
        self.decode_s: float | None = None  # the last decode pass's compute time (None: unknown)

    async def run(self, fn, *args, **kwargs):
        """Run ``fn`` on the compute thread; StepOutputs learn how long it took."""
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.executor, lambda: _timed(fn, *args, before=self.before_pass, **kwargs)
            )
        finally:
            self.in_flight -= 1

    async def run_decode(self, fn, *args, **kwargs):
        """``run`` for a decode pass, whose time decides whether the next may run inline."""
        out = await self.run(fn, *args, **kwargs)
        self.note_decode(out if isinstance(out, list) else (out,))
        return out

    def run_inline(self, fn, *args, **kwargs):
        """Run a decode pass on the caller's (the loop's) thread."""
        self.in_flight += 1
        self.inline_runs += 1  # the loop is blocked meanwhile (a link probe's time is off)
        try:
            out = _timed(fn, *args, before=self.before_pass, **kwargs)
        finally:
            self.in_flight -= 1
        self.note_decode((out,))
        return out

    def note_decode(self, results: Iterable) -> None:
        """Remember how long a decode pass took."""
        for out in results:
            if isinstance(out, StepOutput) and out.compute_s is not None:
                self.decode_s = out.compute_s
                return

    def forget_decode_time(self) -> None:
        """Another shard: its step time is not known yet."""
        self.decode_s = None

    def inline_ok(self, stage: Stage) -> bool:
        """Whether a decode step of ``stage`` may run on the caller's thread: allowed by the
        settings, nothing else computing, no other session that could send a step to batch,
        and this stage's decode steps known to be short (``--inline-decode-max-ms``): the
        first step of a shard, and every step of a slow one, runs on the compute thread."""
        return (
            self.inline_decode
            and self.decode_s is not None
            and self.decode_s < self.inline_max_s
            and self.in_flight == 0
            and len(stage.sessions) <= 1
        )

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

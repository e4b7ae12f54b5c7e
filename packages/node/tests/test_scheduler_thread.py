"""The compute scheduler's own thread (ADR-0039, amended 2026-12-06): every pass and every
call on one thread, results back on the loop, a loop that closed mid-pass leaves it usable,
a shutdown fails what still waits; a pass run a piece at a time (ADR-0053)."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from meshnet_node.scheduling.scheduler import ComputeScheduler


def test_passes_and_calls_run_on_one_thread_and_answer_on_the_loop():
    scheduler = ComputeScheduler()
    started = scheduler.call(threading.get_ident).result(timeout=10)

    async def main() -> list[int]:
        return await asyncio.gather(*(scheduler.run(threading.get_ident) for _ in range(5)))

    assert set(asyncio.run(main())) == {started} != {threading.get_ident()}
    scheduler.shutdown()


def test_a_loop_that_closed_mid_pass_leaves_the_scheduler_to_the_next():
    scheduler, entered, release = ComputeScheduler(), threading.Event(), threading.Event()

    def held() -> str:
        entered.set()
        release.wait(10)
        return "late"

    async def leave_mid_pass() -> None:
        task = asyncio.ensure_future(scheduler.run(held))
        await asyncio.to_thread(entered.wait, 10)
        task.cancel()  # the caller leaves; asyncio.run then closes its loop

    asyncio.run(leave_mid_pass())
    release.set()

    async def next_loop() -> str:
        return await asyncio.wait_for(scheduler.run(lambda: "served"), 10)

    assert asyncio.run(next_loop()) == "served"
    scheduler.shutdown()


def test_a_shutdown_fails_the_passes_still_queued():
    scheduler, release = ComputeScheduler(), threading.Event()

    async def main() -> None:
        first = asyncio.ensure_future(scheduler.run(release.wait, 10))
        second = asyncio.ensure_future(scheduler.run(lambda: "never"))
        await asyncio.sleep(0.05)
        scheduler.shutdown()
        release.set()
        with pytest.raises(RuntimeError, match="compute stopped"):
            await second
        with pytest.raises(RuntimeError, match="compute stopped"):
            await first  # its caller was answered at the shutdown; the pass ran on

    asyncio.run(main())
    with pytest.raises(RuntimeError, match="compute stopped"):
        scheduler.call(lambda: None)


def test_a_stepwise_pass_lets_passes_queued_meanwhile_run_between_its_pieces():
    """A prompt's pass a layer at a time (ADR-0053): a pass queued while a piece computes
    runs before the next piece, and never sees the settings the pieces made in their own
    context."""
    scheduler, started, gate = ComputeScheduler(), threading.Event(), threading.Event()
    setting = contextvars.ContextVar("setting", default=0)
    order: list[str] = []

    def steps():
        setting.set(7)
        started.set()
        gate.wait(10)
        order.append("piece 0")
        yield
        order.append(f"piece 1 sees {setting.get()}")
        return "done"

    async def main():
        prompt = asyncio.ensure_future(scheduler.stepwise(steps()))
        await asyncio.to_thread(started.wait, 10)
        other = asyncio.ensure_future(
            scheduler.run(lambda: order.append(f"other sees {setting.get()}"))
        )
        await asyncio.sleep(0.02)  # queued behind piece 0
        gate.set()
        return await prompt, await other

    assert asyncio.run(main()) == ("done", None)
    assert order == ["piece 0", "other sees 0", "piece 1 sees 7"]
    scheduler.shutdown()


def test_a_caller_that_leaves_a_stepwise_pass_closes_it_on_the_compute_thread():
    scheduler, started, gate = ComputeScheduler(), threading.Event(), threading.Event()
    compute = scheduler.call(threading.get_ident).result(timeout=10)
    closed: list[int] = []

    def steps():
        try:
            started.set()
            gate.wait(10)
            yield
            yield
        finally:
            closed.append(threading.get_ident())

    async def main() -> None:
        task = asyncio.ensure_future(scheduler.stepwise(steps()))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()  # mid-piece: the piece ends, then the pass is stopped there
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    scheduler.call(lambda: None).result(timeout=10)  # calls run in order: after the close
    assert closed == [compute]
    scheduler.shutdown()

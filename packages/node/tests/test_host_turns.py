"""The host's compute turns (docs/adr/0036): the short passes of the nodes sharing a host
take one of ``cpus // threads`` lock files in turn; a dead holder's lock goes with it, and a
stopped one is waited for at most the patience."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap

from meshnet_node.scheduling.scheduler import ComputeScheduler
from meshnet_node.settings import NodeSettings
from meshnet_node.swarm import host_turns
from meshnet_node.swarm.host_turns import SKIP_S, HostTurns, node_turns


class FakeClock:
    """Time that passes only when someone sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def turns(folder, slots: int = 1, patience_s: float = 0.25, clock: FakeClock | None = None):
    clock = clock or FakeClock()
    return HostTurns(slots, patience_s=patience_s, folder=folder, clock=clock, sleep=clock.sleep)


def test_one_turn_at_a_time_between_two_nodes(tmp_path):
    a, b = turns(tmp_path), turns(tmp_path)
    assert a.take() and a.held == 0
    assert not a.take()  # already held: a pass never takes two
    a.give()
    assert b.take() and b.waits == 0  # free: taken at once, nobody waited
    b.give()
    assert a.take()


def test_a_waiter_takes_the_turn_once_it_is_given_back(tmp_path):
    clock = FakeClock()
    holder, waiter = turns(tmp_path), turns(tmp_path, clock=clock)
    assert holder.take()

    def sleep(seconds: float) -> None:  # the holder's pass ends while the waiter sleeps
        FakeClock.sleep(clock, seconds)
        if len(clock.slept) == 3:
            holder.give()

    waiter._sleep = sleep
    assert waiter.take() and waiter.waits == 1 and len(clock.slept) == 3
    assert clock.slept == sorted(clock.slept)  # it looks again less and less often


def test_slots_let_as_many_passes_compute_at_once(tmp_path):
    a, b, c = (turns(tmp_path, slots=2) for _ in range(3))
    assert a.take() and b.take() and {a.held, b.held} == {0, 1}
    assert not c.take() and c.gave_up == 1


def test_a_stopped_holder_is_waited_for_at_most_the_patience(tmp_path, caplog):
    clock = FakeClock()
    holder, waiter = turns(tmp_path), turns(tmp_path, patience_s=0.25, clock=clock)
    assert holder.take()  # and never gives it back (a SIGSTOPped node)
    with caplog.at_level(logging.WARNING, logger=host_turns.__name__):
        assert not waiter.take()
    assert 0.25 <= sum(clock.slept) < 0.25 + 0.002 and "without turns" in caplog.text
    clock.slept.clear()
    assert not waiter.take() and clock.slept == []  # computes without turns, at once ...
    clock.now += SKIP_S
    holder.give()
    assert waiter.take()  # ... until the skip ends


def test_a_dead_holders_turn_is_free(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from meshnet_node.swarm.host_turns import HostTurns
        t = HostTurns(1, patience_s=0.1, folder=Path({str(tmp_path)!r}))
        assert t.take()
        print("held", flush=True)
        time.sleep(600)
    """)  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        waiter = turns(tmp_path)
        assert not waiter._try()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert waiter.take()
    finally:
        proc.kill()


def test_a_short_pass_computes_in_a_turn_and_gives_it_back(tmp_path):
    compute = ComputeScheduler(turn_max_s=0.25)
    compute.turns = turns(tmp_path)
    other = turns(tmp_path)
    seen: list[bool] = []

    def step() -> str:
        seen.append(other._try())  # another node cannot take the turn meanwhile
        other.give()
        return "done"

    async def passes() -> list[str]:
        unknown = await compute.rows(step, rows=8)  # its length unknown: no turn
        compute.queue.times.row_s = 0.001  # 8 rows: 8 ms, short
        short = await compute.rows(step, rows=8)
        compute.queue.times.row_s = 1.0  # 8 s: too long to keep the host's nodes waiting
        long = await compute.rows(step, rows=8)
        return [unknown, short, long]

    assert asyncio.run(passes()) == ["done"] * 3
    assert seen == [True, False, True]  # the other node could take it, but not in a turn
    assert other.take()  # given back after the pass
    compute.shutdown()


def test_a_pass_may_keep_its_turn_until_its_output_is_on_its_way(tmp_path):
    """``_timed(keep=True)``: a lane's pass keeps its turn after it returned, for the hop
    to give back once its step is written; a pass that raised gives it back at once."""
    import pytest

    from meshnet_node.scheduling.scheduler import _timed

    mine, other = turns(tmp_path), turns(tmp_path)
    out, _ = _timed(lambda: "done", None, mine, keep=True)
    assert out == "done" and mine.held == 0
    assert not other._try()  # still held
    mine.give()
    assert other._try()
    other.give()
    with pytest.raises(RuntimeError):
        _timed(lambda: (_ for _ in ()).throw(RuntimeError("pass failed")), None, mine, keep=True)
    assert mine.held is None and other._try()  # given back with the failure
    other.give()
    _timed(lambda: None, None, mine)  # by default given back as the pass returns
    assert mine.held is None


def test_turns_are_for_cpu_nodes(tmp_path, monkeypatch):
    monkeypatch.setattr(host_turns, "default_claims_dir", lambda: tmp_path)
    monkeypatch.setattr(host_turns, "host_cpus", lambda: 4)
    made = node_turns(NodeSettings(), 2, "cpu")
    assert made is not None and made.slots == 2 and made.patience_s == 0.25
    assert node_turns(NodeSettings(), 1, "cuda") is None
    assert node_turns(NodeSettings(turn_max_ms=40), 2, "cpu").patience_s == 0.04
    assert os.path.exists(tmp_path / "turn-1.lock")

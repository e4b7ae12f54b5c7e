"""The compute scheduler's decisions (docs/adr/0039), on a fake clock: what runs next, which
decode steps share a pass, how long a step waits for others, which passes take a host turn,
how many prompt tokens a pass takes. No thread, no model: the queue is given the time."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from meshnet_node.engine.stage import DecodeItem
from meshnet_node.scheduling.policy import DECODE, ROWS, WORK, Pass, PassQueue, Run, Wait


@dataclass
class Sessions:
    open: set[str] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.open)

    def peek(self, sid: str):
        return sid if sid in self.open else None


def stage(*sids: str, head: bool = False, tail: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        sessions=Sessions(set(sids)), shard=SimpleNamespace(is_head=head, is_tail=tail),
        max_chunk_tokens=128,
    )  # fmt: skip


def step(on, sid: str, at: float) -> Pass:
    return Pass(DECODE, at, stage=on, item=DecodeItem(sid, 3))


def sids(run: Run) -> list[str]:
    return [p.item.session_id for p in run.passes]


GATHER = 0.005


def wait(until: float) -> Wait:
    return Wait(pytest.approx(until))  # type: ignore[arg-type]


def test_a_lone_session_runs_at_once():
    queue, middle = PassQueue(gather_s=GATHER), stage("a")
    queue.add(step(middle, "a", 10.0))
    run = queue.next(10.0)
    assert isinstance(run, Run) and sids(run) == ["a"] and queue.next(10.0) is None


def test_a_step_waits_a_moment_for_the_other_sessions_steps():
    queue, middle = PassQueue(gather_s=GATHER), stage("a", "b", "c")
    queue.add(step(middle, "a", 10.0))
    assert queue.next(10.0) == wait(10.0 + GATHER)
    queue.add(step(middle, "b", 10.001))
    assert queue.next(10.001) == wait(10.0 + GATHER)  # the window runs from the first
    queue.add(step(middle, "c", 10.002))
    run = queue.next(10.002)  # every open session waits: no reason to wait longer
    assert isinstance(run, Run) and sids(run) == ["a", "b", "c"]
    queue.ran(run, 10.002, 10.010, 0.008)
    assert queue.batches == 1 and queue.batched_steps == 3 and queue.times.decode_s == 0.008


def test_the_window_ends_and_those_there_run_together():
    queue, middle = PassQueue(gather_s=GATHER), stage("a", "b", "c")
    queue.add(step(middle, "a", 10.0))
    queue.add(step(middle, "b", 10.003))
    run = queue.next(10.0 + GATHER)
    assert isinstance(run, Run) and sids(run) == ["a", "b"]


def test_the_window_opens_when_the_compute_thread_comes_free():
    """Steps that queued behind a long pass wait at most ``gather_s`` after it."""
    queue, middle = PassQueue(gather_s=GATHER), stage("a", "b")
    queue.add(Pass(ROWS, 10.0, call=lambda: None, rows=128))
    prompt = queue.next(10.0)
    assert isinstance(prompt, Run) and prompt.passes[0].kind == ROWS
    queue.add(step(middle, "a", 10.01))
    queue.ran(prompt, 10.0, 10.2, 0.2)
    assert queue.times.row_s == pytest.approx(0.2 / 128) and queue.times.decode_s is None
    assert queue.next(10.2) == wait(10.2 + GATHER)


def test_passes_run_in_the_order_they_came():
    queue, middle = PassQueue(gather_s=GATHER), stage("a")
    work = Pass(WORK, 9.0, call=lambda: None)
    queue.add(work)
    queue.add(step(middle, "a", 9.5))
    queue.add(Pass(ROWS, 9.6, call=lambda: None, rows=2))
    kinds = []
    while (run := queue.next(10.0)) is not None:
        kinds.append(run.passes[0].kind)
    assert kinds == [WORK, DECODE, ROWS]


def test_a_pass_holds_one_step_per_session_and_at_most_max_batch():
    queue, middle = PassQueue(gather_s=GATHER, max_batch=2), stage("a", "b", "c")
    for sid, at in (("a", 1.0), ("a", 1.0), ("b", 1.0), ("c", 1.0)):
        queue.add(step(middle, sid, at))
    first = queue.next(1.0)
    assert sids(first) == ["a", "b"]
    assert sids(queue.next(2.0)) == ["a", "c"]


def test_steps_of_another_stage_never_share_a_pass():
    """A node keeps its previous shard until its sessions end (a reshard)."""
    queue, new, old = PassQueue(gather_s=GATHER), stage("a"), stage("b")
    queue.add(step(old, "b", 1.0))
    queue.add(step(new, "a", 1.0))
    assert sids(queue.next(1.0)) == ["b"] and sids(queue.next(1.0)) == ["a"]


def test_a_head_keeps_each_session_in_its_micro_batch():
    queue, head = PassQueue(gather_s=GATHER, depth=2), stage("a", "b", "c", "d", head=True)
    for sid in "abcd":
        queue.add(step(head, sid, 1.0))
    first, second = queue.next(1.0), queue.next(1.0)
    assert sids(first) == ["a", "c"] and sids(second) == ["b", "d"]
    queue.ran(first, 1.0, 1.01, 0.01)
    queue.ran(second, 1.01, 1.02, 0.01)
    for sid in "dcba":  # back in another order: the same micro-batches
        queue.add(step(head, sid, 1.05))
    assert sorted(sids(queue.next(1.05))) == ["b", "d"]
    assert sorted(sids(queue.next(1.05))) == ["a", "c"]


def test_a_head_waits_a_cycle_for_a_member_still_down_the_chain():
    queue, head = PassQueue(gather_s=GATHER, depth=2), stage("a", "b", "c", "d", head=True)
    for sid in "abcd":
        queue.add(step(head, sid, 1.0))
    for run in (queue.next(1.0), queue.next(1.0)):
        queue.ran(run, 1.0, 1.1, 0.1)  # a pass of 100 ms: a cycle of 200
    queue.add(step(head, "a", 1.3))  # "c" is still down the chain
    assert queue.next(1.3) == wait(1.3 + GATHER)
    assert queue.next(1.3 + GATHER) == wait(1.3 + 0.2)  # past the window: it is coming
    queue.add(step(head, "c", 1.35))
    assert sids(queue.next(1.35)) == ["a", "c"]


def test_a_head_stops_waiting_for_a_member_gone_quiet():
    queue, head = PassQueue(gather_s=GATHER, depth=2), stage("a", "b", "c", "d", head=True)
    for sid in "abcd":
        queue.add(step(head, sid, 1.0))
    for run in (queue.next(1.0), queue.next(1.0)):
        queue.ran(run, 1.0, 1.1, 0.1)
    queue.add(step(head, "a", 5.0))  # "c" left 3.9 s ago: not within two cycles
    assert sids(queue.next(5.0 + GATHER)) == ["a"]


def test_one_micro_batch_waits_for_the_chains_return():
    """A head whose stages take turns on shared cores (depth 1) keeps one slot and waits up
    to the chain's measured return time for a member still down the chain."""
    queue, head = PassQueue(gather_s=GATHER), stage("a", "b", head=True)
    queue.add(step(head, "a", 1.0))
    queue.add(step(head, "b", 1.0))
    queue.ran(queue.next(1.0), 1.0, 1.01, 0.01)
    queue.add(step(head, "a", 1.05))  # back after 40 ms: the chain's return
    assert queue.return_s == pytest.approx(0.04)
    assert queue.next(1.05 + GATHER) == wait(1.05 + 0.04)
    assert sids(queue.next(1.05 + 0.04)) == ["a"]  # "b" did not come in time


@pytest.mark.parametrize(
    ("kind", "rows", "decode_s", "row_s", "turn"),
    [
        (DECODE, 1, None, None, False),  # the first pass of a shard: length unknown
        (DECODE, 1, 0.01, None, True),
        (DECODE, 1, 0.5, None, False),  # a slow shard: no one waits that long for it
        (ROWS, 64, 0.01, None, False),
        (ROWS, 64, 0.01, 0.001, True),  # 64 ms
        (ROWS, 512, 0.01, 0.001, False),  # 512 ms
        (WORK, 1, 0.01, 0.001, False),  # an audit's length is anyone's guess
    ],
)
def test_only_passes_known_to_be_short_take_a_host_turn(kind, rows, decode_s, row_s, turn):
    queue = PassQueue(turn_max_s=0.25)
    queue.times.decode_s, queue.times.row_s = decode_s, row_s
    entry = Pass(kind, 1.0, stage=stage("a"), item=DecodeItem("a", 3), rows=rows)
    entry.call = None if kind == DECODE else (lambda: None)
    queue.add(entry)
    assert queue.next(1.0).turn is turn


def test_another_shard_forgets_the_pass_times():
    queue = PassQueue()
    queue.times.decode_s, queue.times.row_s = 0.01, 0.001
    queue.forget_times()
    assert queue.times.expected_s(DECODE, 1) is None and queue.times.expected_s(ROWS, 9) is None


def test_a_step_of_a_session_closed_meanwhile_still_runs_and_fails_there():
    """A failover closes a session whose step waits: the step leaves the queue in a pass
    of its own (where the stage refuses it), never blocking the steps behind it."""
    queue, head = PassQueue(gather_s=GATHER, depth=2), stage("a", "b", head=True)
    queue.add(step(head, "a", 1.0))
    queue.add(step(head, "b", 1.0))
    head.sessions.open.discard("a")
    assert sids(queue.next(1.0 + GATHER)) == ["a"]
    assert sids(queue.next(1.0 + GATHER)) == ["b"]


def test_a_step_never_overtakes_a_pass_queued_before_it():
    """Guess steps: a session's pass verifying drafts, then its next step. A pass of
    another session's steps must not take that next step along ahead of the drafts."""
    queue, middle = PassQueue(gather_s=GATHER), stage("a", "b")
    queue.add(step(middle, "b", 1.0))
    queue.add(Pass(ROWS, 1.0, call=lambda: None, rows=3))  # "a" at 67, with drafts
    queue.add(step(middle, "a", 1.0))  # "a" at 70
    first = queue.next(1.0)  # no wait for "a": it is behind a pass that runs first
    assert sids(first) == ["b"]
    assert queue.next(1.0).passes[0].kind == ROWS
    assert sids(queue.next(1.0 + GATHER)) == ["a"]


def test_a_sessions_later_step_waits_for_its_earlier_one():
    queue, middle = PassQueue(gather_s=GATHER), stage("a", "b", "c")
    queue.add(step(middle, "a", 1.0))
    queue.add(step(middle, "b", 1.0))
    queue.add(step(middle, "b", 1.0))  # b's next (a guess step)
    queue.add(step(middle, "c", 1.0))
    assert sids(queue.next(1.0)) == ["a", "b", "c"]
    assert sids(queue.next(1.0 + GATHER)) == ["b"]


def test_a_pass_its_caller_stopped_waiting_for_never_runs():
    """The head drops its guess steps when a guess was wrong: one still queued must not
    run (its session would advance past where the head's next step starts)."""
    loop = asyncio.new_event_loop()
    try:
        queue, middle = PassQueue(gather_s=GATHER), stage("a", "b")
        dropped, kept = step(middle, "a", 1.0), step(middle, "b", 1.0)
        dropped.future, kept.future = loop.create_future(), loop.create_future()
        queue.add(dropped)
        queue.add(kept)
        dropped.future.cancel()
        assert sids(queue.next(1.0 + GATHER)) == ["b"] and queue.next(2.0) is None
    finally:
        loop.close()

"""Waiting for missing layers that are expected back (docs/adr/0023), on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from meshnet_common.coverage_wait import COVERAGE_PENDING, POLL_S, wait_for_coverage
from meshnet_common.errors import ModelNotCovered


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def asker(outcomes):
    """An ``ask`` that raises or returns the scripted outcomes in turn."""
    script = list(outcomes)
    calls = []

    async def ask():
        calls.append(None)
        outcome = script.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return ask, calls


def pending() -> ModelNotCovered:
    return ModelNotCovered("missing layers: [10, 20); coverage is expected back",
                           code=COVERAGE_PENDING)  # fmt: skip


def run(ask, clock, **kwargs):
    return asyncio.run(wait_for_coverage(ask, clock=clock, sleep=clock.sleep, **kwargs))


def test_a_gap_that_heals_costs_only_the_wait():
    clock = Clock()
    ask, calls = asker([pending(), pending(), pending(), ("http://b",)])
    assert run(ask, clock, wait_s=30) == ("http://b",)
    assert len(calls) == 4 and clock.slept == [POLL_S] * 3


def test_a_gap_with_no_prospect_fails_at_once():
    clock = Clock()
    gone = ModelNotCovered("missing layers: [10, 20)", code="model_not_covered")
    ask, calls = asker([gone])
    with pytest.raises(ModelNotCovered, match=r"\[10, 20\)") as failed:
        run(ask, clock, wait_s=30)
    assert failed.value is gone and clock.slept == [] and len(calls) == 1


def test_the_wait_ends_after_coverage_wait_naming_the_gap():
    clock = Clock()
    ask, calls = asker([pending()] * 100)
    with pytest.raises(ModelNotCovered, match=r"\[10, 20\).*waited 3\.0 s") as failed:
        run(ask, clock, wait_s=3.0)
    assert failed.value.code == "model_not_covered"  # for the client: a plain 503
    assert sum(clock.slept) == pytest.approx(3.0) and len(calls) == 7


def test_the_wait_never_passes_the_request_deadline():
    clock = Clock()
    ask, _ = asker([pending()] * 100)
    with pytest.raises(ModelNotCovered):
        run(ask, clock, wait_s=30, deadline=clock.now + 1.2)
    assert clock.now <= 100.0 + 1.2


def test_no_wait_with_coverage_wait_zero():
    clock = Clock()
    ask, _ = asker([pending()])
    with pytest.raises(ModelNotCovered, match="expected back"):
        run(ask, clock, wait_s=0)
    assert clock.slept == []


def test_between_runs_before_each_new_attempt():
    clock = Clock()
    seen = []

    async def between():
        seen.append(clock.now)

    ask, _ = asker([pending(), pending(), "route"])
    assert run(ask, clock, wait_s=30, between=between) == "route"
    assert seen == [100.0 + POLL_S, 100.0 + 2 * POLL_S]


def test_other_errors_pass_through():
    clock = Clock()
    ask, _ = asker([ValueError("boom")])
    with pytest.raises(ValueError, match="boom"):
        run(ask, clock, wait_s=30)

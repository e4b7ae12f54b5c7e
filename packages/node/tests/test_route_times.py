"""What a head reports of the routes it used (docs/adr/0032): the median wall time of each
route's last plain decode steps, recent routes only, bounded as the heartbeat is."""

from __future__ import annotations

import pytest

from meshnet_common.protocol import MAX_ROUTE_TIME_HOPS, MAX_ROUTE_TIMES, Heartbeat, NodeState
from meshnet_node.head.timings import ROUTE_MIN_STEPS, ROUTE_STEPS, ROUTE_WINDOW_S, RouteTimes

A, B = "http://a.test:8000", "http://b.test:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_route_reports_the_median_of_its_last_steps_once_it_has_enough():
    times = RouteTimes(Clock())
    for _ in range(ROUTE_MIN_STEPS - 1):
        times.add((A, B), 0.010)
    assert times.report() == ()  # too few steps to say anything
    times.add((A, B), 0.500)  # one slow step moves the median not at all
    (only,) = times.report()
    assert only.hops == (A, B) and only.step_ms == pytest.approx(10.0)
    for _ in range(ROUTE_STEPS):  # the older steps fall out
        times.add((A, B), 0.020)
    assert times.report()[0].step_ms == pytest.approx(20.0)


def test_routes_not_used_lately_are_not_reported_and_the_most_are_kept():
    clock = Clock()
    times = RouteTimes(clock)
    for i in range(MAX_ROUTE_TIMES + 3):
        for _ in range(ROUTE_MIN_STEPS):
            times.add((f"http://n{i}.test:8000",), 0.005)
    reported = [r.hops[0] for r in times.report()]
    assert len(reported) == MAX_ROUTE_TIMES and "http://n0.test:8000" not in reported
    clock.now += ROUTE_WINDOW_S + 1
    assert times.report() == ()


def test_what_the_protocol_refuses_is_left_out_not_raised():
    times = RouteTimes(Clock())
    too_long = tuple(f"http://n{i}.test:8000" for i in range(MAX_ROUTE_TIME_HOPS + 1))
    for route in ((), too_long, ("http://testserver/x",), (A,)):
        for _ in range(ROUTE_MIN_STEPS):
            times.add(route, 120.0)  # two minutes: clamped to the protocol's minute
    (only,) = times.report()
    assert only.hops == (A,) and only.step_ms == 60_000.0
    beat = Heartbeat(node_id="h", state=NodeState.SERVING, active_sessions=0, kv_tokens=0,
                     memory_free_bytes=0, route_times=times.report())  # fmt: skip
    assert beat.route_times == (only,)

"""How a node times its links (``HopLinks.probe_links``, docs/adr/0021): the least of the
last probes, and a probe during which the prober computed on its loop not counted.

The links module reads a fake clock here, which only the fake hops move (by each probe's
chosen round trip): the times asserted are the ones chosen, whatever the machine's speed."""

from __future__ import annotations

import asyncio

import pytest

from meshnet_common import wire
from meshnet_common.metrics import Metrics
from meshnet_node.dataplane import links as links_module
from meshnet_node.dataplane.links import LINK_SAMPLES, HopLinks
from meshnet_node.dataplane.streams import HopResponse, HopUnreachable
from meshnet_node.settings import HopTimeouts

HOP = "http://127.0.0.1:9"


class FakeClock:
    """``time`` as the links module uses it; it moves only when ``advance`` is called."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def advance(self, ms: float) -> None:
        self.now_s += ms / 1000

    def perf_counter(self) -> float:
        return self.now_s

    monotonic = perf_counter


class TimedHops:
    """Answers each probe after the next of ``delays_ms`` on ``clock``; None: unreachable."""

    def __init__(self, clock: FakeClock, delays_ms: list[float | None]):
        self.clock, self.delays, self.calls = clock, list(delays_ms), 0

    async def request(self, method, url, *, headers, body, timeout):
        assert method == "DELETE" and url.startswith(HOP) and "/v1/sessions/" in url
        delay, self.calls = self.delays[self.calls], self.calls + 1
        if delay is None:
            raise HopUnreachable("connection refused")
        await asyncio.sleep(0)  # an answer comes later, never within the call
        self.clock.advance(delay)
        return HopResponse(404, b"{}")


@pytest.fixture
def probing_node(monkeypatch):
    """A ``HopLinks`` whose probes take ``delays_ms`` by the clock it reads."""
    clock = FakeClock()
    monkeypatch.setattr(links_module, "time", clock)

    def make(delays_ms) -> HopLinks:
        hops = TimedHops(clock, delays_ms)
        links = HopLinks(
            hops, metrics=Metrics(), wire_options=wire.WireOptions(),
            timeouts=HopTimeouts(connect=1.0, prefill_chunk=1.0, decode_step=1.0),
            direct_min_rtt_ms=5.0,
        )  # fmt: skip
        links.set_probe_urls((HOP,))
        return links

    return make


def probe(node: HopLinks, times: int) -> list[float | None]:
    seen = []
    for _ in range(times):
        asyncio.run(node.probe_links())
        seen.append(node.rtt_ms.get(HOP))
    return seen


def test_a_link_is_the_least_of_its_last_probes(probing_node):
    # A fast link probed while the far end was busy (30 ms) reads fast; a link that became
    # slow reads slow once every remembered probe is slow.
    node = probing_node([2, 30, 30, 2, 30, 30, 30, 30, 30, 30])
    seen = probe(node, 10)
    assert seen[: 3 + LINK_SAMPLES] == [pytest.approx(2)] * (3 + LINK_SAMPLES)
    assert seen[-1] == pytest.approx(30)


def test_an_unreachable_or_unnamed_hop_is_forgotten(probing_node):
    node = probing_node([2, None, 2])
    first, second = probe(node, 2)
    assert first is not None and second is None
    assert HOP not in node.rtt_ms and HOP not in node.rtt_samples
    probe(node, 1)
    assert HOP in node.rtt_ms
    node.set_probe_urls(())
    probe(node, 1)
    assert node.rtt_ms == {} and node.rtt_samples == {}


def test_a_link_never_probed_is_timed_once_for_steps_in_flight(probing_node):
    # Guess steps ask before the first probe (a route that just formed): one round trip is
    # timed then and kept, apart from the probes' figures that direct answers follow.
    node = probing_node([9, 2, 30])  # the first request also opened the connection
    assert asyncio.run(node.slow(HOP)) is False
    assert asyncio.run(node.slow(HOP)) is False  # kept: no more requests
    assert node.first_ms == {HOP: pytest.approx(2)} and node.direct_pays(HOP)
    probe(node, 1)  # then the probes decide
    assert asyncio.run(node.slow(HOP)) is True and node.direct_pays(HOP)


def test_an_unreachable_link_counts_as_slow_and_is_not_asked_again(probing_node):
    node = probing_node([None, None])
    assert asyncio.run(node.slow(HOP)) is True
    assert asyncio.run(node.slow(HOP)) is True  # not asked again (the fake has no answer left)

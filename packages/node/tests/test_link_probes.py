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
from meshnet_node.dataplane.link_speeds import (
    PROBE_BYTES,
    RAW,
    LinkSpeeds,
    break_even_bytes_per_s,
)
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
            hops, metrics=Metrics(), speeds=LinkSpeeds(wire.WireOptions(), auto=False),
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


# -- link speeds: raw frames where zstd does not pay (docs/adr/0057) ------------------------


class SizedHops:
    """Answers each probe after ``rtt_ms`` plus its body at ``mb_per_s`` on ``clock``."""

    def __init__(self, clock: FakeClock, rtt_ms: float, mb_per_s: float):
        self.clock, self.rtt_ms, self.mb_per_s, self.bodies = clock, rtt_ms, mb_per_s, []

    async def request(self, method, url, *, headers, body, timeout):
        self.bodies.append(len(body or b""))
        await asyncio.sleep(0)
        self.clock.advance(self.rtt_ms + len(body or b"") / (self.mb_per_s * 1e3))
        return HopResponse(404, b"{}")


def speeds_after_probes(monkeypatch, mb_per_s: float, *, auto: bool = True, rtt_ms=0.5):
    clock = FakeClock()
    monkeypatch.setattr(links_module, "time", clock)
    speeds = LinkSpeeds(wire.WireOptions(), auto=auto)
    speeds.break_even = 100e6  # bytes/s: this CPU's own figure is measured at the first probe
    hops = SizedHops(clock, rtt_ms, mb_per_s)
    links = HopLinks(
        hops, metrics=Metrics(), timeouts=HopTimeouts(connect=1.0, prefill_chunk=1.0,
        decode_step=1.0), direct_min_rtt_ms=5.0, speeds=speeds,
    )  # fmt: skip
    links.set_probe_urls((HOP,))
    for _ in range(3):
        asyncio.run(links.probe_links())
    return speeds, hops


@pytest.mark.parametrize(
    ("mb_per_s", "rtt_ms", "raw"),
    [(12.5, 0.5, False), (12.5, 25.0, False), (150.0, 0.5, False), (2000.0, 0.1, True),
     (2000.0, 25.0, True)],
    ids=["100 Mbit/s", "100 Mbit/s far", "1.2 Gbit/s", "loopback", "fast far"],
)  # fmt: skip
def test_frames_go_raw_only_on_links_measured_fast(monkeypatch, mb_per_s, rtt_ms, raw):
    """A probe's large message times the link: raw frames only where it moves more than
    twice the break-even speed (100 MB/s here), whatever the round trip; zstd below."""
    speeds, hops = speeds_after_probes(monkeypatch, mb_per_s, rtt_ms=rtt_ms)
    assert hops.bodies == [0, PROBE_BYTES] * 3
    assert speeds.bytes_per_s[HOP] == pytest.approx(mb_per_s * 1e6, rel=1e-6)
    assert speeds.options(HOP) == (RAW if raw else wire.WireOptions())
    assert speeds.options("http://127.0.0.1:10") == wire.WireOptions()  # not measured: zstd


def test_a_level_set_by_the_operator_holds_on_every_link(monkeypatch):
    speeds, hops = speeds_after_probes(monkeypatch, 2000.0, auto=False)
    assert hops.bodies == [0] * 3  # no large probes either
    assert speeds.options(HOP) == wire.WireOptions()


def test_one_probe_does_not_decide(monkeypatch):
    """The first probe's small message also opened the connection: no raw frames yet."""
    speeds = LinkSpeeds(wire.WireOptions(), auto=True)
    speeds.break_even = 100e6
    speeds.note(HOP, 0.005, 0.0006)  # the first: a slow connect, then a fast large one
    assert speeds.options(HOP) == wire.WireOptions()
    speeds.note(HOP, 0.0005, 0.0006)
    assert speeds.options(HOP) == RAW  # 256 KiB in 0.1 ms beyond the least small probe


def test_a_link_that_turns_slow_gets_zstd_once_its_last_probes_all_read_slow():
    """A probe that read slow may have waited for a stage's pass at either end: the link
    stays raw until all of its last four probes read slow, and goes raw again at the
    first fast one."""
    speeds = LinkSpeeds(wire.WireOptions(), auto=True)
    speeds.break_even = 100e6
    for _ in range(3):
        speeds.note(HOP, 0.0005, 0.0006)  # fast
    assert speeds.options(HOP) == RAW
    for _ in range(3):
        speeds.note(HOP, 0.0005, 0.0215)  # 256 KiB in 21 ms: 100 Mbit/s (or a busy end)
        assert speeds.options(HOP) == RAW
    speeds.note(HOP, 0.0005, 0.0215)  # the fourth in a row: the link is slow
    assert speeds.options(HOP) == wire.WireOptions()
    speeds.note(HOP, 0.0005, 0.0006)  # a fast one: no wait makes a slow link read fast
    assert speeds.options(HOP) == RAW


def test_a_probe_slowed_by_a_busy_end_keeps_a_fast_link_raw():
    """A loopback link whose probes sometimes meet a stage's pass (read 50-100 MB/s, as
    measured on a two-core host) keeps its raw frames."""
    speeds = LinkSpeeds(wire.WireOptions(), auto=True)
    speeds.break_even = 75e6
    for probes, large in enumerate((0.0006, 0.0008, 0.004, 0.003, 0.0009, 0.0045, 0.005), 1):
        speeds.note(HOP, 0.0005, large)  # 2.6 GB/s, 870 MB/s, 74, 104, 650, 66, 58 MB/s
        assert speeds.options(HOP) == (RAW if probes >= 2 else wire.WireOptions())


def test_a_link_busy_with_frames_never_reads_fast():
    """Probes queued behind a prompt's chunks on a 100 Mbit/s link: the small one waited
    nearly as long as the large one, yet the large one's time beyond the link's round trip
    still reads slow."""
    speeds = LinkSpeeds(wire.WireOptions(), auto=True)
    speeds.break_even = 100e6
    for small, large in ((0.0005, 0.0215), (0.0005, 0.0215), (0.030, 0.031), (0.025, 0.0255)):
        speeds.note(HOP, small, large)
        assert speeds.options(HOP) == wire.WireOptions()


def test_a_forgotten_link_is_packed_as_configured_again(monkeypatch):
    speeds, _ = speeds_after_probes(monkeypatch, 2000.0)
    assert speeds.options(HOP) == RAW
    speeds.forget(HOP)
    assert speeds.options(HOP) == wire.WireOptions()


def test_the_break_even_speed_is_measured_on_this_cpu():
    """What zstd saves over what it costs: some MB/s to some GB/s on any CPU."""
    assert 1e6 < break_even_bytes_per_s(1) < 1e11

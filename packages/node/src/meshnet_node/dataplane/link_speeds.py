"""Whether a link's frames are compressed: zstd where it pays, measured (docs/adr/0057).

A frame's zstd (on its high byte planes, ``wire``) saves about a third of its bytes and
costs its encode and decode: on an AVX-512 Xeon, ~4.3 ms more for a 128-token chunk of
4096 bf16 values (1 MB) than a raw frame, ~20 us more for one decode row. That pays on a
link slower than the bytes saved over the time added (~80-130 MB/s there), and costs the
step that much on a faster one — a loopback link between nodes on one host moves GB/s.

So each link's speed is measured, not assumed from its address (a relay on 127.0.0.1 may
stand for a slow link): the link probes (``HopLinks.probe_links``) time a ``PROBE_BYTES``
message after their small one; its time beyond the link's round trip is the transfer. The break-even speed
is measured on this CPU once, from a frame of that size. A link measured faster than twice
the break-even (by the best of its last probes: a wait only slows one) gets raw frames (no
zstd, no byte shuffling: the planes only help zstd); any other, and one not measured yet,
the configured level.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections import deque

import torch

from meshnet_common import wire

PROBE_BYTES = 256 * 1024  # a link probe's large message: 2 ms of a link at 1 Gbit/s
SAMPLES = 4  # a link's speed: the best of its last this many probes
MARGIN = 2.0  # raw frames only on links this many times faster than the break-even
RAW = wire.WireOptions(zstd_level=0, shuffle=False)

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def break_even_bytes_per_s(level: int, hidden: int = 4096, rows: int = 128) -> float:
    """The link speed (bytes/s) below which zstd at ``level`` pays on this CPU: the bytes it
    saves on a frame of ``rows`` x ``hidden`` bf16 values, over the time its encode and
    decode take beyond a raw frame's (the best of five of each)."""
    sample = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0))
    sample = sample.to(torch.bfloat16)
    packed = wire.WireOptions(zstd_level=level)

    def cost(options: wire.WireOptions) -> tuple[float, int]:
        best, size = float("inf"), 0
        for _ in range(5):
            started = time.perf_counter()
            frame = wire.encode_tensor(sample, options)
            wire.decode_tensor(frame)
            best, size = min(best, time.perf_counter() - started), len(frame)
        return best, size

    raw_s, raw_bytes = cost(RAW)
    packed_s, packed_bytes = cost(packed)
    saved = max(raw_bytes - packed_bytes, 0)
    return saved / max(packed_s - raw_s, 1e-6)


class LinkSpeeds:
    """Each next hop's measured speed, and the frame options that follow from it.

    ``configured``: the options of a link not measured fast (``--zstd-level``); ``auto``:
    whether a fast link gets raw frames (False where the operator set a level)."""

    def __init__(self, configured: wire.WireOptions, *, auto: bool) -> None:
        self.configured, self.auto = configured, auto
        self.bytes_per_s: dict[str, float] = {}
        self._samples: dict[str, deque[tuple[int, float]]] = {}  # the last large probes'
        self._rtts: dict[str, deque[float]] = {}  # s, the last small probes'
        self._told: set[str] = set()  # links whose packing was logged at info once
        self._raw: dict[str, bool] = {}
        self.break_even: float | None = None  # bytes/s, measured at the first probe

    def measure_break_even(self) -> float:
        """This CPU's break-even speed at the configured level (measured once a process)."""
        if self.break_even is None:
            self.break_even = break_even_bytes_per_s(self.configured.zstd_level or 1)
        return self.break_even

    def note(self, hop: str, small_s: float, large_s: float, large_bytes: int = PROBE_BYTES) -> None:  # fmt: skip
        """A probe of ``hop``: a small message answered in ``small_s``, one of
        ``large_bytes`` more in ``large_s``.

        Each of the last ``SAMPLES`` large probes' time beyond the link's round trip (the
        least small probe among them: the first one also opened the connection) is its
        transfer. Waits only add to it: a busy loop at either end (a stage computing a
        step as the probe comes), or a link busy with other frames (a prompt's chunks,
        queued ahead of the probe), make the link read slower, never faster. So the best
        of them is the link's speed: raw frames where it is fast (two probes at least),
        zstd once all of the last ``SAMPLES`` read slow, and raw again at the first fast
        one."""
        rtts = self._rtts.setdefault(hop, deque(maxlen=SAMPLES))
        rtts.append(small_s)
        larges = self._samples.setdefault(hop, deque(maxlen=SAMPLES))
        larges.append((large_bytes, large_s))
        rtt = min(rtts)
        speeds = [size / max(took - rtt, 1e-5) for size, took in larges]  # at most ~26 GB/s
        self.bytes_per_s[hop] = statistics.median(speeds)
        break_even = self.break_even
        best = max(speeds)
        raw = len(speeds) >= 2 and break_even is not None and best > MARGIN * break_even
        if raw != self._raw.get(hop, False):
            log = logger.info if hop not in self._told else logger.debug  # once, then quiet
            self._told.add(hop)
            log("link to %s moves %.0f MB/s (zstd pays below %.0f): frames %s", hop,
                best / 1e6, (break_even or 0) / 1e6, "raw" if raw else "zstd-compressed")  # fmt: skip
        self._raw[hop] = raw

    def forget(self, hop: str) -> None:
        """A hop no longer probed (or unreachable): its frames as configured again."""
        self.bytes_per_s.pop(hop, None)
        self._samples.pop(hop, None)
        self._rtts.pop(hop, None)
        self._raw.pop(hop, None)

    def options(self, hop: str) -> wire.WireOptions:
        """How frames to ``hop`` are packed."""
        return RAW if self.auto and self._raw.get(hop, False) else self.configured

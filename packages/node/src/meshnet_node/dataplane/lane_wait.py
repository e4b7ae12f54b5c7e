"""When a decode lane's next message is due, so that its reader is already looking for it
when it comes (docs/adr/0058, amended 2026-12-07, end of day).

A reader asleep in ``poll`` until its message comes is woken by the writer's kernel: on
another CPU that is an interrupt between CPUs, which a virtual machine pays for in exits.
Measured in C on the 2-core AMX Xeon guest (two processes alternating 14 ms of memory-bound
work and a 1.2 KB message on a Unix socket), from the write's start to the read's return:
101-114 us with the reader asleep, 22-24 us with it looking. A step of a lone session
crosses three such wake-ups on three processes.

A lone session's steps come at a steady beat: a node's next step comes a pass of every
other hop after it wrote the last one on, give or take the passes' own jitter (on that
machine 60-80% of waits ended within 1 ms of the median of the 8 before). ``Cadence``
keeps a lane's latest waits; while they keep a beat (their middle half within the window,
``--lane-spin-ms``), the reader sleeps until half the window before the median wait ends,
then looks without sleeping (yielding the CPU between looks) for the window: it spends at
most the window each step looking, and a message that comes within it skips its ~80 us
wake-up on the step's critical path. One that comes before is read as it comes, one after
wakes the reader as before. Waits with no beat (sessions sharing the lane, a prompt in
between) leave the reader asleep until its message comes. Looking takes a CPU: only where
the node's compute threads leave one free (``spin_window_s``).
"""

from __future__ import annotations

from collections import deque

WAITS = 8  # a lane's latest waits, which must keep a beat before its reader looks ahead
ASLEEP = (0.0, 0.0)  # (sleep_s, spin_s): asleep until the message comes


def spin_window_s(spin_ms: float, threads: int | None, cpus: int) -> float:
    """The longest a lane's reader looks for a message without sleeping, each wait: 0 where
    ``--lane-spin-ms`` is 0, or where the node's compute threads (``threads``; None:
    torch's default, every CPU) leave none of the ``cpus`` it may run on free to look
    from (``host_turns.host_cpus``)."""
    if spin_ms <= 0 or threads is None or threads >= cpus:
        return 0.0
    return spin_ms / 1000.0


class Cadence:
    """A lane's latest waits for its next message (``note``) and the next wait's plan
    (``due``), looking at most ``spin_s`` each wait."""

    __slots__ = ("_waits", "spin_s")

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s
        self._waits: deque[float] = deque(maxlen=WAITS)

    def due(self) -> tuple[float, float]:
        """(sleep_s, spin_s): asleep until half the window before the median of the latest
        waits, then looking for up to the window; ASLEEP until ``WAITS`` waits are known, or
        where their middle half spreads wider than the window (no beat)."""
        waits = self._waits
        if len(waits) < WAITS:
            return ASLEEP
        ordered = sorted(waits)
        window = self.spin_s
        if ordered[WAITS * 3 // 4] - ordered[WAITS // 4] > window:
            return ASLEEP
        return max(0.0, ordered[WAITS // 2] - window / 2), window

    def note(self, waited_s: float) -> None:
        """A wait that ended with the lane's message (not one cut short by anything else)."""
        self._waits.append(waited_s)

    def forget(self) -> None:
        """The beat broke (another session's step, a prompt): waits start over."""
        self._waits.clear()

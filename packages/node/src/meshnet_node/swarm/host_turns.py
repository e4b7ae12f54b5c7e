"""Compute turns shared by the meshnet nodes of one host (issue 39, docs/adr/0036).

Each node computes with the host's cores (torch's default threads, or ``--threads``). In one
stream only one stage computes at a time, but with several sessions the stages of one host
used to compute at once: three passes of two OpenMP threads each on two cores took 50-65 ms
instead of 8-10, and four sessions together got no more tokens a second than one.

So a node's short passes (``meshnet_node.scheduling``: those known to take under
``--turn-max-ms``) take a turn first: an
exclusive ``flock`` on one of ``cpus // threads`` slot files in the folder the host's
memory claims live in. One stream never waits (its stages compute one after another); with
several, the passes of the host's nodes follow each other at full speed instead of sharing
the cores badly. The kernel drops a dead holder's lock; a holder that stops without dying
(SIGSTOP, a debugger) is waited for ``patience_s`` at most (the longest a short pass may
take), after which this node computes without turns for ``SKIP_S``. Long passes take none:
no node waits long behind another's prompt.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from meshnet_node.swarm.host_memory import default_claims_dir

logger = logging.getLogger(__name__)

SKIP_S = 10.0  # no turns for this long after a holder outlived the patience
FIRST_PAUSE_S = 1e-4  # a waiter looks again after this, doubling up to MAX_PAUSE_S
MAX_PAUSE_S = 1e-3
_TAKE = fcntl.LOCK_EX | fcntl.LOCK_NB


def host_cpus() -> int:
    """CPUs this process may run on (a container's or taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class HostTurns:
    """This process's side of the host's compute turns: ``slots`` lock files, at most one
    held at a time."""

    def __init__(
        self, slots: int, *, patience_s: float, folder: Path | None = None,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
    ) -> None:  # fmt: skip
        self.folder = folder or default_claims_dir()
        self.patience_s = patience_s
        self._clock, self._sleep = clock, sleep
        self._fds: list[int] = []
        self.held: int | None = None  # the slot this process holds, if any
        self.skip_until = 0.0
        self.waits = 0  # turns taken after waiting for one
        self.gave_up = 0  # times a holder outlived the patience
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for i in range(max(1, slots)):
                path = self.folder / f"turn-{i}.lock"
                self._fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        except OSError as exc:  # a read-only tmp: nodes then compute without turns
            logger.info("no compute turns (%s): nodes on this host may compute at once", exc)
            self.close()

    @classmethod
    def for_threads(cls, threads: int, *, patience_s: float) -> HostTurns:
        """Turns for a node computing with ``threads``: as many slots as such passes fit."""
        return cls(max(1, host_cpus() // max(1, threads)), patience_s=patience_s)

    @property
    def slots(self) -> int:
        return len(self._fds)

    def _try(self) -> bool:
        slot = 0
        for fd in self._fds:  # each call on a core a pass left cold costs ~5-15 us: few
            try:
                fcntl.flock(fd, _TAKE)
            except BlockingIOError:
                slot += 1
                continue
            self.held = slot
            return True
        return False

    def take(self) -> bool:
        """Wait for a turn, at most ``patience_s``; True when this process holds one (then
        ``give`` it back), False when it computes without."""
        if not self._fds or self.held is not None:
            return False
        if self.skip_until and self._clock() < self.skip_until:
            return False
        if self._try():
            return True
        started, pause = self._clock(), FIRST_PAUSE_S
        while self._clock() - started < self.patience_s:
            self._sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)
            if self._try():
                self.waits += 1
                return True
        self.gave_up += 1
        self.skip_until = self._clock() + SKIP_S
        logger.warning(
            "another node on this host held its compute turn over %.0f ms (stopped?): "
            "computing without turns for %.0f s", self.patience_s * 1000, SKIP_S,
        )  # fmt: skip
        return False

    def give(self) -> None:
        """Give back the turn held (nothing when none is)."""
        if self.held is not None:
            fcntl.flock(self._fds[self.held], fcntl.LOCK_UN)
            self.held = None

    def close(self) -> None:
        self.give()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

    def describe(self) -> str:
        """For the node's start-up log line."""
        if not self._fds:
            return "no compute turns"
        return f"short passes take one of {self.slots} compute turn(s) shared on this host"


def node_turns(settings, threads: int, device: str) -> HostTurns | None:
    """The host's compute turns for a node (``NodeSettings``) computing on the CPU with
    ``threads``; None on another device."""
    if device != "cpu":
        return None
    return HostTurns.for_threads(threads, patience_s=settings.turn_max_ms / 1000)

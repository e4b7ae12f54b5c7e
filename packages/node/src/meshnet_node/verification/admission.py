"""``PeerAdmission``: how much of some work each caller may ask for (issue 52), so that one
member cannot keep a node busy with it. A caller may have ``max_running`` pieces running or
waiting at once (all callers together ``max_total``), and spend ``per_window`` tokens per
``window_s``, refilled evenly (a token bucket per caller); beyond either: 429
(``RateLimited``), which a caller that only asks now and then never meets.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from meshnet_common.errors import RateLimited


@dataclass
class _Share:
    """One caller's pieces in flight and tokens left (as of ``at``)."""

    running: int
    tokens: float
    at: float


class PeerAdmission:
    """Pieces in flight and tokens per window, per caller (``caller_of``). Thread-safe."""

    def __init__(
        self, *, max_running: int, max_total: int, window_s: float,
        clock: Callable[[], float] = time.monotonic, what: str = "work",
    ) -> None:  # fmt: skip
        self.max_running = max_running
        self.max_total = max_total
        self.window_s = window_s
        self.clock = clock
        self.what = what
        self._shares: dict[str, _Share] = {}
        self._running = 0
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        """Pieces admitted and not yet done, all callers together."""
        return self._running

    def admit(self, caller: str, tokens: int, per_window: int) -> Callable[[], None]:
        """Admit one piece of ``tokens`` for ``caller``, who may spend ``per_window`` tokens
        per window (a piece larger than that needs a full bucket); returns what to call once
        the piece is done (running or not, only its end frees its place). RateLimited now
        when it may not run."""
        self._take(caller, tokens, per_window)
        done = threading.Event()

        def release() -> None:
            with self._lock:
                if done.is_set():
                    return
                done.set()
                self._running -= 1
                self._shares[caller].running -= 1

        return release

    def _take(self, caller: str, tokens: int, per_window: int) -> None:
        now = self.clock()
        with self._lock:
            self._forget_idle(now)
            share = self._shares.get(caller)
            if share is None:
                share = self._shares[caller] = _Share(0, float(per_window), now)
            rate = per_window / self.window_s
            share.tokens = min(float(per_window), share.tokens + (now - share.at) * rate)
            share.at = now
            if share.running >= self.max_running or self._running >= self.max_total:
                busy = "this caller's" if share.running >= self.max_running else "all callers'"
                raise RateLimited(
                    f"too many {self.what} at once ({busy}); try again shortly", retry_s=1.0
                )
            need = min(tokens, per_window)
            if share.tokens < need:
                retry = (need - share.tokens) / rate
                raise RateLimited(
                    f"{self.what}: more than {per_window} tokens per {self.window_s:g} s asked "
                    "by this caller", retry_s=retry,
                )  # fmt: skip
            share.tokens -= need
            share.running += 1
            self._running += 1

    def _forget_idle(self, now: float) -> None:
        """Drop callers with nothing running whose bucket is full again: the table holds
        only callers of the last window."""
        for caller, share in list(self._shares.items()):
            if share.running == 0 and now - share.at >= self.window_s:
                del self._shares[caller]

    def callers(self) -> int:
        """Callers remembered (running work, or spent tokens within the window)."""
        with self._lock:
            return len(self._shares)

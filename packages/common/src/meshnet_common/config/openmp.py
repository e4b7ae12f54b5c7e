"""How long torch's OpenMP helper threads spin before they sleep, set by a meshnet process
before torch loads (issue 39, docs/adr/0036).

Between two parallel regions libgomp's helper threads spin, 300,000 rounds by default (a
few ms), before they sleep. A node computes one stage of a stream and then waits for the
others: its helpers then spin on the cores the next stage (or its own event loop, or the
tracker) needs. Measured on a 2-core AMD EPYC (Zen 4), SmolLM2, greedy decode: three local
processes 20 tok/s with the default wait, ~30 with 10,000 rounds; one process holding all
30 layers 35 tok/s against 45. Fewer rounds (1,000) wake the helpers through the kernel
inside a step: 30 layers took 36 ms a step instead of 22.

An operator's own ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is kept. Other OpenMP runtimes
(LLVM's, on macOS) read neither and were not measured: left alone.
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping

SPIN_ROUNDS = 10_000
CHOSEN_BY_OPERATOR = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def short_spin(environ: MutableMapping[str, str]) -> str:
    """Set ``GOMP_SPINCOUNT`` in ``environ`` (the process's, before torch loads) unless the
    operator chose OpenMP's wait; returns what the process waits with, for its log."""
    chosen = [f"{name}={environ[name]}" for name in CHOSEN_BY_OPERATOR if name in environ]
    if chosen:
        return f"OpenMP waits as set ({', '.join(chosen)})"
    if "torch" in sys.modules:  # libgomp read its environment already
        return "OpenMP waits with torch's default (torch was loaded first)"
    environ["GOMP_SPINCOUNT"] = str(SPIN_ROUNDS)
    return f"OpenMP helpers spin {SPIN_ROUNDS} rounds before they sleep (GOMP_SPINCOUNT)"

"""How long torch's OpenMP helper threads spin before they sleep, set by a meshnet process
before torch loads (issue 39, docs/adr/0036).

Between two parallel regions libgomp's helper threads spin, 300,000 rounds by default (a
few ms), before they sleep. A node computes one stage of a stream and then waits for the
others: its helpers then spin on the cores the next stage (or its own event loop, or the
tracker) needs. Measured on a 2-core AMD EPYC (Zen 4), SmolLM2, greedy decode: three local
processes 20 tok/s with the default wait, ~30 with 10,000 rounds; one process holding all
30 layers 35 tok/s against 45. Fewer rounds (1,000) wake the helpers through the kernel
inside a step: 30 layers took 36 ms a step instead of 22.

30,000 rounds since issue 50 (measured on a 2-core Intel Xeon with AMX, SmolLM2, two
threads a process, the same commit back to back): 10,000 still let the helpers fall asleep
inside a step wherever the cores had idled, most over slow links (a 10-layer stage's pass
took 93 ms over 25 ms links against 41 ms without them; 54 ms with 30,000); three local
processes 21.1 -> 25.0 tok/s (0.76 -> 0.87 of one HF process), one process 76 -> 82 tok/s,
25 ms links 1.35 -> 1.46 of the one-traversal bound with guess steps. Sixteen concurrent
sessions kept their aggregate (129.8 tok/s at 10,000; 122.5 and 127.8 at 30,000) with a
longer p99 token gap (~0.65 s -> ~1.2 s). A round is a ``pause``, shorter on AMD's cores
than Intel's: 30,000 rounds there spin less time than here, further from the 300,000 that
measured badly on the Zen 4.

An operator's own ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is kept. Other OpenMP runtimes
(LLVM's, on macOS) read neither and were not measured: left alone.
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping

SPIN_ROUNDS = 30_000
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

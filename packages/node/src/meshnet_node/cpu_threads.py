"""How a node's compute threads share its host's cores with other nodes there (issue 39).

Several nodes on one machine take turns in a single stream: one stage computes while the
others wait for the network. Each may then use every core (torch's default), provided its
OpenMP threads stop spinning soon after its pass: GNU OpenMP's threads wait actively for
300,000 spins after every parallel region, long enough to take the cores from the next
stage starting on the same host. ``quiet_idle_threads`` shortens that wait (``SPIN_COUNT``
spins: enough to bridge the gaps between the ops of one pass, a few tens of microseconds),
and Intel OpenMP's likewise (``KMP_BLOCKTIME``), before torch loads OpenMP. A value the
operator set is kept. ``--threads`` still sets how many threads a node computes with.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPIN_COUNT = "20000"  # GOMP_SPINCOUNT: ~20-60 us of spinning after a region, then sleep
BLOCK_TIME_MS = "1"  # KMP_BLOCKTIME, for a torch built with Intel OpenMP


def quiet_idle_threads(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the OpenMP wait defaults (unless set already, or torch has loaded OpenMP: then
    they would not apply); returns what it set."""
    if "torch" in sys.modules:
        return {}
    chosen = {}
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        chosen["GOMP_SPINCOUNT"] = SPIN_COUNT
    if "KMP_BLOCKTIME" not in environ:
        chosen["KMP_BLOCKTIME"] = BLOCK_TIME_MS
    environ.update(chosen)
    return chosen


def describe(threads: int, others: int, environ: MutableMapping[str, str] = os.environ) -> str:
    """The log line of what the node computes with."""
    spin = environ.get("GOMP_SPINCOUNT") or environ.get("OMP_WAIT_POLICY") or "default"
    shared = f"; {others} other meshnet node(s) on this host take turns with it" if others else ""
    return (
        f"computing with {threads} thread(s) (--threads sets it); idle OpenMP threads wait "
        f"actively for {spin} spins, then sleep{shared}"
    )

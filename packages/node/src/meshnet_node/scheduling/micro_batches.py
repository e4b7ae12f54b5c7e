"""How many micro-batches a head keeps in flight (docs/adr/0029)."""

from __future__ import annotations

import functools
import os

from meshnet_common.web.hosts import url_is_loopback


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@functools.lru_cache(maxsize=256)
def micro_batches(route: tuple[str, ...], threads: int, cpus: int | None = None) -> int:
    """How many micro-batches a head keeps in flight on a chain of its own stage and the
    hops of ``route`` (their URLs): one per stage that can compute at the same time as the
    others (docs/adr/0029).

    A stage on another machine computes in parallel with the rest: one micro-batch each.
    Stages on this machine (the head, and hops at a loopback address, which only this
    machine answers) share its ``cpus``: at most ``cpus // threads`` of them compute at
    once, and a micro-batch beyond that only repeats a pass's fixed cost (on a CPU
    without bf16 arithmetic, widening every weight again).
    """
    cpus = usable_cpus() if cpus is None else cpus
    here = 1 + sum(1 for url in route if url_is_loopback(url))
    elsewhere = len(route) + 1 - here
    return elsewhere + min(here, max(1, cpus // max(1, threads)))

"""How a node process spends its CPU threads (issue 39, docs/adr/0036).

torch computes with OpenMP, and libgomp keeps a team of threads for every thread that ran a
parallel op, until that thread ends. Once the teams of a process hold more threads than
the host has CPUs, libgomp stops spinning between parallel regions: every op of a decode
step then wakes its helpers through the kernel. A node used to compute on two threads (the
event loop's for lone decode steps, the compute thread for the rest), and its decode step
took ~50% longer than the same layers computed from one thread (measured on a 2-core AMD
EPYC, Zen 4: 30 SmolLM2 layers, 22 ms a step from one thread, 35-40 ms from two).

So a node process computes from one thread only: the node is built (its shard loaded) on a
thread of its own that ends with it (:func:`apart`), and :func:`dedicate` gives the compute thread the
node's torch threads and every other thread (the event loop's, and threads started later)
one. Nodes sharing a host take turns in a single stream; each one logs how many other
meshnet nodes claim memory on its host (``HostClaims``), and ``--threads`` sets the count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def apart(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own, which ends with it: the OpenMP team a load starts
    goes with that thread instead of staying beside the compute thread's."""
    box: dict[str, object] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller, raised there
            box["error"] = exc

    # a daemon: Ctrl-C or SIGTERM during a long load ends the process without waiting for it
    thread = threading.Thread(target=call, name="load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _own(threads: int) -> None:
    """On the compute thread: compute with ``threads``, and settle that now (torch sets a
    thread's count at its first parallel op from the process-wide one, which is about to
    become 1)."""
    torch.set_num_threads(threads)
    torch.ones(1 << 16).add_(1)  # above torch's grain size: a parallel op


def dedicate(compute, threads: int | None) -> int:
    """Make ``compute`` (a ``ComputeThread``) the one thread computing with ``threads``
    (None: torch's default) and every other thread compute with one; returns the count.

    Call once per process, after the shard loaded (:func:`apart`) and before the server
    starts. Lone decode steps no longer run on the loop's thread: it has one thread now."""
    threads = threads or torch.get_num_threads()
    compute.executor.submit(_own, threads).result()
    torch.set_num_threads(1)  # this thread, and the default of every thread to come
    compute.threads = threads
    compute.inline_decode = compute.inline_decode and threads == 1
    return threads


def describe(threads: int, others: int, spin: str = "") -> str:
    """The log line of what the node computes with (``spin``: how OpenMP waits)."""
    shared = f"; {others} other meshnet node(s) on this host take turns with it" if others else ""
    spin = f"; {spin}" if spin else ""
    return f"computing with {threads} torch thread(s) (--threads sets it){spin}{shared}"

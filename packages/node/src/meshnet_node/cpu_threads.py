"""How a node process spends its CPU threads (issue 39, docs/adr/0036).

torch computes with OpenMP, and libgomp keeps a team of threads for every thread that ran a
parallel op, until that thread ends. Once the teams of a process hold more threads than
the host has CPUs, libgomp stops spinning between parallel regions: every op of a decode
step then wakes its helpers through the kernel. A node used to compute on two threads (the
event loop's for lone decode steps, the compute thread for the rest), and its decode step
took ~50% longer than the same layers computed from one thread (measured on a 2-core AMD
EPYC, Zen 4: 30 SmolLM2 layers, 22 ms a step from one thread, 35-40 ms from two).

So a node process has one thread computing with the node's torch threads: the compute
thread of its scheduler (``meshnet_node.scheduling``, docs/adr/0039), for its whole life.
The node is built (its shard loaded) on a thread of its own that ends with it
(:func:`apart`); :func:`dedicate` then gives the compute thread the node's torch threads and
every other thread (the event loop's among them) one. Nodes sharing a host take turns: in a
single stream by its nature, with several by the host's compute turns their short passes
take (``meshnet_node.swarm.host_turns``); each one logs how many other meshnet nodes claim
memory on its host (``HostClaims``), and ``--threads`` sets the count.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def apart(fn: Callable[[], T], name: str = "load") -> T:
    """``fn()`` on a thread of its own, which ends with it: the OpenMP team a load starts
    goes with that thread instead of staying beside the compute thread's."""
    box: dict[str, object] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller, raised there
            box["error"] = exc

    # a daemon: Ctrl-C or SIGTERM during a long load ends the process without waiting for it
    thread = threading.Thread(target=call, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _own(threads: int) -> None:
    """On the calling thread: compute with ``threads``, and settle that now (torch sets a
    thread's count once, at its first parallel op or count query, from the process-wide
    default, which another thread may change next)."""
    torch.set_num_threads(threads)  # this thread's count, and the process-wide default
    torch.ones(1 << 16).add_(1)  # above torch's grain size: a parallel op


def dedicate(scheduler, threads: int | None) -> int:
    """Give ``scheduler``'s compute thread (a ``ComputeScheduler``'s) the node's torch
    threads (``threads``; None: torch's default) and every other thread one, the calling
    thread (the event loop's) included. Returns the count.

    Call once per process, after the shard loaded (:func:`apart`), on the thread that runs
    the event loop, before the server starts."""
    threads = threads or torch.get_num_threads()
    scheduler.call(functools.partial(_own, threads)).result()
    _own(1)  # this thread, and the default of every thread to come
    scheduler.threads = threads
    return threads


def describe(threads: int, others: int, spin: str = "", turns=None) -> str:
    """The log line of what the node computes with (``spin``: how OpenMP waits; ``turns``:
    the host's compute turns, ``HostTurns``, or None)."""
    shared = f"; {others} other meshnet node(s) on this host" if others else ""
    spin = f"; {spin}" if spin else ""
    taken = f"; {turns.describe()}" if turns is not None else ""
    return f"computing with {threads} torch thread(s) (--threads sets it){spin}{shared}{taken}"

"""How a node process spends its CPU threads (issue 39, docs/adr/0036).

torch computes with OpenMP, and libgomp keeps a team of threads for every thread that ran a
parallel op, until that thread ends. Once the teams of a process hold more threads than
the host has CPUs, libgomp stops spinning between parallel regions: every op of a decode
step then wakes its helpers through the kernel. A node used to compute on two threads (the
event loop's for lone decode steps, the compute thread for the rest), and its decode step
took ~50% longer than the same layers computed from one thread (measured on a 2-core AMD
EPYC, Zen 4: 30 SmolLM2 layers, 22 ms a step from one thread, 35-40 ms from two).

So a node process keeps one long-lived thread computing with the node's torch threads:
the event loop's, where short passes run without a thread hand-off (two wake-ups per hop
and step, ~0.1 ms each on a virtualized host). The node is built (its shard loaded) on a
thread of its own that ends with it (:func:`apart`); :func:`dedicate` gives the loop's
thread the node's torch threads and every other thread one; and a long pass runs from the
compute thread on a thread of its own that ends with the pass (:func:`computing`), so its
team goes too. With ``--no-inline-decode`` the compute thread keeps the torch threads
instead and the loop's thread computes nothing. Nodes sharing a host take turns: in a
single stream by its nature, with several by the host's compute turns their short passes
take (``meshnet_node.swarm.host_turns``); each one logs how many other meshnet nodes claim
memory on its host (``HostClaims``), and ``--threads`` sets the count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def apart(
    fn: Callable[[], T], name: str = "load", meanwhile: Callable[[], object] | None = None
) -> T:
    """``fn()`` on a thread of its own, which ends with it: the OpenMP team a load (or a
    long pass) starts goes with that thread instead of staying beside the computing
    thread's. ``meanwhile`` runs on the caller's thread once the new one started."""
    box: dict[str, object] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller, raised there
            box["error"] = exc

    # a daemon: Ctrl-C or SIGTERM during a long load ends the process without waiting for it
    thread = threading.Thread(target=call, name=name, daemon=True)
    thread.start()
    if meanwhile is not None:
        meanwhile()
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


def computing(fn: Callable[[], T], threads: int) -> T:
    """``fn()`` on a thread of its own computing with ``threads`` torch threads: the thread
    and its OpenMP team end with it. Call it from a thread that computes with one (the
    compute thread): the process-wide default goes back to one as soon as the new thread
    has settled its count, so threads started later still compute with one."""
    settled = threading.Event()

    def call() -> T:
        try:
            torch.set_num_threads(threads)
            torch.get_num_threads()  # settles this thread's count (torch reads it once)
        finally:
            settled.set()  # the caller never waits on a thread that failed here
        return fn()

    def back_to_one() -> None:
        settled.wait()
        torch.set_num_threads(1)  # the caller's count and the default again

    return apart(call, name="pass", meanwhile=back_to_one)


def dedicate(compute, threads: int | None) -> int:
    """Give the calling thread (the event loop's, which runs short passes inline) the
    node's torch threads (``threads``; None: torch's default) and every other thread one;
    ``compute`` (a ``ComputeThread``) runs long passes on threads of their own with as many
    (:func:`computing`). With inline passes off (``--no-inline-decode``), ``compute``'s own
    thread computes with them instead and the caller with one. Returns the count.

    Call once per process, after the shard loaded (:func:`apart`), on the thread that runs
    the event loop, before the server starts."""
    threads = threads or torch.get_num_threads()
    if compute.inline_decode:
        _own(threads)  # this thread: the loop's
        compute.executor.submit(_own, 1).result()  # the default of every thread to come: 1
        compute.own(threading.get_ident(), threads)
    else:
        compute.executor.submit(_own, threads).result()
        _own(1)  # this thread, and the default of every thread to come
        compute.threads = threads
    return threads


def describe(threads: int, others: int, spin: str = "", turns=None) -> str:
    """The log line of what the node computes with (``spin``: how OpenMP waits; ``turns``:
    the host's compute turns, ``HostTurns``, or None)."""
    shared = f"; {others} other meshnet node(s) on this host" if others else ""
    spin = f"; {spin}" if spin else ""
    taken = f"; {turns.describe()}" if turns is not None else ""
    return f"computing with {threads} torch thread(s) (--threads sets it){spin}{shared}{taken}"

"""What a node computes with on a host it may share with other nodes (issue 39).

Several nodes on one machine take turns in a single stream: one stage computes while the
others wait for the network. A node keeps torch's thread count (``--threads`` sets it) and
says at start how many other meshnet nodes claim memory on its host (``HostClaims``), so
that an operator sees the sharing. Measured on a 2-core AMD EPYC (Zen 4), SmolLM2 over 3
processes: neither shortening OpenMP's active wait (``GOMP_SPINCOUNT``) nor one thread per
node brought decode above ~0.6 of one process using both cores: the nodes' compute is
~40% slower in the swarm than the same layers in one process (docs/adr/0036).
"""

from __future__ import annotations


def describe(threads: int, others: int) -> str:
    """The log line of what the node computes with."""
    shared = f"; {others} other meshnet node(s) on this host take turns with it" if others else ""
    return f"computing with {threads} torch thread(s) (--threads sets it){shared}"

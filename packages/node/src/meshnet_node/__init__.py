"""meshnet node: loads one layer range of a model and runs it for many sessions."""

from meshnet_node.cpu_threads import quiet_idle_threads

__version__ = "0.1.0"

# Before any module of this package loads torch (and with it OpenMP): a node's idle compute
# threads must not spin against other nodes on its host (``cpu_threads``).
quiet_idle_threads()

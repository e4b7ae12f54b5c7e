"""How a node process spends its CPU threads (docs/adr/0036): the shard loads on a thread
that ends with it, the compute thread keeps the node's torch threads and every other thread
computes with one, so OpenMP never manages more helper threads than the node asked for; and
the OpenMP wait a process sets before torch loads, unless the operator chose one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshnet_common.config.openmp import SPIN_ROUNDS, short_spin

# Run apart: it sets the process's torch threads. Counts the OS threads OpenMP starts.
DEDICATE = r"""
import os, threading, time, torch
from meshnet_node.cpu_threads import apart, dedicate
from meshnet_node.dataplane.compute import ComputeThread

def tasks(settles_at=None):
    # the process's OS threads, once they settle at settles_at (ending ones take a moment)
    deadline = time.monotonic() + 10
    while settles_at is not None and time.monotonic() < deadline:
        if len(os.listdir("/proc/self/task")) == settles_at:
            break
        time.sleep(0.01)
    return len(os.listdir("/proc/self/task"))

def parallel_op():
    torch.ones(1 << 20).add_(1)  # far above torch's grain size
    return torch.get_num_threads()

torch.set_num_threads(2)
before = tasks()
assert apart(parallel_op) == 2
assert tasks(settles_at=before) == before  # the load's helpers ended with it
try:
    apart(lambda: 1 / 0)
except ZeroDivisionError:
    pass
else:
    raise AssertionError("apart must raise what the call raised")
compute = ComputeThread(inline_decode=True, inline_max_s=0.25)
assert dedicate(compute, None) == 2 and compute.threads == 2
assert not compute.inline_decode  # the loop's thread computes with one thread now
settled = tasks()  # + the compute thread and its one helper
assert compute.executor.submit(parallel_op).result() == 2
assert parallel_op() == 1
box = []
other = threading.Thread(target=lambda: box.append(parallel_op()))
other.start(); other.join()
assert box == [1]
assert tasks(settles_at=settled) == settled  # no other thread started helpers
one = ComputeThread(inline_decode=True, inline_max_s=0.25)
assert dedicate(one, 1) == 1 and one.inline_decode  # one thread: the loop may compute
print("ok")
"""


def test_the_compute_thread_alone_computes_with_the_nodes_threads():
    if sys.platform != "linux":
        pytest.skip("counts threads in /proc")
    out = subprocess.run([sys.executable, "-c", DEDICATE], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_process_spins_briefly_unless_the_operator_chose(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as before torch loads
    env: dict[str, str] = {}
    assert "spin 10000 rounds" in short_spin(env)
    assert env == {"GOMP_SPINCOUNT": str(SPIN_ROUNDS)}
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        env = dict(chosen)
        assert "as set" in short_spin(env) and env == chosen


def test_too_late_once_torch_is_loaded():
    import torch  # noqa: F401  (loaded: libgomp read its environment already)

    env: dict[str, str] = {}
    assert "torch's default" in short_spin(env) and env == {}

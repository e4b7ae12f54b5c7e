"""How a node process spends its CPU threads (docs/adr/0036): the shard loads on a thread
that ends with it, the loop's thread keeps the node's torch threads (runs short passes
inline) and every other thread computes with one, a long pass runs on a thread that ends
with it, so OpenMP never keeps more helper threads than the node asked for; and the OpenMP
wait a process sets before torch loads, unless the operator chose one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshnet_common.config.openmp import SPIN_ROUNDS, short_spin

# Run apart: it sets the process's torch threads. Counts the OS threads OpenMP starts.
COUNTING = r"""
import asyncio, os, threading, time, torch
from meshnet_node.cpu_threads import apart, computing, dedicate
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

def elsewhere():
    box = []
    other = threading.Thread(target=lambda: box.append(parallel_op()))
    other.start(); other.join()
    return box[0]

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
"""

INLINE = (
    COUNTING
    + r"""
compute = ComputeThread(inline_decode=True, inline_max_s=0.25)
assert dedicate(compute, None) == 2 and compute.threads == 2
assert compute.owner == threading.get_ident() and compute.inline_decode
assert parallel_op() == 2  # this thread (the loop's) computes with the node's threads
assert compute.executor.submit(parallel_op).result() == 1  # the compute thread with one
assert elsewhere() == 1
settled = before + 2  # the compute thread, and this thread's one helper
assert tasks(settles_at=settled) == settled
# A pass handed to the compute thread runs on a thread of its own with two; it and its
# helper end with the pass.
assert compute.executor.submit(computing, parallel_op, 2).result() == 2
assert tasks(settles_at=settled) == settled
assert elsewhere() == 1  # the default is one again

async def passes():
    name = lambda: (threading.current_thread().name, torch.get_num_threads())
    assert await compute.run(name) == ("pass", 2)
    assert await compute.run_decode(name) == ("pass", 2)  # decode time unknown yet
    compute.decode_s = 0.01  # short: decode passes run here, on the loop's thread
    assert await compute.run_decode(name) == ("MainThread", 2)
    assert await compute.run_rows(name, rows=16) == ("pass", 2)  # rows' time unknown
    compute.row_s = 0.001
    assert await compute.run_rows(name, rows=16) == ("MainThread", 2)
    assert await compute.run_rows(name, rows=16, inline=False) == ("pass", 2)
    assert await compute.run_rows(name, rows=1000) == ("pass", 2)  # 1 s: too long here
    compute.decode_s = 1.0  # a slow shard: every pass on the compute thread
    assert await compute.run_decode(name) == ("pass", 2)

asyncio.run(passes())
assert tasks(settles_at=settled) == settled  # no other thread kept helpers
one = ComputeThread(inline_decode=True, inline_max_s=0.25)
assert dedicate(one, 1) == 1 and one.inline_decode and parallel_op() == 1
print("ok")
"""
)

NOT_INLINE = (
    COUNTING
    + r"""
compute = ComputeThread(inline_decode=False, inline_max_s=0.25)
assert dedicate(compute, None) == 2 and compute.threads == 2 and compute.owner is None
assert compute.executor.submit(parallel_op).result() == 2
settled = before + 2  # the compute thread and its one helper
assert parallel_op() == 1 and elsewhere() == 1
assert tasks(settles_at=settled) == settled  # no other thread started helpers
print("ok")
"""
)


@pytest.mark.parametrize("script", [INLINE, NOT_INLINE], ids=["inline", "no-inline-decode"])
def test_one_long_lived_thread_computes_with_the_nodes_threads(script):
    if sys.platform != "linux":
        pytest.skip("counts threads in /proc")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
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

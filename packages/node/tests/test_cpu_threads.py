"""How a node process spends its CPU threads (docs/adr/0036, 0039): the shard loads on a
thread that ends with it, the scheduler's compute thread keeps the node's torch threads and
runs every pass, and every other thread computes with one, so OpenMP never keeps more
helper threads than the node asked for; and the OpenMP wait a process sets before torch
loads, unless the operator chose one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshnet_common.config.openmp import SPIN_ROUNDS, short_spin

# Run apart: it sets the process's torch threads. Counts the OS threads OpenMP starts.
COUNTING = r"""
import asyncio, os, threading, time, torch
from meshnet_node.cpu_threads import apart, dedicate
from meshnet_node.scheduling.scheduler import ComputeScheduler

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

ONE_COMPUTING_THREAD = (
    COUNTING
    + r"""
scheduler = ComputeScheduler()
assert dedicate(scheduler, None) == 2 and scheduler.threads == 2
assert scheduler.call(parallel_op).result() == 2  # the compute thread: two
assert parallel_op() == 1 and elsewhere() == 1  # this thread (the loop's) and any other: one
settled = before + 2  # the compute thread and its one helper
assert tasks(settles_at=settled) == settled

async def passes():
    name = lambda: (threading.current_thread().name, torch.get_num_threads())
    ran = [await scheduler.run(name), await scheduler.rows(name, rows=200)]
    scheduler.queue.times.decode_s = 0.001  # short or long, every pass runs there
    ran.append(await scheduler.rows(name, rows=2))
    return ran

ran = asyncio.run(passes())
assert len(set(ran)) == 1 and ran[0][0].startswith("compute") and ran[0][1] == 2, ran
assert tasks(settles_at=settled) == settled  # no other thread started helpers
print("ok")
"""
)


def test_one_long_lived_thread_computes_with_the_nodes_threads():
    """Every pass runs on the scheduler's compute thread with the node's threads, set once;
    every other thread computes with one, so OpenMP keeps no other team."""
    if sys.platform != "linux":
        pytest.skip("counts threads in /proc")
    out = subprocess.run([sys.executable, "-c", ONE_COMPUTING_THREAD], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# The packed kernels' library (int4 / int8 / FP8 / MXFP4) run on the compute thread after
# dedicate: torch's lazy per-thread count set-up, inlined into an extension, used to re-set
# that thread to the process default (one) at its first kernel call.
KERNEL_KEEPS_THE_COUNT = r"""
import torch
from meshnet_node.cpu_threads import dedicate
from meshnet_node.kernels import intpack, packed
from meshnet_node.lowbit.packed import Int4Weight
from meshnet_node.scheduling.scheduler import ComputeScheduler

torch.set_num_threads(2)
packed.start()
packed.wait()
if not intpack.ready():
    print("skip: " + str(intpack.unavailable_reason() or packed.unavailable_reason()))
    raise SystemExit
weight = Int4Weight.quantize(torch.randn(1024, 512), 32, torch.float32)
scheduler = ComputeScheduler()
dedicate(scheduler, 2)

def product_then_count():
    weight.matmul(torch.randn(1, 512))
    return torch.get_num_threads()

assert [scheduler.call(product_then_count).result() for _ in range(2)] == [2, 2]
print("ok")
"""


def test_the_packed_kernels_leave_the_compute_thread_its_count():
    out = subprocess.run([sys.executable, "-c", KERNEL_KEEPS_THE_COUNT], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    if out.stdout.startswith("skip: "):
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_process_spins_briefly_unless_the_operator_chose(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as before torch loads
    env: dict[str, str] = {}
    assert f"spin {SPIN_ROUNDS} rounds" in short_spin(env)
    assert env == {"GOMP_SPINCOUNT": str(SPIN_ROUNDS)}
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        env = dict(chosen)
        assert "as set" in short_spin(env) and env == chosen


def test_too_late_once_torch_is_loaded():
    import torch  # noqa: F401  (loaded: libgomp read its environment already)

    env: dict[str, str] = {}
    assert "torch's default" in short_spin(env) and env == {}

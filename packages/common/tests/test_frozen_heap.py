"""A service keeps what it built before serving out of the garbage collector's full
collections (docs/adr/0036): a full collection of a node's start-up heap (~370,000
objects) took ~200 ms, inside a decode step. Run apart: freezing is process-wide."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import gc, weakref
from meshnet_common.web.serve import freeze_heap, refreeze_heap

class Node:  # a cycle: only the collector frees it
    pass

built = [Node() for _ in range(200_000)]
for node in built:
    node.me = node
probe = weakref.ref(built[0])
assert freeze_heap() >= 200_000
assert not any(isinstance(o, Node) for o in gc.get_objects())  # no collection walks them
del built  # let go of what was frozen: a full collection cannot reach it now
gc.collect()
assert probe() is not None
assert refreeze_heap() < 200_000  # reached once more, and freed
assert probe() is None
print("ok")
"""


def test_what_was_built_before_serving_stays_out_of_full_collections():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

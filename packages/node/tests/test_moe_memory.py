"""Predicted vs measured resident memory of an MoE shard (a separate process, so nothing
else the test session holds is counted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshnet_common.tiny.snapshots import make_tiny

MEASURE = r"""
import ctypes, gc, json, sys
import psutil
from meshnet_common.layers import LayerRange
from meshnet_common.memory import ModelCosts
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard

snapshot, start, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
proc = psutil.Process()
warm = load_shard(snapshot, LayerRange(start, start + 1))  # lazy imports, caches
del warm
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = proc.memory_info().rss
shard = load_shard(snapshot, LayerRange(start, end))
gc.collect()
measured = proc.memory_info().rss - before
costs = ModelCosts.from_index(CheckpointIndex.load(snapshot))
print(json.dumps({"measured": measured, "predicted": costs.weight_bytes(
    LayerRange(start, end), Precision.BFLOAT16), "parameters": shard.parameter_bytes()}))
"""


@pytest.mark.slow
def test_moe_shard_rss_matches_the_prediction(tmp_path):
    # big enough that weights (~28 MB for two layers) dominate allocator noise
    snapshot = make_tiny(tmp_path, "mixtral", "t/mixtral-512", layers=4, hidden=512,
                         intermediate=1024)  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(snapshot), "1", "3"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["parameters"] == pytest.approx(got["predicted"], rel=0.01)
    assert got["measured"] == pytest.approx(got["predicted"], rel=0.15), got

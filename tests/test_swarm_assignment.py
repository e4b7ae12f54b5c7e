"""Nodes that join with no model are placed coverage-first; a gap is closed by a move."""

from __future__ import annotations

import httpx
import pytest
from swarm_harness import Swarm, covered, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
KV = ("--kv-budget-tokens", "2048")


@pytest.fixture
def smol_only_dir(smollm2_snapshot, tmp_path):
    """A models dir holding only SmolLM2, so placement has one model to cover."""
    models = tmp_path / "models"
    (models / "HuggingFaceTB").mkdir(parents=True)
    (models / MODEL).symlink_to(smollm2_snapshot, target_is_directory=True)
    return models


def ranges(tracker) -> dict[str, tuple[int, int]]:
    model = next(
        m for m in httpx.get(f"{tracker.url}/v1/coverage").json()["models"] if m["id"] == MODEL
    )
    return {n["node_id"]: (n["shard_start"], n["shard_end"]) for n in model["nodes"]}


def complete(tracker) -> str:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0}  # fmt: skip
    resp = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_joining_nodes_cover_the_model_then_a_redundant_node_fills_a_gap(smol_only_dir, tmp_path):
    swarm = Swarm(smol_only_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", MODEL, "--shard-start", "0", "--shard-end", "10", *KV)
        tracker.wait_healthy()
        a = swarm.join(tracker, "0.15", "node-a", *KV).wait_healthy()
        assert ranges(tracker)["node-a"] == (10, 20)  # the gap right after the tracker node
        b = swarm.join(tracker, "0.25", "node-b", *KV).wait_healthy()
        assert ranges(tracker)["node-b"] == (20, 30)  # the rest, tail included
        wait_for(lambda: covered(tracker, MODEL), timeout=30)
        text = complete(tracker)
        assert text.startswith(" Paris")

        swarm.join(tracker, "0.25", "node-c", *KV).wait_healthy()
        start, end = ranges(tracker)["node-c"]
        assert start == 0 and end > 10  # redundancy where capacity is weakest, from the head

        b.kill()  # its layers are unique: a gap opens, node-c is moved into it
        wait_for(lambda: ranges(tracker).get("node-c") == (20, 30), timeout=60)
        wait_for(lambda: covered(tracker, MODEL), timeout=30)
        assert complete(tracker) == text
        assert a.popen.poll() is None
    finally:
        swarm.close()

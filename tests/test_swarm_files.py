"""The tracker as model-file source: a node with nothing on disk receives only its layers."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors import safe_open
from swarm_harness import Swarm, covered, wait_for
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import CheckpointIndex

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
KV = ("--kv-budget-tokens", "2048")


@pytest.fixture
def tracker_models(smollm2_snapshot, tmp_path):
    models = tmp_path / "tracker-models"
    (models / "HuggingFaceTB").mkdir(parents=True)
    (models / MODEL).symlink_to(smollm2_snapshot, target_is_directory=True)
    return models


def node_args(cache, *extra: str) -> list[str]:
    return ["--cache-dir", str(cache), *KV, *extra]


def test_joining_node_receives_only_its_layers(tracker_models, smollm2_snapshot, tmp_path):
    swarm = Swarm(tracker_models, tmp_path, heartbeat_s=0.5)
    cache = tmp_path / "empty-cache"
    try:
        tracker = swarm.tracker("--model-id", MODEL, "--shard-start", "0", "--shard-end", "10", *KV)
        tracker.wait_healthy()
        # No --models-dir, an empty cache, no hub: the weights can only come from the tracker.
        node = swarm.bare_node(tracker, "node-b", *node_args(cache, "--memory-gb", "0.5"))
        node.wait_healthy()
        wait_for(lambda: covered(tracker, MODEL), timeout=30)

        shard = next(cache.rglob("layers-10-30"))
        manifest = json.loads((shard / "meshnet-manifest.json").read_text())
        index = CheckpointIndex.load(smollm2_snapshot)
        expected = set(index.tensors_for(LayerRange(10, 30)))
        with safe_open(str(shard / "model.safetensors"), "pt") as fh:
            assert set(fh.keys()) == expected  # nothing of layers 0..9, nothing extra
        tensor_bytes = index.bytes_for(LayerRange(10, 30))
        received = sum(p.stat().st_size for p in shard.iterdir())
        weights = (shard / "model.safetensors").stat().st_size
        assert manifest["tensor_bytes"] == tensor_bytes
        assert tensor_bytes <= weights <= tensor_bytes * 1.01
        assert received < tensor_bytes + 5 * 2**20  # + config/tokenizer files
        assert received < 0.8 * index.total_bytes

        tokenizer = AutoTokenizer.from_pretrained(smollm2_snapshot)
        model = AutoModelForCausalLM.from_pretrained(smollm2_snapshot, dtype=torch.bfloat16)
        ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
        expected_text = tokenizer.decode(
            model.generate(ids, do_sample=False, max_new_tokens=8,
                           attention_mask=torch.ones_like(ids))[0, ids.shape[1]:],
            skip_special_tokens=True,
        )  # fmt: skip
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
                "temperature": 0}  # fmt: skip
        reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["text"] == expected_text
    finally:
        swarm.close()


def test_corrupt_source_is_rejected_and_the_next_one_used(tracker_models, tmp_path):
    swarm = Swarm(tracker_models, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", MODEL, "--shard-start", "0", "--shard-end", "10", *KV)
        tracker.wait_healthy()
        # A peer holding [10, 30) that flips a byte in every weights file it serves.
        peer = swarm.node(tracker, MODEL, 10, 30, *KV, "--fault-inject", "corrupt").wait_healthy()
        cache = tmp_path / "cache-b"
        node = swarm.bare_node(
            tracker, "node-b", *node_args(cache, "--model-id", MODEL, "--shard-start", "10",
                                          "--shard-end", "30", "--shard-source", peer.url),
        ).wait_healthy()  # fmt: skip
        assert "sha256 mismatch" in node.log()  # the peer was tried first and refused
        assert (next(cache.rglob("layers-10-30")) / "meshnet-manifest.json").exists()
    finally:
        swarm.close()


def test_no_good_source_means_a_clear_exit(tracker_models, tmp_path):
    swarm = Swarm(tracker_models, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker(*KV, "--fault-inject", "corrupt").wait_healthy()
        cache = tmp_path / "cache-c"
        node = swarm.bare_node(tracker, "node-c", *node_args(cache, "--memory-gb", "0.5"))
        assert node.popen.wait(timeout=120) != 0
        log = node.log()
        assert "could not get" in log and "Traceback" not in log
        assert not list(cache.rglob("meshnet-manifest.json"))  # nothing unverified kept
    finally:
        swarm.close()


def test_a_broken_transfer_is_resumed(tracker_models, tmp_path):
    swarm = Swarm(tracker_models, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker(*KV, "--fault-inject", "truncate").wait_healthy()
        cache = tmp_path / "cache-d"
        node = swarm.bare_node(tracker, "node-d", *node_args(cache, "--memory-gb", "0.5"))
        node.wait_healthy()
        assert "resuming" in node.log()  # the connection dropped halfway; a range request
        assert list(cache.rglob("meshnet-manifest.json"))  # finished it, and it verified
    finally:
        swarm.close()


def test_path_traversal_and_unknown_models_are_refused(tracker_models, tmp_path):
    swarm = Swarm(tracker_models, tmp_path)
    try:
        tracker = swarm.tracker().wait_healthy()
        base = f"{tracker.url}/v1/shards"
        cases = [
            ("manifest", {"model": "../etc", "start": 0, "end": 1}, 400),
            ("manifest", {"model": "nope/nope", "start": 0, "end": 1}, 404),
            ("manifest", {"model": MODEL, "start": 5, "end": 99}, 400),
            ("download", {"model": MODEL, "start": 0, "end": 1, "file": "../../etc/passwd"}, 404),
            ("download", {"model": MODEL, "start": 0, "end": 1, "file": "/etc/passwd"}, 404),
        ]
        for path, params, status in cases:
            resp = httpx.get(f"{base}/{path}", params=params, timeout=30)
            assert resp.status_code == status, (params, resp.text)
            assert "error" in resp.json()
            assert str(tracker_models) not in resp.text  # the local folder layout stays local
        config = {"model": MODEL, "start": 0, "end": 1, "file": "config.json"}
        ranged = httpx.get(f"{base}/download", params=config, headers={"range": "bytes=2-9"})
        assert ranged.status_code == 206 and len(ranged.content) == 8
        whole = httpx.get(f"{base}/download", params=config).content
        past = httpx.get(
            f"{base}/download", params=config, headers={"range": f"bytes={len(whole)}-"}
        )
        assert past.status_code == 416, past.text
        assert past.headers["content-range"] == f"bytes */{len(whole)}"
        tail = httpx.get(f"{base}/download", params=config, headers={"range": "bytes=-7"})
        assert tail.status_code == 206 and tail.content == whole[-7:]
    finally:
        swarm.close()

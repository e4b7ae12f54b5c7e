"""A DeepSeek-V3-style MoE (latent attention, shared + routed experts, a dense first layer)
served by real processes: the tracker node holds [0, 2), two nodes with nothing on disk fetch
[2, 4) and [4, 6) (experts included, nothing else) from the tracker, and the swarm's greedy
text equals the unsplit model's."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors import safe_open
from swarm_harness import Swarm, covered, wait_for
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import CheckpointIndex

pytestmark = [pytest.mark.integration]

FP32 = ("--quantization", "float32", "--kv-budget-tokens", "2048")
PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(params=["bf16", "fp8"])
def deepseek_models(request, tiny_snapshot, tiny_model_id, tmp_path):
    """The tiny DeepSeek-V3 in the hub-cache layout (layers straddle files), as stored on
    the hub: bfloat16, or FP8 with block scales as DeepSeek-V3 itself ships."""
    models = tmp_path / "tracker-models"
    models.mkdir()
    if request.param == "bf16":
        snapshot = tiny_snapshot("deepseek_v3", "hub")
        (models / "models--meshnet-tiny--deepseek_v3-hub").symlink_to(
            snapshot.parent.parent, target_is_directory=True
        )
        return models, snapshot, tiny_model_id("deepseek_v3", "hub")
    from meshnet_common.tiny.snapshots import make_tiny

    model_id = "meshnet-tiny/deepseek_v3-fp8"
    snapshot = make_tiny(models, "deepseek_v3", model_id, layout="hub", weight_format="fp8")
    return models, snapshot, model_id


def test_deepseek_v3_split_over_processes_fetching_their_experts(deepseek_models, tmp_path):
    models, snapshot, model_id = deepseek_models
    index = CheckpointIndex.load(snapshot)
    assert (
        any(".experts." in n for n in index.tensors) and len(index.files_for(LayerRange(0, 6))) > 3
    )
    swarm = Swarm(models, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker(
            "--model-id", model_id, "--shard-start", "0", "--shard-end", "2", *FP32
        ).wait_healthy()
        caches = [tmp_path / "cache-b", tmp_path / "cache-c"]
        names = ("node-b", "node-c")
        for (start, end), cache, name in zip(((2, 4), (4, 6)), caches, names, strict=True):
            swarm.bare_node(
                tracker, name, "--model-id", model_id, "--shard-start", str(start),
                "--shard-end", str(end), "--cache-dir", str(cache), *FP32,
            ).wait_healthy()  # fmt: skip
        wait_for(lambda: covered(tracker, model_id), timeout=60)

        for (start, end), cache in zip(((2, 4), (4, 6)), caches, strict=True):
            shard = next(cache.rglob(f"layers-{start}-{end}"))
            with safe_open(str(shard / "model.safetensors"), "pt") as fh:
                held = set(fh.keys())
            assert held == set(index.tensors_for(LayerRange(start, end)))
            assert {index.layer_of(n) for n in held} - {None} == set(range(start, end))
            assert any(".experts." in n for n in held)  # routed experts travelled, per expert

        tokenizer = AutoTokenizer.from_pretrained(snapshot)
        model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32).eval()
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12
        )
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        body = {"model": model_id, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120).json()
        # a character left unfinished by the last token is not sent (head/text.py)
        assert reply["choices"][0]["text"] == expected.rstrip("\ufffd")
        assert reply["usage"]["completion_tokens"] == out.shape[1] - ids.shape[1]
    finally:
        swarm.close()

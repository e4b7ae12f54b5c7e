"""A chain whose stages hold their weights at different precisions, in real processes: the
tracker node keeps [0, 2) of a tiny Qwen3-MoE in bfloat16, one node [2, 4) at int8 and one
[4, 6) at int4 (experts packed too). Activations cross the wire in bfloat16 as ever; the
swarm's greedy text is what the same three stages give in one process, and the dashboard
shows each node's precision (ADR-0031)."""

from __future__ import annotations

import httpx
import pytest
from baselines import split_greedy
from swarm_harness import Swarm, covered, wait_for
from transformers import AutoTokenizer

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage

pytestmark = [pytest.mark.integration]

FAMILY = "qwen3_moe"
PROMPT = "The capital of France is Paris. The capital of Germany is"
CHAIN = ((0, 2, "bfloat16"), (2, 4, "int8"), (4, 6, "int4"))
GROUP = "32"


def test_a_chain_of_bf16_int8_and_int4_stages_answers_as_the_same_stages_in_one_process(
    tiny_snapshot, tiny_model_id, models_dir, tmp_path
):
    snapshot = tiny_snapshot(FAMILY)
    model_id = tiny_model_id(FAMILY)
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    ids = tokenizer(PROMPT).input_ids
    stages = [
        Stage(load_shard(snapshot, LayerRange(a, b), Precision(p), group_size=int(GROUP)))
        for a, b, p in CHAIN
    ]
    expected, _ = split_greedy(stages, ids, 12)
    del stages

    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        (a, b, p), *rest = CHAIN
        tracker = swarm.tracker("--model-id", model_id, "--shard-start", str(a), "--shard-end",
                                str(b), "--quantization", p).wait_healthy()  # fmt: skip
        for start, end, precision in rest:
            swarm.node(tracker, model_id, start, end, "--quantization", precision,
                       "--quant-group-size", GROUP).wait_healthy()  # fmt: skip
        wait_for(lambda: covered(tracker, model_id), timeout=60)

        body = {"model": model_id, "prompt": ids, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        out = reply.json()
        assert out["usage"]["completion_tokens"] == len(expected)
        # a character left unfinished by the last token is not sent (head/text.py)
        text = tokenizer.decode(expected, skip_special_tokens=True).rstrip("\ufffd")
        assert out["choices"][0]["text"] == text

        nodes = httpx.get(f"{tracker.url}/v1/dashboard", timeout=10).json()["nodes"]
        shown = {(n["shard_start"], n["shard_end"]): n["precision"] for n in nodes}
        assert shown == {(0, 2): "bfloat16", (2, 4): "int8", (4, 6): f"int4 g{GROUP}"}, nodes
    finally:
        swarm.close()

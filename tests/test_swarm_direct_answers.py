"""Answers straight from the tail to the head, through real processes: a tracker node and
two nodes, a swarm token; the tail posts each token to the tracker node, the text equals the
unsplit model's, and a completion streamed through the same chain too."""

from __future__ import annotations

import httpx
import pytest
import torch
from baselines import hf_chunked_greedy, load_reference_model
from swarm_harness import Swarm, covered, wait_for

pytestmark = [pytest.mark.integration]

FP32 = ("--quantization", "float32", "--kv-budget-tokens", "2048", "--swarm-token", "s3cret",
        "--direct-min-rtt", "0")  # loopback: asked for although the chain is as fast  # fmt: skip


def _metric(url: str, name: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=5, headers={"x-meshnet-swarm-token": "s3cret"})
    line = next(ln for ln in metrics.text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[-1])


def test_the_tail_answers_the_tracker_node_directly(models_dir, tiny_snapshot, tiny_model_id,
                                                     tmp_path):  # fmt: skip
    snapshot = tiny_snapshot("llama")
    model_id = tiny_model_id("llama")
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", model_id, "--shard-start", "0", "--shard-end",
                                "2", *FP32).wait_healthy()  # fmt: skip
        swarm.node(tracker, model_id, 2, 4, *FP32).wait_healthy()
        swarm.node(tracker, model_id, 4, 6, *FP32).wait_healthy()
        wait_for(lambda: covered(tracker, model_id), timeout=30)
        prompt = [(i * 17) % 400 + 5 for i in range(30)]
        want, _ = hf_chunked_greedy(load_reference_model(snapshot, torch.float32), prompt, 24)
        body = {"model": model_id, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}  # fmt: skip
        reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        tokenizer_text = choice["text"]
        assert len(choice["logprobs"]["tokens"]) == 24
        assert reply.json()["meshnet_timing"]["hops"] == 2
        # steps sent for the tail to sample: the prefill's last chunk, every decode step
        # answered, less the right guesses among them, plus every guess step sent (those
        # dropped or answered stale included; ADR-0019)
        steps = (
            1
            + _metric(tracker.url, "meshnet_decode_step_seconds_count")
            - _metric(tracker.url, "meshnet_spec_decode_num_accepted_tokens_total")
            + _metric(tracker.url, "meshnet_spec_decode_num_draft_tokens_total")
        )
        direct = _metric(tracker.url, "meshnet_direct_answers_total")
        # The tail's direct answer and the chain's race on loopback; a busy host decides
        # which arrives first, so only that some did, and never more than one a step.
        assert 1 <= direct <= steps
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(snapshot)
        assert tokenizer_text == tokenizer.decode(want, skip_special_tokens=True)
        streamed = httpx.post(f"{tracker.url}/v1/completions", json={**body, "stream": True},
                              timeout=60)  # fmt: skip
        texts = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert len(texts) == 24
    finally:
        swarm.close()

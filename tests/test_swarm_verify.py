"""Catching nodes that compute wrong (docs/adr/0026), in real processes.

A head auditing every decode step (``--verify-fraction 1``) finds the replica started with
``--test-only-perturb`` (noise on everything it computes), fails its stream over to the
honest replica mid-request, and reports it; after a repeated verdict the tracker quarantines
it (dashboard, metrics, no routes) and it refuses steps. What the swarm answers from then on
is the unsplit model's text. An honest bfloat16 swarm audited as hard convicts no one.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from swarm_harness import Swarm, covered, wait_for
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FP32 = ("--quantization", "float32")
PROMPT = "The capital of France is Paris. The capital of Germany is"


def dashboard_nodes(tracker) -> dict[str, dict]:
    nodes = httpx.get(f"{tracker.url}/v1/dashboard", timeout=5).json()["nodes"]
    return {n["node_id"]: n for n in nodes}


def metric(proc, name: str, labels: str = "") -> float:
    text = httpx.get(f"{proc.url}/metrics", timeout=5).text
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def node_ids(tracker, model_id: str) -> set[str]:
    models = httpx.get(f"{tracker.url}/v1/coverage", timeout=5).json()["models"]
    return {n["node_id"] for m in models if m["id"] == model_id for n in m["nodes"]
            if n["state"] == "serving"}  # fmt: skip


def stream_text(tracker, body: dict) -> tuple[str, str, int]:
    """The streamed text, finish reason and completion tokens (from the usage chunk)."""
    text, finish, tokens = [], None, 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{tracker.url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
    return "".join(text), finish, tokens


def test_a_node_computing_wrong_is_caught_failed_over_and_quarantined(
    tiny_snapshot, tiny_model_id, models_dir, tmp_path
):
    snapshot, model_id = tiny_snapshot("llama"), tiny_model_id("llama")
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=16, min_new_tokens=16)  # fmt: skip
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}  # fmt: skip

    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", model_id, "--shard-start", "0", "--shard-end",
                                "2", "--verify-fraction", "1", "--operator-token", "op-1", "--speculative", "off",
                                *FP32).wait_healthy()  # fmt: skip
        swarm.node(tracker, model_id, 4, 6, "--node-id", "tail", *FP32).wait_healthy()
        # Its passes take 40 ms more, one token each (no speculation): a 16-token stream
        # through it lasts longer than an audit (~60 ms; ~450 ms with a replica's first
        # pass), which must convict it while the stream still runs.
        bad = swarm.node(tracker, model_id, 2, 4, "--node-id", "mid-bad",
                         "--test-only-perturb", "0.5", "--step-delay-ms", "40",
                         *FP32).wait_healthy()  # fmt: skip
        wait_for(lambda: covered(tracker, model_id), timeout=60)
        # Alone in its range, the faulty node serves (nothing to compare it with) and its
        # route is kept once the honest replica joins (routes do not flap).
        alone = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120).json()
        assert alone["choices"][0]["text"] != expected
        assert metric(tracker, "meshnet_audits_total", '{outcome="skipped"}') >= 1
        swarm.node(tracker, model_id, 2, 4, "--node-id", "mid-ok", *FP32).wait_healthy()
        wait_for(lambda: "mid-ok" in node_ids(tracker, model_id), timeout=30)

        # The next stream starts on the faulty node: an audit convicts it, the stream fails
        # over to the honest replica (exact replay) and completes. (Its text may be empty:
        # what the faulty node chose can be special tokens or unfinished UTF-8.)
        _, finish, tokens = stream_text(tracker, body)
        assert finish == "length" and tokens == 16
        assert metric(tracker, "meshnet_audits_total", '{outcome="convicted"}') >= 1
        assert metric(tracker, "meshnet_failovers_total") >= 1
        assert "computed wrong" in tracker.log()

        # Audits of the honest replica, with the faulty one as the alternate, repeat the
        # verdict: the tracker quarantines it.
        for _ in range(5):
            if dashboard_nodes(tracker)["mid-bad"]["state"] == "quarantined":
                break
            httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120)
        shown = dashboard_nodes(tracker)["mid-bad"]
        assert shown["state"] == "quarantined" and "verdicts" in shown["quarantined"]
        assert "mid-bad" not in node_ids(tracker, model_id)
        assert metric(tracker, "meshnet_swarm_nodes", f'{{model="{model_id}",state='
                      '"quarantined"}') == 1  # fmt: skip
        assert metric(tracker, "meshnet_swarm_verdicts_total") >= 2
        wait_for(lambda: metric(bad, "meshnet_quarantined") == 1, timeout=10)  # told so

        # From now on the swarm answers the unsplit model's text, and the faulty node
        # refuses any step (a head that still tried it would fail over).
        for _ in range(2):
            reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120).json()
            assert reply["choices"][0]["text"] == expected.rstrip("\ufffd")
        info = httpx.get(f"{bad.url}/v1/node", timeout=5).json()
        assert info["active_sessions"] == 0
        lift = f"{tracker.url}/v1/nodes/mid-bad/quarantine"
        assert httpx.delete(lift, timeout=5).status_code == 401  # the operator's call only
        operator = {"x-meshnet-operator-token": "op-1"}
        lifted = httpx.delete(lift, headers=operator, timeout=5)
        assert lifted.status_code == 200
        assert dashboard_nodes(tracker)["mid-bad"]["state"] == "serving"
    finally:
        swarm.close()


def test_an_honest_bfloat16_swarm_audited_at_every_step_convicts_no_one(
    smollm2_snapshot, models_dir, tmp_path
):
    model_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    body = {"model": model_id, "prompt": "def quicksort(items):\n    ", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", model_id, "--shard-start", "0", "--shard-end",
                                "10", "--verify-fraction", "1").wait_healthy()  # fmt: skip
        names = ("mid-a", "mid-b", "tail-a", "tail-b")
        for name, (start, end) in zip(names, ((10, 20),) * 2 + ((20, 30),) * 2, strict=True):
            swarm.node(tracker, model_id, start, end, "--node-id", name)
        for proc in swarm.procs[1:]:
            proc.wait_healthy()
        wait_for(lambda: set(names) <= node_ids(tracker, model_id), timeout=60)
        texts = {
            httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120).json()[
                "choices"][0]["text"] for _ in range(3)
        }  # fmt: skip
        assert len(texts) == 1  # audits change nothing of what the swarm answers
        agreed = metric(tracker, "meshnet_audits_total", '{outcome="agreed"}')
        # A step starts an audit unless the chain's last one still runs, so how many ran
        # depends on timing (19-24 seen here); every one of them agreed.
        assert agreed >= 9
        for outcome in ("convicted", "disputed"):
            assert metric(tracker, "meshnet_audits_total", f'{{outcome="{outcome}"}}') == 0
        assert all(n["state"] == "serving" for n in dashboard_nodes(tracker).values())
    finally:
        swarm.close()


def test_a_remote_heads_verdict_counts_with_the_rows_the_nodes_signed(
    tiny_snapshot, tiny_model_id, models_dir, tmp_path
):
    """docs/adr/0032: a head other than the tracker node reports its conviction with the
    rows the replicas signed with their node secrets; the tracker checks the signatures
    and the distances itself, and quarantines on that evidence alone."""
    tiny_snapshot("llama")
    model_id = tiny_model_id("llama")
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", model_id, "--shard-start", "0", "--shard-end",
                                "2", "--quarantine-after", "1", *FP32).wait_healthy()  # fmt: skip
        head = swarm.node(tracker, model_id, 0, 2, "--node-id", "head", "--verify-fraction",
                          "1", *FP32).wait_healthy()  # fmt: skip
        swarm.node(tracker, model_id, 4, 6, "--node-id", "tail", *FP32).wait_healthy()
        swarm.node(tracker, model_id, 2, 4, "--node-id", "mid-ok", *FP32).wait_healthy()
        swarm.node(tracker, model_id, 2, 4, "--node-id", "mid-bad", "--test-only-perturb",
                   "0.5", *FP32).wait_healthy()  # fmt: skip
        wait_for(lambda: {"mid-ok", "mid-bad"} <= node_ids(tracker, model_id), timeout=60)
        for _ in range(8):
            if dashboard_nodes(tracker)["mid-bad"]["state"] == "quarantined":
                break
            httpx.post(f"{head.url}/v1/completions", json=body, timeout=120)
        assert dashboard_nodes(tracker)["mid-bad"]["state"] == "quarantined", head.log()
        assert "could not report" not in head.log()
        assert dashboard_nodes(tracker)["mid-ok"]["state"] == "serving"
    finally:
        swarm.close()

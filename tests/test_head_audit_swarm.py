"""Heads audited by the hop after them (docs/adr/0032), in real processes.

Two heads serve ``[0, 2)``, one of them started with ``--test-only-perturb`` (noise on
everything it computes); the tail, started with ``--verify-fraction 1``, keeps the rows
and token ids the heads send it, asks the heads which of them holds each session, has the
other head recompute the sender's last row from the ids, and reports the faulty head with
the rows both heads signed. The tracker checks that evidence and quarantines the faulty
head; the honest one keeps serving, and the swarm answers its text.
"""

from __future__ import annotations

import httpx
import pytest
from swarm_harness import Swarm, wait_for
from test_swarm_verify import dashboard_nodes, metric, node_ids

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FP32 = ("--quantization", "float32")
PROMPT = "The capital of France is Paris. The capital of Germany is"


def test_the_tail_convicts_a_head_computing_wrong_and_the_tracker_quarantines_it(
    tiny_snapshot, tiny_model_id, models_dir, tmp_path
):
    tiny_snapshot("llama")
    model_id = tiny_model_id("llama")
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--quarantine-after", "1").wait_healthy()
        good = swarm.node(tracker, model_id, 0, 2, "--node-id", "head-ok", *FP32)
        bad = swarm.node(tracker, model_id, 0, 2, "--node-id", "head-bad",
                         "--test-only-perturb", "0.5", *FP32)  # fmt: skip
        tail = swarm.node(tracker, model_id, 2, 6, "--node-id", "tail", "--verify-fraction",
                          "1", *FP32)  # fmt: skip
        for proc in (good, bad, tail):
            proc.wait_healthy()
        wait_for(lambda: {"head-ok", "head-bad", "tail"} <= node_ids(tracker, model_id),
                 timeout=60)  # fmt: skip

        for _ in range(4):  # completions through the faulty head
            if dashboard_nodes(tracker)["head-bad"]["state"] == "quarantined":
                break
            httpx.post(f"{bad.url}/v1/completions", json=body, timeout=120)
        shown = dashboard_nodes(tracker)
        assert shown["head-bad"]["state"] == "quarantined", tail.log()
        assert shown["head-ok"]["state"] == "serving" and shown["tail"]["state"] == "serving"
        assert metric(tail, "meshnet_audits_total", '{outcome="convicted"}') >= 1
        assert "computed wrong" in tail.log() and "could not report" not in tail.log()
        assert "head-bad" not in node_ids(tracker, model_id)

        # The honest head, audited the same way, is never convicted (the faulty one may be
        # again, as its alternate); the swarm's text is the honest head's.
        honest = httpx.post(f"{good.url}/v1/completions", json=body, timeout=120).json()
        via_tracker = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120)
        assert via_tracker.json()["choices"][0]["text"] == honest["choices"][0]["text"]
        assert "node head-ok" not in tail.log()
        assert dashboard_nodes(tracker)["head-ok"]["state"] == "serving"
    finally:
        swarm.close()

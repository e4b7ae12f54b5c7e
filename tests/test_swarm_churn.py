"""Churn without failed requests (docs/adr/0024): nodes drain on SIGTERM or on request,
finish what they hold, deregister and exit 0; a restarted node takes its place."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from swarm_harness import Swarm, covered, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
BODY = {"model": MODEL, "prompt": "def quicksort(items):\n    ", "max_tokens": 48,
        "temperature": 0, "ignore_eos": True}  # fmt: skip


def info(proc) -> dict:
    return httpx.get(f"{proc.url}/v1/node", timeout=5).json()


def node_ids(tracker) -> set[str]:
    models = httpx.get(f"{tracker.url}/v1/coverage", timeout=5).json()["models"]
    return {n["node_id"] for m in models if m["id"] == MODEL for n in m["nodes"]}


def test_drains_and_a_restart_under_load_fail_nothing(smollm2_snapshot, models_dir, tmp_path):
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", MODEL, "--shard-start", "0", "--shard-end", "10")
        swarm.node(tracker, MODEL, 20, 30, "--node-id", "tail").wait_healthy()
        mids = [swarm.node(tracker, MODEL, 10, 20, "--node-id", f"mid-{n}", "--drain-timeout",
                           "60", "--operator-token", "op") for n in "ab"]  # fmt: skip
        for mid in mids:
            mid.wait_healthy()
        wait_for(lambda: covered(tracker, MODEL) and {"mid-a", "mid-b"} <= node_ids(tracker),
                 timeout=60)  # fmt: skip
        expected = httpx.post(f"{tracker.url}/v1/completions", json=BODY, timeout=180).json()
        expected = expected["choices"][0]["text"]

        # 1. SIGTERM the middle node holding a stream: it finishes the stream, then leaves.
        text, seen, drained = [], 0, None
        with httpx.stream("POST", f"{tracker.url}/v1/completions", json={**BODY, "stream": True},
                          timeout=180) as resp:  # fmt: skip
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
                seen += 1
                if seen == 5:
                    [drained] = [m for m in mids if info(m)["active_sessions"]]
                    drained.popen.send_signal(signal.SIGTERM)
        assert "".join(text) == expected
        drained.popen.wait(timeout=60)
        assert drained.popen.returncode == 0, drained.log()
        assert "drained in" in drained.log() and "failed during" not in tracker.log()
        name = f"mid-{'ab'[mids.index(drained)]}"
        wait_for(lambda: name not in node_ids(tracker), timeout=10)  # it deregistered

        # 2. The drained node comes back (a rolling restart's second half).
        drained.start().wait_healthy()
        wait_for(lambda: name in node_ids(tracker) and covered(tracker, MODEL), timeout=60)
        other = mids[1 - mids.index(drained)]

        # 3. The other replica is drained on request (idle: it leaves at once).
        again = httpx.post(f"{tracker.url}/v1/completions", json=BODY, timeout=180).json()
        assert again["choices"][0]["text"] == expected
        resp = httpx.post(f"{other.url}/v1/node/drain", timeout=5,
                          headers={"x-meshnet-operator-token": "op"})  # fmt: skip
        assert resp.status_code == 202 and resp.json()["state"] == "leaving"
        other.popen.wait(timeout=60)
        assert other.popen.returncode == 0
        after = httpx.post(f"{tracker.url}/v1/completions", json=BODY, timeout=180).json()
        assert after["choices"][0]["text"] == expected  # the restarted node serves it
        # Nothing leaks: once the clients are done, no node holds a session or a KV token.
        alive = [p for p in swarm.procs if p.popen.poll() is None and p is not tracker]
        wait_for(lambda: all(info(p)["active_sessions"] == 0 == info(p)["kv_tokens"]
                             for p in alive), timeout=15)  # fmt: skip
    finally:
        swarm.close()

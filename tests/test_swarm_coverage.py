"""Coverage map under failure: a killed node shows as a gap, a restarted tracker recovers."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from swarm_harness import covered, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "meshnet-tiny/llama"
HEARTBEAT_S = 0.5


def coverage_of(tracker) -> dict:
    models = httpx.get(f"{tracker.url}/v1/coverage", timeout=5).json()["models"]
    return next(m for m in models if m["id"] == MODEL)


def active_sessions(node) -> int:
    return httpx.get(f"{node.url}/v1/node", timeout=5).json()["active_sessions"]


def complete(tracker) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 5, "temperature": 0}
    return httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=60)


def test_killed_node_leaves_a_gap_and_tracker_restart_rebuilds_the_map(
    tiny_snapshot, swarm_factory
):
    tiny_snapshot("llama")
    swarm = swarm_factory(heartbeat_s=HEARTBEAT_S)
    tracker = swarm.tracker().wait_healthy()
    head = swarm.node(tracker, MODEL, 0, 3, "--quantization", "float32")
    tail = swarm.node(tracker, MODEL, 3, 6, "--quantization", "float32")
    head.wait_healthy()
    tail.wait_healthy()
    wait_for(lambda: covered(tracker, MODEL), timeout=30)

    entry = coverage_of(tracker)
    assert {(n["shard_start"], n["shard_end"]) for n in entry["nodes"]} == {(0, 3), (3, 6)}
    assert entry["gaps"] == []
    before = complete(tracker)
    assert before.status_code == 200, before.text
    text = before.json()["choices"][0]["text"]

    # A client that goes away mid-stream frees the session on every hop.
    stream_body = {"model": MODEL, "prompt": "hello", "max_tokens": 900, "temperature": 0,
                   "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{tracker.url}/v1/completions", json=stream_body) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    wait_for(lambda: all(active_sessions(p) == 0 for p in (head, tail)), timeout=10)

    # A hop dying mid-stream: the client gets an error chunk, then [DONE] — never a hang.
    with httpx.stream("POST", f"{tracker.url}/v1/completions", json=stream_body) as resp:
        events = (line[6:] for line in resp.iter_lines() if line.startswith("data: "))
        assert "choices" in json.loads(next(events))
        tail.kill()  # SIGKILL: no deregistration, only missed heartbeats tell
        killed_at = time.monotonic()
        wait_for(lambda: coverage_of(tracker)["gaps"] == [[3, 6]], timeout=10, interval=0.05)
        assert time.monotonic() - killed_at <= 3 * HEARTBEAT_S + 0.5
        rest = list(events)  # the head tried for a replacement, found none, and said so
    assert rest[-1] == "[DONE]"
    assert "[3, 6)" in json.loads(rest[-2])["error"]["message"]
    refused = complete(tracker)
    assert refused.status_code == 503
    assert "[3, 6)" in refused.json()["error"]["message"]
    assert MODEL not in [m["id"] for m in httpx.get(f"{tracker.url}/v1/models").json()["data"]]

    swarm.node(tracker, MODEL, 3, 6, "--quantization", "float32").wait_healthy()
    wait_for(lambda: covered(tracker, MODEL), timeout=30)

    # The tracker's state is soft: a new tracker on the same port relearns every node.
    tracker.kill()
    restarted = swarm.tracker(port=tracker.port).wait_healthy()
    wait_for(lambda: covered(restarted, MODEL), timeout=30)
    assert head.popen.poll() is None  # nodes kept running throughout
    again = complete(restarted)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == text

"""One request cannot leave work running that nobody reads (issue #35), over real processes:
a multi-prompt request whose prompts overflow the head's queue is refused, and every one of
its generations ends with it (no session left on any node, no tokens served after); a
request beyond the bound on generations is refused with 400 naming it, as a stop string too
long."""

from __future__ import annotations

import httpx
import pytest
from swarm_harness import covered, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "meshnet-tiny/llama"
F32 = ("--quantization", "float32")


def _nodes(tracker) -> list[dict]:
    return httpx.get(f"{tracker.url}/v1/dashboard", timeout=5).json()["nodes"]


def test_an_overflowing_request_leaves_nothing_running(tiny_snapshot, swarm_factory):
    tiny_snapshot("llama")
    swarm = swarm_factory()
    tracker = swarm.tracker(
        "--model-id", MODEL, "--shard-start", "0", "--shard-end", "3", *F32,
        "--max-queued-requests", "2", "--max-sessions", "4",
    ).wait_healthy()  # fmt: skip
    swarm.node(tracker, MODEL, 3, 6, *F32, "--node-id", "tail").wait_healthy()
    wait_for(lambda: covered(tracker, MODEL), timeout=60)
    url = f"{tracker.url}/v1/completions"

    body = {"model": MODEL, "prompt": ["Once upon a time"] * 40, "max_tokens": 1000,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    refused = httpx.post(url, json=body, timeout=60)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "queue_full"
    # Every generation of the request ended with it: sessions close on every node, and the
    # swarm stops serving tokens (40 x 1000 would keep it busy for minutes).
    wait_for(lambda: all(n["active_sessions"] == 0 for n in _nodes(tracker)), timeout=30)
    served = {n["node_id"]: n["tokens_served"] for n in _nodes(tracker)}
    after = httpx.post(url, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert after.status_code == 200, after.text  # the head serves the next request at once
    wait_for(lambda: all(n["active_sessions"] == 0 for n in _nodes(tracker)), timeout=30)
    again = {n["node_id"]: n["tokens_served"] for n in _nodes(tracker)}
    assert all(again[k] - served[k] <= 10 for k in served), (served, again)

    too_many = httpx.post(url, json={**body, "prompt": ["a"] * 65, "n": 2}, timeout=30)
    assert too_many.status_code == 400 and "128 generations" in too_many.json()["error"]["message"]
    long_stop = httpx.post(url, json={"model": MODEL, "prompt": "a", "stop": "x" * 300}, timeout=30)
    assert long_stop.status_code == 400 and long_stop.json()["error"]["param"] == "stop"

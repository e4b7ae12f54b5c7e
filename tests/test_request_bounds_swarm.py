"""One request cannot leave work running that nobody reads (issue #35), over real processes:
a multi-prompt request whose prompts overflow the head's queue is refused, and every one of
its generations ends with it (no session left on any node, no tokens served after), streamed
or not, as when its client leaves mid-stream; requests beyond the bounds on prompts,
generations, stop strings or JSON schemas are refused with 400 naming them."""

from __future__ import annotations

import json

import httpx
import pytest
from swarm_harness import covered, wait_for

from meshnet_common.openai_protocol import MAX_CHOICES, MAX_PROMPTS
from meshnet_common.protocol import GRAMMAR_MAX_BYTES

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "meshnet-tiny/llama"
F32 = ("--quantization", "float32")


def _nodes(tracker) -> list[dict]:
    return httpx.get(f"{tracker.url}/v1/dashboard", timeout=5).json()["nodes"]


def _idle(tracker, tail) -> bool:
    """No session open anywhere: on the tail (asked directly) and on every node as the
    tracker sees them."""
    held = httpx.get(f"{tail.url}/v1/node", timeout=5).json()["active_sessions"]
    return held == 0 and all(n["active_sessions"] == 0 for n in _nodes(tracker))


def test_an_overflowing_request_leaves_nothing_running(tiny_snapshot, swarm_factory):
    tiny_snapshot("llama")
    swarm = swarm_factory()
    tracker = swarm.tracker(
        "--model-id", MODEL, "--shard-start", "0", "--shard-end", "3", *F32,
        "--max-queued-requests", "2", "--max-sessions", "4",
    ).wait_healthy()  # fmt: skip
    tail = swarm.node(tracker, MODEL, 3, 6, *F32, "--node-id", "tail").wait_healthy()
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

    # Streamed: the refusal comes in-band, and nothing runs on either.
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as events:
        text = "".join(events.iter_text())
    assert '"queue_full"' in text and text.rstrip().endswith("data: [DONE]"), text[-500:]
    wait_for(lambda: _idle(tracker, tail), timeout=30)

    # A client that leaves mid-stream ends all of its generations (3 fit the chain).
    leaving = {**body, "prompt": ["Once upon a time"] * 3, "stream": True}
    with httpx.stream("POST", url, json=leaving, timeout=60) as events:
        lines = events.iter_lines()  # held: a dropped iterator closes the response
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                break  # a token came: the generations run (3 x 1000 tokens)
        assert httpx.get(f"{tail.url}/v1/node", timeout=5).json()["active_sessions"] >= 1
    wait_for(lambda: _idle(tracker, tail), timeout=30)

    prompts = httpx.post(url, json={**body, "prompt": ["a"] * (MAX_PROMPTS + 1)}, timeout=30)
    assert prompts.status_code == 400, prompts.text
    error = prompts.json()["error"]
    assert error["param"] == "prompt" and f"at most {MAX_PROMPTS}" in error["message"]
    too_many = httpx.post(url, json={**body, "prompt": ["a"] * 40, "n": 4}, timeout=30)
    assert too_many.status_code == 400
    assert f"{MAX_CHOICES} generations" in too_many.json()["error"]["message"]
    long_stop = httpx.post(url, json={"model": MODEL, "prompt": "a", "stop": "x" * 300}, timeout=30)
    assert long_stop.status_code == 400 and long_stop.json()["error"]["param"] == "stop"
    props = {f"field_{i:05d}": {"type": "string"} for i in range(GRAMMAR_MAX_BYTES // 20)}
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "big", "schema": {"type": "object", "properties": props}},
    }
    schema = httpx.post(url, json={"model": MODEL, "prompt": "a", "response_format": fmt},
                        timeout=30)  # fmt: skip
    assert schema.status_code == 400, schema.text
    error = schema.json()["error"]
    assert error["param"] == "response_format" and str(GRAMMAR_MAX_BYTES) in error["message"]
    assert _idle(tracker, tail)

"""Swarm token and API keys: internal routes and OpenAI routes refuse strangers."""

from __future__ import annotations

import httpx
import pytest
from swarm_harness import covered, wait_for

from meshnet_common.protocol import H_ROUTE, H_SWARM_TOKEN

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "meshnet-tiny/llama"
TOKEN = "swarm-secret-3141"
KEY = "client-key-2718"


def test_secrets_guard_the_swarm(tiny_snapshot, swarm_factory):
    tiny_snapshot("llama")
    swarm = swarm_factory()
    auth = ("--swarm-token", TOKEN)
    tracker = swarm.tracker(*auth, "--api-key", KEY).wait_healthy()
    head = swarm.node(tracker, MODEL, 0, 3, *auth, "--api-key", KEY)
    tail = swarm.node(tracker, MODEL, 3, 6, *auth)
    intruder = swarm.node(tracker, MODEL, 3, 6, "--swarm-token", "wrong", "--node-id", "intruder")
    for proc in (head, tail):
        proc.wait_healthy()
    wait_for(lambda: covered(tracker, MODEL), timeout=30)
    # A node with the wrong token is refused at once and says so in one line.
    assert intruder.popen.wait(timeout=60) == 1
    assert "meshnet-node: error: the tracker refused this node: " in intruder.log()

    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}
    url = f"{tracker.url}/v1/completions"
    assert httpx.post(url, json=body).status_code == 401
    wrong = httpx.post(url, json=body, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    ok = httpx.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200, ok.text

    # Internal routes: nothing without the swarm token.
    assert httpx.post(f"{tail.url}/v1/forward", content=b"x").status_code == 401
    assert httpx.get(f"{tracker.url}/v1/route", params={"model": MODEL}).status_code == 401
    assert httpx.post(f"{tracker.url}/v1/nodes/register", content=b"{}").status_code == 401
    ids = {n["node_id"] for m in httpx.get(f"{tracker.url}/v1/coverage").json()["models"]
           for n in m["nodes"]}  # fmt: skip
    assert "intruder" not in ids  # its registrations were refused

    # A client may not steer activations with a route header, even with a valid API key.
    steer = httpx.post(
        f"{head.url}/v1/completions", json=body,
        headers={"authorization": f"Bearer {KEY}", H_ROUTE: "http://127.0.0.1:9/"},
    )  # fmt: skip
    assert steer.status_code == 401
    good = httpx.post(
        f"{head.url}/v1/completions", json=body, timeout=60,
        headers={H_SWARM_TOKEN: TOKEN, H_ROUTE: tail.url},
    )  # fmt: skip
    assert good.status_code == 200 and good.json()["choices"] == ok.json()["choices"]

    for proc in (tracker, head, tail):
        log = proc.log()
        assert TOKEN not in log and KEY not in log  # secrets never reach the logs

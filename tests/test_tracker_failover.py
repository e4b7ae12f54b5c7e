"""A node given two trackers (``--tracker URL1,URL2``) outlives the first: killed, the node's
next heartbeat goes to the second, which does not know it (no shared store here: each tracker
keeps its registry in memory), so the node registers there, and the second tracker's map has
it serving and answers completions through it. Both trackers hold the swarm's one signing key,
so the node's kept tracker key and certificate stay good."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from swarm_harness import covered, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "meshnet-tiny/llama"
BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}  # fmt: skip


def node_ids(tracker) -> set[str]:
    models = httpx.get(f"{tracker.url}/v1/coverage", timeout=5).json()["models"]
    return {n["node_id"] for m in models if m["id"] == MODEL for n in m["nodes"]}


def completion(tracker) -> str:
    resp = httpx.post(f"{tracker.url}/v1/completions", json=BODY, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_a_node_moves_to_the_second_tracker_when_the_first_dies(tiny_snapshot, swarm_factory):
    tiny_snapshot("llama")
    swarm = swarm_factory()
    # The same --signing-key file for both (the harness's default key file): one swarm key.
    first = swarm.tracker().wait_healthy()
    second = swarm.tracker().wait_healthy()
    both = SimpleNamespace(url=f"{first.url},{second.url}")
    node = swarm.node(both, MODEL, 0, 6, "--node-id", "solo").wait_healthy()
    wait_for(lambda: covered(first, MODEL), timeout=30)
    assert node_ids(second) == set()  # it registered with the first only
    expected = completion(first)

    first.kill()  # SIGKILL: no goodbye, its port refuses connections from now on
    wait_for(lambda: "solo" in node_ids(second) and covered(second, MODEL), timeout=30)
    log = node.log()
    assert f"tracker {first.url} did not answer" in log and f"now asking {second.url}" in log
    assert f"registered with tracker {second.url}" in log
    # No heartbeat was lost on the way: the first one the dead tracker missed went to the
    # second (which did not know the node, so it registered there), none failed outright.
    assert "heartbeat failed" not in log
    assert "tracker's key changed" not in log  # one swarm, one key: the kept key holds
    assert completion(second) == expected
    assert node.popen.poll() is None


def test_a_request_on_a_tracker_that_dies_ends_its_generation_on_the_head(
    tiny_snapshot, swarm_factory
):
    """The request is lost with the tracker's connection, and only it: the head sees its
    client (the tracker) gone and ends the generation, which would otherwise run a minute
    (200 steps of 300 ms), rather than leave it orphaned."""
    tiny_snapshot("llama")
    swarm = swarm_factory()
    tracker = swarm.tracker().wait_healthy()
    head = swarm.node(tracker, MODEL, 0, 6, "--step-delay-ms", "300").wait_healthy()
    wait_for(lambda: covered(tracker, MODEL), timeout=30)
    body = {**BODY, "max_tokens": 200, "stream": True}
    with (
        pytest.raises(httpx.HTTPError),
        httpx.stream("POST", f"{tracker.url}/v1/completions", json=body, timeout=60) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data: "):  # the generation runs on the head
                assert httpx.get(f"{head.url}/v1/node").json()["active_sessions"] == 1
                tracker.kill()
    wait_for(lambda: httpx.get(f"{head.url}/v1/node").json()["active_sessions"] == 0, 20)
    ended = [line for line in head.log().splitlines() if "generation done" in line]
    assert len(ended) == 1 and "finish=cancelled" in ended[0], ended

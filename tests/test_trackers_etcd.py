"""Two trackers over one real etcd (issue 53's check, at a tiny model's size): three nodes
given both URLs register with the first, the leader; while 8 clients stream completions
through the second, the first is killed. Every stream completes with the text the swarm
gives without a failure, the nodes keep their records through the second tracker (the
store holds their secrets, so their heartbeats are known there), the map stays what it
was, and a node joining afterwards is placed by the second, now the leader."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import httpx
import pytest
from etcd_server import start_etcd
from swarm_harness import covered, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "meshnet-tiny/llama"
BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 40, "temperature": 0,
        "ignore_eos": True}  # fmt: skip
RANGES = ((0, 2), (2, 4), (4, 6))


def the_map(tracker) -> dict[str, tuple[int, int, str]]:
    models = httpx.get(f"{tracker.url}/v1/coverage", timeout=5).json()["models"]
    return {
        n["node_id"]: (n["shard_start"], n["shard_end"], n["state"])
        for m in models if m["id"] == MODEL for n in m["nodes"]
    }  # fmt: skip


def every_node(tracker) -> set[str]:
    models = httpx.get(f"{tracker.url}/v1/coverage", timeout=5).json()["models"]
    return {n["node_id"] for m in models for n in m["nodes"]}


def stream(tracker, started: threading.Event, out: list, index: int) -> None:
    text = []
    with httpx.stream("POST", f"{tracker.url}/v1/completions", json={**BODY, "stream": True},
                      timeout=120) as resp:  # fmt: skip
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text.append(chunk["choices"][0]["text"])
            started.set()
    out[index] = "".join(text)


def test_the_leader_dies_under_streams_and_the_second_tracker_carries_the_swarm(
    tiny_snapshot, swarm_factory, tmp_path
):
    etcd = start_etcd(tmp_path)
    try:
        tiny_snapshot("llama")
        swarm = swarm_factory()
        store = ("--store", etcd.url.replace("http://", "etcd://"))
        first = swarm.tracker(*store).wait_healthy()
        second = swarm.tracker(*store).wait_healthy()
        both = SimpleNamespace(url=f"{first.url},{second.url}")
        nodes = [
            swarm.node(both, MODEL, start, end, "--node-id", f"n{start}").wait_healthy()
            for start, end in RANGES
        ]
        wait_for(lambda: covered(second, MODEL) and len(the_map(second)) == 3, timeout=30)
        before = the_map(second)
        expected = httpx.post(f"{second.url}/v1/completions", json=BODY, timeout=60).json()
        expected = expected["choices"][0]["text"]

        texts: list[str | None] = [None] * 8
        started = [threading.Event() for _ in texts]
        clients = [
            threading.Thread(target=stream, args=(second, started[i], texts, i))
            for i in range(len(texts))
        ]
        for client in clients:
            client.start()
        for event in started:
            assert event.wait(60)
        first.kill()  # the leader, with every stream under way
        for client in clients:
            client.join(120)
        assert texts == [expected] * len(texts)

        # The nodes' next heartbeats went to the second tracker, which knows them.
        wait_for(lambda: all("now asking" in n.log() for n in nodes), timeout=30)
        for node in nodes:
            assert "heartbeat failed" not in node.log()
        assert the_map(second) == before

        # A node joining now is placed by the second tracker, the leader now.
        # (the coverage-first gap it fills may be another model's of the models dir)
        swarm.join(SimpleNamespace(url=second.url), "2", "late")
        wait_for(lambda: "late" in every_node(second), timeout=60)
    finally:
        etcd.stop()

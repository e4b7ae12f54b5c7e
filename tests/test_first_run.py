"""What a new user hits first (issue 13), with real processes on 127.0.0.1: a busy node stays
on the map, a wildcard bind advertises a reachable address, a model copied in after start-up
is placed, nodes still loading are capacity on its way, ranges given by hand never move, and
a client that gives up is an info line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest
from swarm_harness import Swarm, covered, wait_for

from meshnet_common.config.openmp import SPIN_ROUNDS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LLAMA = "meshnet-tiny/llama"  # 6 layers
F32 = ("--quantization", "float32")


def coverage(tracker) -> dict[str, dict]:
    models = httpx.get(f"{tracker.url}/v1/coverage", timeout=5).json()["models"]
    return {m["id"]: m for m in models}


def nodes_of(tracker, model: str = LLAMA) -> dict[str, dict]:
    return {n["node_id"]: n for n in coverage(tracker).get(model, {"nodes": []})["nodes"]}


def node_id_of(proc) -> str:
    return httpx.get(f"{proc.url}/health", timeout=5).json()["node_id"]


def complete(url: str, max_tokens: int = 3, timeout: float = 120) -> httpx.Response:
    body = {"model": LLAMA, "prompt": "hello world", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


@pytest.fixture
def llama_dir(tiny_snapshot, tmp_path):
    """A models dir holding only the tiny Llama (a copy another model can be added to)."""
    models = tmp_path / "models"
    target = models / LLAMA
    target.parent.mkdir(parents=True)
    target.symlink_to(tiny_snapshot("llama"), target_is_directory=True)
    return models


@pytest.fixture
def swarm(llama_dir, tmp_path):
    swarm = Swarm(llama_dir, tmp_path / "logs", heartbeat_s=0.5)
    swarm.log_dir.mkdir()
    yield swarm
    swarm.close()


def test_a_node_busy_with_slow_steps_stays_on_the_map(swarm):
    """Each step takes 2 s, more than three heartbeat intervals (1.5 s)."""
    tracker = swarm.tracker().wait_healthy()
    node = swarm.node(tracker, LLAMA, 0, 6, *F32, "--step-delay-ms", "2000").wait_healthy()
    wait_for(lambda: covered(tracker, LLAMA), timeout=30)
    node_id = node_id_of(node)
    answer: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answer.append(complete(tracker.url, max_tokens=3)))
    worker.start()
    health_s = []
    while worker.is_alive():
        entry = nodes_of(tracker).get(node_id)
        assert entry is not None and entry["state"] == "serving", "the busy node left the map"
        assert coverage(tracker)[LLAMA]["covered"]
        started = time.monotonic()
        assert httpx.get(f"{node.url}/health", timeout=1.5).status_code == 200
        health_s.append(time.monotonic() - started)
        time.sleep(0.1)
    worker.join()
    assert answer[0].status_code == 200, answer[0].text
    assert len(health_s) >= 20  # polled through the whole ~6 s generation
    assert max(health_s) < 1.5, health_s  # /health never waited for a 2 s step
    assert "missed" not in tracker.log()
    assert "registering again" not in node.log()


def test_the_tracker_node_busy_with_slow_steps_keeps_its_nodes(swarm):
    """The tracker node computing a slow step must not stop the tracker hearing its nodes."""
    tracker = swarm.tracker("--model-id", LLAMA, "--shard-start", "0", "--shard-end", "6", *F32,
                            "--step-delay-ms", "2000").wait_healthy()  # fmt: skip
    replica = swarm.node(tracker, LLAMA, 0, 6, *F32).wait_healthy()
    replica_id = node_id_of(replica)
    wait_for(lambda: replica_id in nodes_of(tracker), timeout=30)
    body = {"model": LLAMA, "prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    done = threading.Event()

    def generate_on_the_tracker_node() -> None:
        try:  # the tracker node is the head of routes from its own endpoint when it is chosen
            for _ in range(2):
                httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120)
        finally:
            done.set()

    threading.Thread(target=generate_on_the_tracker_node).start()
    while not done.is_set():
        assert replica_id in nodes_of(tracker), "the tracker dropped a node while computing"
        time.sleep(0.1)
    assert "missed" not in tracker.log()
    # what each process computes with (docs/adr/0036)
    assert "tracker node: computing with" in tracker.log()
    assert f"spin {SPIN_ROUNDS} rounds" in tracker.log() and "computing with" in replica.log()


def test_a_node_bound_to_every_interface_advertises_a_reachable_address(swarm):
    tracker = swarm.tracker().wait_healthy()
    node = swarm.node(tracker, LLAMA, 0, 6, *F32, "--host", "0.0.0.0", "--insecure").wait_healthy()
    node_id = node_id_of(node)
    wait_for(lambda: covered(tracker, LLAMA), timeout=30)
    assert nodes_of(tracker)[node_id]["url"] == f"http://127.0.0.1:{node.port}"
    assert complete(tracker.url).status_code == 200
    assert f"meshnet-node ready: http://127.0.0.1:{node.port}" in node.log()


def test_a_model_copied_into_the_models_dir_gets_the_next_joining_node(
    swarm, llama_dir, tiny_snapshot, tiny_model_id
):
    qwen, gpt2 = tiny_model_id("qwen3"), tiny_model_id("gpt2")
    qwen_src, gpt2_src = tiny_snapshot("qwen3"), tiny_snapshot("gpt2")
    tracker = swarm.tracker("--models-rescan", "0.5").wait_healthy()
    swarm.node(tracker, LLAMA, 0, 6, *F32).wait_healthy()
    wait_for(lambda: covered(tracker, LLAMA), timeout=30)
    assert set(coverage(tracker)) == {LLAMA}

    shutil.copytree(qwen_src, llama_dir / qwen)  # copied in while the tracker runs
    joiner = swarm.join(tracker, "1", "node-new", *F32).wait_healthy()
    assert f"tracker assigned {qwen} layers [0, " in joiner.log()
    wait_for(lambda: covered(tracker, qwen), timeout=30)
    listed = subprocess.run(
        [sys.executable, "-m", "meshnet_common.models.cli", "list", "--models-dir",
         str(llama_dir), "--json"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert {m["model_id"] for m in json.loads(listed.stdout)["models"]} == set(coverage(tracker))

    # Found on the timer too (no node asking), and forgotten once removed.
    shutil.copytree(gpt2_src, llama_dir / gpt2)
    wait_for(lambda: gpt2 in coverage(tracker), timeout=10)
    shutil.rmtree(llama_dir / gpt2)
    wait_for(lambda: gpt2 not in coverage(tracker), timeout=10)
    assert set(coverage(tracker)) == {LLAMA, qwen}


def test_a_node_still_loading_counts_as_capacity_on_its_way(swarm):
    tracker = swarm.tracker().wait_healthy()
    slow = swarm.node(tracker, LLAMA, 0, 6, *F32, "--load-delay-ms", "6000")
    wait_for(lambda: any(n["state"] == "joining" for n in nodes_of(tracker).values()), 30)
    assert not coverage(tracker)[LLAMA]["covered"]  # joining is not serving: never routed to
    joiner = swarm.join(tracker, "1", "node-late", *F32).wait_healthy()
    assert f"tracker assigned {LLAMA} layers [0, 6) (redundancy)" in joiner.log()
    slow.wait_healthy()
    wait_for(lambda: len([n for n in nodes_of(tracker).values() if n["state"] == "serving"]) == 2,
             timeout=30)  # fmt: skip


def balancer_passes(tracker) -> float:
    """``meshnet_rebalance_passes_total`` on the tracker's ``/metrics``."""
    for line in httpx.get(f"{tracker.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("meshnet_rebalance_passes_total "):
            return float(line.split()[1])
    raise AssertionError("no meshnet_rebalance_passes_total on the tracker's /metrics")


def test_ranges_given_by_hand_never_move_under_load(swarm):
    """The order that churned ranges: the tail nodes are still loading while the middle ones
    serve, under load, with no grace period at all."""
    tracker = swarm.tracker("--model-id", LLAMA, "--shard-start", "0", "--shard-end", "2", *F32,
                            "--move-grace", "0").wait_healthy()  # fmt: skip
    seen: dict[str, set] = {}
    stop = threading.Event()
    statuses: list[int] = []

    def watch_and_load() -> None:
        while not stop.is_set():
            for node_id, n in nodes_of(tracker).items():
                seen.setdefault(node_id, set()).add((n["shard_start"], n["shard_end"]))
            if covered(tracker, LLAMA):
                statuses.append(complete(tracker.url, max_tokens=2).status_code)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_and_load)
    watcher.start()
    try:
        for start, end in ((2, 4), (2, 4), (4, 6), (4, 6)):
            swarm.node(tracker, LLAMA, start, end, *F32, "--load-delay-ms", "2000").wait_healthy()
        wait_for(lambda: len(statuses) >= 10, timeout=60)
        passes = balancer_passes(tracker)  # then several balancer passes after the last join
        wait_for(lambda: balancer_passes(tracker) >= passes + 4, timeout=60)
    finally:
        stop.set()
        watcher.join()
    assert len(seen) == 5  # the tracker node and the four
    assert all(len(ranges) == 1 for ranges in seen.values()), seen
    assert set(statuses) == {200}, statuses
    assert "move " not in tracker.log()
    dashboard = httpx.get(f"{tracker.url}/v1/dashboard").json()
    assert not any(n["movable"] for n in dashboard["nodes"])  # all placed by hand


def test_assigned_and_opted_in_nodes_are_movable(swarm):
    tracker = swarm.tracker().wait_healthy()
    swarm.node(tracker, LLAMA, 0, 3, *F32, "--allow-rebalance").wait_healthy()
    swarm.join(tracker, "1", "node-placed", *F32).wait_healthy()
    swarm.node(tracker, LLAMA, 0, 6, *F32).wait_healthy()
    nodes = httpx.get(f"{tracker.url}/v1/dashboard").json()["nodes"]
    movable = {(n["node_id"] == "node-placed", n["shard_end"]): n["movable"] for n in nodes}
    assert movable == {(False, 3): True, (True, 6): True, (False, 6): False}


def test_a_client_that_gives_up_is_an_info_line(swarm):
    tracker = swarm.tracker().wait_healthy()
    node = swarm.node(tracker, LLAMA, 0, 6, *F32, "--step-delay-ms", "300").wait_healthy()
    wait_for(lambda: covered(tracker, LLAMA), timeout=30)
    with pytest.raises(httpx.ReadTimeout):
        complete(node.url, max_tokens=200, timeout=1.5)
    wait_for(lambda: httpx.get(f"{node.url}/v1/node").json()["active_sessions"] == 0, 20)
    metrics = httpx.get(f"{node.url}/metrics").text
    assert 'meshnet_errors_total{code="client_disconnected",status="499"} 1.0' in metrics
    log = node.log()
    assert "the client went away" in log and "level=info" in log
    assert "Traceback" not in log and "Exception in ASGI" not in log and "level=error" not in log

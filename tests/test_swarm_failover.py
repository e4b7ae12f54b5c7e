"""A node dies mid-generation: the head routes around it, replays, and nothing is lost."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from swarm_harness import Swarm, covered, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
F32 = ("--quantization", "float32", "--kv-budget-tokens", "4096")
BODY = {"model": MODEL, "prompt": "Once upon a time, in a small village,", "max_tokens": 64,
        "temperature": 0, "ignore_eos": True}  # fmt: skip


@pytest.fixture
def swarm(request, smollm2_snapshot, models_dir, tmp_path):
    """A head (the tracker node), two replicas of the middle [10, 20) and a tail. With a
    parameter (indirect), every compute pass of the middle hops takes that many ms more
    (``--step-delay-ms``): a request holds them long enough for a watcher to see it."""
    middle = ("--step-delay-ms", str(request.param)) if hasattr(request, "param") else ()
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker(
            "--model-id", MODEL, "--shard-start", "0", "--shard-end", "10", *F32
        )
        # The tail first: a middle node that registers while [20, 30) is still a gap would
        # (rightly) be moved there by the tracker's coverage-first balancer.
        swarm.node(tracker, MODEL, 20, 30, *F32, "--node-id", "tail").wait_healthy()
        wait_for(lambda: gaps(tracker) == [[10, 20]], timeout=60)
        mid_a = swarm.node(tracker, MODEL, 10, 20, *F32, "--node-id", "mid-a", *middle)
        mid_b = swarm.node(tracker, MODEL, 10, 20, *F32, "--node-id", "mid-b", *middle)
        for proc in swarm.procs:
            proc.wait_healthy()
        wait_for(lambda: covered(tracker, MODEL), timeout=60)
        yield tracker, mid_a, mid_b
    finally:
        swarm.close()


def gaps(tracker) -> list:
    models = httpx.get(f"{tracker.url}/v1/coverage", timeout=5).json()["models"]
    return next((m["gaps"] for m in models if m["id"] == MODEL), [])


def idle(mids) -> bool:
    return all(
        httpx.get(f"{m.url}/v1/node", timeout=5).json()["active_sessions"] == 0 for m in mids
    )


def busy_one(mids):
    """The middle hop holding the request's session (exactly one does)."""
    holders = [
        m for m in mids if httpx.get(f"{m.url}/v1/node", timeout=5).json()["active_sessions"]
    ]
    assert len(holders) == 1, [m.name for m in holders]
    return holders[0]


def stream_tokens(tracker, kill=(), after: int = 10) -> str:
    """Stream a completion; after ``after`` tokens SIGKILL whichever of ``kill`` holds it."""
    text, seen = [], 0
    with httpx.stream("POST", f"{tracker.url}/v1/completions", json={**BODY, "stream": True},
                      timeout=180) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text.append(event["choices"][0]["text"])
            seen += 1
            if kill and seen == after:
                busy_one(kill).kill()
    return "".join(text)


def test_killed_hop_mid_stream_changes_nothing(swarm):
    tracker, mid_a, mid_b = swarm
    undisturbed = httpx.post(f"{tracker.url}/v1/completions", json=BODY, timeout=180).json()
    expected = undisturbed["choices"][0]["text"]
    assert undisturbed["usage"]["completion_tokens"] == 64
    started = time.perf_counter()
    assert stream_tokens(tracker) == expected
    calm_s = time.perf_counter() - started
    wait_for(lambda: idle((mid_a, mid_b)), timeout=30)  # earlier sessions are closed
    started = time.perf_counter()
    assert stream_tokens(tracker, kill=(mid_a, mid_b), after=10) == expected
    print(f"failover added {time.perf_counter() - started - calm_s:.2f}s to a {calm_s:.2f}s stream")
    assert "failed during decode" in tracker.log()  # the failover really happened
    assert [m.popen.poll() is None for m in (mid_a, mid_b)].count(True) == 1


def kill_middle_hop_when(mids, ready) -> tuple[threading.Thread, list]:
    """Watch the middle hops; SIGKILL the one holding the session once ``ready(info)``.
    ``killed`` gets ``(hop, info)``: what the hop reported just before it was killed.

    Polling sees a state only while it lasts: the tests using this slow the middle hops'
    passes (the ``swarm`` fixture's parameter) so the state they wait for lasts seconds,
    not the few milliseconds a loaded machine can let pass between two polls."""
    killed: list = []

    def watch() -> None:
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                for mid in mids:
                    info = client.get(f"{mid.url}/v1/node").json()
                    if info["active_sessions"] and ready(info):
                        mid.kill()
                        killed.append((mid, info))
                        return
                time.sleep(0.005)

    thread = threading.Thread(target=watch)
    thread.start()
    return thread, killed


# 64 decode passes of the middle hop at 50 ms or more each: its session sits between 22 and
# 75 tokens for over 2 s.
@pytest.mark.parametrize("swarm", [50], indirect=True, ids=["slow-middle"])
def test_killed_hop_mid_decode_without_streaming(swarm):
    tracker, mid_a, mid_b = swarm
    expected = httpx.post(f"{tracker.url}/v1/completions", json=BODY, timeout=180).json()
    wait_for(lambda: idle((mid_a, mid_b)), timeout=30)  # the killer must see only the next one
    # Once the middle hop holds the prompt (12 tokens) plus ~10 generated ones.
    killer, killed = kill_middle_hop_when((mid_a, mid_b), lambda info: info["kv_tokens"] >= 22)
    again = httpx.post(f"{tracker.url}/v1/completions", json=BODY, timeout=180).json()
    killer.join()
    assert killed, "no middle hop ever held the session"
    assert "choices" in again, again
    assert again["choices"][0]["text"] == expected["choices"][0]["text"]
    assert again["usage"]["completion_tokens"] == 64
    assert "failed during decode" in tracker.log(), f"killed at {killed[0][1]}"


# The long prompt's passes on the middle hop at 200 ms or more each: its session is in
# prefill for seconds.
@pytest.mark.parametrize("swarm", [200], indirect=True, ids=["slow-middle"])
def test_killed_hop_during_prefill_changes_nothing(swarm):
    tracker, mid_a, mid_b = swarm
    prompt = " ".join(f"word{i}" for i in range(600))  # ~1,800 tokens: 15 prefill chunks
    long_body = {**BODY, "prompt": prompt, "max_tokens": 8}
    expected = httpx.post(f"{tracker.url}/v1/completions", json=long_body, timeout=300).json()
    wait_for(lambda: idle((mid_a, mid_b)), timeout=30)

    # The first chunk opened a session on the middle hop: more chunks are on their way.
    killer, killed = kill_middle_hop_when((mid_a, mid_b), lambda info: True)
    again = httpx.post(f"{tracker.url}/v1/completions", json=long_body, timeout=300).json()
    killer.join()
    assert killed, "no middle hop ever held the session"
    assert "choices" in again, again
    assert again["choices"][0]["text"] == expected["choices"][0]["text"]
    assert "failed during prefill" in tracker.log(), f"killed at {killed[0][1]}"


def test_tracker_restart_does_not_touch_a_generation_in_flight(tiny_snapshot, swarm_factory):
    tiny_snapshot("llama")
    tiny = "meshnet-tiny/llama"
    swarm = swarm_factory()
    tracker = swarm.tracker().wait_healthy()
    head = swarm.node(tracker, tiny, 0, 3, "--quantization", "float32")
    swarm.node(tracker, tiny, 3, 6, "--quantization", "float32")
    for proc in swarm.procs:
        proc.wait_healthy()
    wait_for(lambda: covered(tracker, tiny), timeout=30)
    body = {"model": tiny, "prompt": "hello", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    expected = httpx.post(f"{head.url}/v1/completions", json=body, timeout=120).json()
    pieces = []
    with httpx.stream("POST", f"{head.url}/v1/completions", json={**body, "stream": True},
                      timeout=120) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
                if len(pieces) == 5:
                    tracker.kill()  # the data path never touches the tracker
    assert "".join(pieces) == expected["choices"][0]["text"]
    restarted = swarm.tracker(port=tracker.port).wait_healthy()
    wait_for(lambda: covered(restarted, tiny), timeout=30)  # the map is rebuilt


def test_the_last_replica_down_briefly_costs_latency_not_the_request(smollm2_snapshot, models_dir, tmp_path):  # fmt: skip
    """bfloat16, one node for [10, 20): it is SIGKILLed mid-stream and restarted at once at
    its address. The head finds no route (the range is gone), waits for it to come back
    (the tracker says it is expected: the node is on the map, then loading again), lifts its
    ban when it answers, replays pass for pass, and the text is the undisturbed run's."""
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", MODEL, "--shard-start", "0", "--shard-end", "10")
        swarm.node(tracker, MODEL, 20, 30, "--node-id", "tail").wait_healthy()
        mid = swarm.node(tracker, MODEL, 10, 20, "--node-id", "mid").wait_healthy()
        wait_for(lambda: covered(tracker, MODEL), timeout=60)
        body = {**BODY, "prompt": "def fibonacci(n):\n    ", "max_tokens": 48}
        expected = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=180).json()
        text, seen = [], 0
        started = time.perf_counter()
        with httpx.stream("POST", f"{tracker.url}/v1/completions", json={**body, "stream": True},
                          timeout=180) as resp:  # fmt: skip
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
                seen += 1
                if seen == 8:
                    mid.kill()
                    mid.start()  # the same node, at the same address, loading again
        print(f"a stream across the outage took {time.perf_counter() - started:.1f}s")
        assert "".join(text) == expected["choices"][0]["text"]
        # All of it: log() is a tail, and late answers to the abandoned session can push
        # the failover's warning out of it.
        log = tracker.log_path.read_text(errors="replace")
        assert "failed during decode" in log and "answers again" in log
    finally:
        swarm.close()

"""Decode lanes through real processes (docs/adr/0058): a tracker node and two nodes with a
swarm token; the decode steps go down the lanes (the tail answering the head's bursts on
its answer lane, ADR-0060), the text equals the unsplit model's, and a
lane is admitted only with the secret its hop stream's handshake gave, and the node goes on
serving after one that did not."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import torch
from baselines import hf_chunked_greedy, load_reference_model
from swarm_harness import Swarm, covered, wait_for
from transformers import AutoTokenizer

from meshnet_node.dataplane import lanes

pytestmark = [pytest.mark.integration]

TOKEN = "s3cret"
FLAGS = ("--quantization", "float32", "--kv-budget-tokens", "2048", "--swarm-token", TOKEN,
         "--speculative", "off")  # plain decode steps: what lanes carry  # fmt: skip


def _metric(url: str, name: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=5, headers={"x-meshnet-swarm-token": TOKEN})
    line = next(ln for ln in metrics.text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[-1])


def _lane_port(node) -> int:
    """The port a node's lane listener took: the one it listens on beside its own (its
    offer, with the secret, is in a hop stream's handshake, which a node opens only to
    calls signed by a certified peer: ADR-0032)."""
    listening = {c.laddr.port for c in psutil.Process(node.popen.pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}  # fmt: skip
    (port,) = listening - {node.bound}
    return port


def _host_lanes(node) -> int:
    """A node's Unix sockets at its lane name: its listener and the lanes it accepted."""
    conns = psutil.Process(node.popen.pid).net_connections("unix")
    return sum("meshnet-lane-" in (c.laddr or "") for c in conns)


def test_decode_steps_take_the_lanes_and_give_the_unsplit_models_text(
    models_dir, tiny_snapshot, tiny_model_id, tmp_path
):
    snapshot = tiny_snapshot("llama")
    model_id = tiny_model_id("llama")
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", model_id, "--shard-start", "0", "--shard-end",
                                "2", *FLAGS).wait_healthy()  # fmt: skip
        middle = swarm.node(tracker, model_id, 2, 4, *FLAGS).wait_healthy()
        tail = swarm.node(tracker, model_id, 4, 6, *FLAGS).wait_healthy()
        wait_for(lambda: covered(tracker, model_id), timeout=30)
        prompt = [(i * 17) % 400 + 5 for i in range(30)]
        want, _ = hf_chunked_greedy(load_reference_model(snapshot, torch.float32), prompt, 24)
        text = AutoTokenizer.from_pretrained(snapshot).decode(want, skip_special_tokens=True)
        body = {"model": model_id, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        for _ in range(2):  # the first dials the lanes while its steps take the streams
            reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == text
        # counted on the loop a few times a second
        for node in (middle, tail):
            wait_for(lambda n=node: _metric(n.url, "meshnet_lane_steps_total") >= 20, timeout=5)
        # once the lane answered in time, the head's steps ran ahead down it (ADR-0059)
        wait_for(lambda: _metric(tracker.url, "meshnet_lane_ahead_steps_total") >= 10, timeout=5)
        # and the tail answered them on the head's answer lane, past the middle hop
        # (ADR-0060; dialed during the first bursts): the same text
        reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=60)
        assert reply.json()["choices"][0]["text"] == text
        wait_for(lambda: _metric(tracker.url, "meshnet_direct_answers_total") >= 10, timeout=5)
        # A seeded sampled text: the same whether its steps ran ahead down the lane (alone)
        # or went on the streams one by one (beside other sessions).
        sampled = {**body, "temperature": 0.9, "seed": 7}
        alone = httpx.post(f"{tracker.url}/v1/completions", json=sampled, timeout=60).json()
        with ThreadPoolExecutor(3) as pool:
            beside = list(pool.map(lambda _: httpx.post(f"{tracker.url}/v1/completions",
                                                        json=sampled, timeout=120), range(3)))  # fmt: skip
        assert [r.json()["choices"][0]["text"] for r in beside] == [alone["choices"][0]["text"]] * 3
        # Sessions at once: each step takes a lane while its session is the head's only one,
        # the streams (batched) while others are open; every text the same.
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: httpx.post(f"{tracker.url}/v1/completions",
                                                         json=body, timeout=120), range(4)))  # fmt: skip
        assert [r.json()["choices"][0]["text"] for r in replies] == [text] * 4
        assert _metric(middle.url, "meshnet_lane_refused_total") == 0
        # On one host the lanes are Unix sockets (``lanes.host_name``): each node's listener
        # and what it accepted, the head's lane at the middle hop, the middle hop's and the
        # head's answer lane at the tail.
        if hasattr(socket, "AF_UNIX"):
            assert _host_lanes(middle) >= 2 and _host_lanes(tail) >= 3

        with socket.create_connection(("127.0.0.1", _lane_port(middle)), timeout=5) as sock:
            sock.sendall(lanes.message(lanes.LaneKind.HELLO, 0, b"not-the-secret"))
            assert sock.recv(16) == b""  # closed: a lane needs its stream's secret
        reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=60)
        assert reply.json()["choices"][0]["text"] == text
    finally:
        swarm.close()


def test_a_step_refused_after_a_hop_ran_it_goes_on_by_the_stream(
    models_dir, tiny_snapshot, tiny_model_id, tmp_path
):
    """Four processes; the tail offers no lane, so the third hop has none to it and refuses
    lane steps: the second hop, which already ran each one, sends it on by the stream (a
    head resending it would meet a hop that cannot go back), and the text is the model's."""
    snapshot = tiny_snapshot("llama")
    model_id = tiny_model_id("llama")
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", model_id, "--shard-start", "0", "--shard-end",
                                "2", *FLAGS).wait_healthy()  # fmt: skip
        second = swarm.node(tracker, model_id, 2, 3, *FLAGS).wait_healthy()
        third = swarm.node(tracker, model_id, 3, 4, *FLAGS).wait_healthy()
        swarm.node(tracker, model_id, 4, 6, *FLAGS, "--no-decode-lanes").wait_healthy()
        wait_for(lambda: covered(tracker, model_id), timeout=30)
        prompt = [(i * 17) % 400 + 5 for i in range(30)]
        want, _ = hf_chunked_greedy(load_reference_model(snapshot, torch.float32), prompt, 16)
        text = AutoTokenizer.from_pretrained(snapshot).decode(want, skip_special_tokens=True)
        body = {"model": model_id, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        for _ in range(2):
            reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == text
        assert _metric(second.url, "meshnet_lane_steps_total") >= 10
        assert _metric(third.url, "meshnet_lane_refused_total") >= 1
        assert _metric(third.url, "meshnet_lane_steps_total") == 0
    finally:
        swarm.close()


def test_past_two_middle_hops_the_tail_answers_the_head_on_its_answer_lane(
    models_dir, tiny_snapshot, tiny_model_id, tmp_path
):
    """Four processes, every lane on: the tail answers the head's bursts on the head's
    answer lane (ADR-0060), each middle hop adding its compute on the way down; the text
    is the unsplit model's, and the step's compute counts every hop."""
    snapshot = tiny_snapshot("llama")
    model_id = tiny_model_id("llama")
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker("--model-id", model_id, "--shard-start", "0", "--shard-end",
                                "2", *FLAGS).wait_healthy()  # fmt: skip
        swarm.node(tracker, model_id, 2, 3, *FLAGS).wait_healthy()
        swarm.node(tracker, model_id, 3, 4, *FLAGS).wait_healthy()
        swarm.node(tracker, model_id, 4, 6, *FLAGS).wait_healthy()
        wait_for(lambda: covered(tracker, model_id), timeout=30)
        prompt = [(i * 17) % 400 + 5 for i in range(30)]
        want, _ = hf_chunked_greedy(load_reference_model(snapshot, torch.float32), prompt, 24)
        text = AutoTokenizer.from_pretrained(snapshot).decode(want, skip_special_tokens=True)
        body = {"model": model_id, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        for _ in range(3):  # the first dials the lanes, the second the answer lane
            reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == text
        wait_for(lambda: _metric(tracker.url, "meshnet_direct_answers_total") >= 10, timeout=5)
        timing = reply.json()["meshnet_timing"]
        assert timing["hops"] == 3
        assert timing["compute_ms_p50"] > 0 and timing["overhead_ms_p50"] < 50
    finally:
        swarm.close()

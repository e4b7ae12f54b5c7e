"""Metrics and logs of a real swarm: /metrics moves after a completion, and the log lines of
that completion carry its request and session ids but never the prompt text."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from swarm_harness import covered, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "meshnet-tiny/llama"
PROMPT = "zebra quartz violin"  # must never appear in logs at info level
REQUEST_ID = "test-observability-1"
LOGFMT_HEAD = re.compile(r"^ts=\S+Z level=(debug|info|warning|error) logger=\S+ ")


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    resp = httpx.get(f"{url}/metrics", timeout=5)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        # ours are meshnet_*; beside them only the standard process and Python collectors
        assert family.name.startswith(("meshnet_", "process_", "python_")), family.name
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: dict, name: str) -> float:
    """Sum over all label values of ``name``."""
    return sum(v for (n, _), v in samples.items() if n == name)


def test_metrics_move_and_logs_carry_ids_but_no_prompt(tiny_snapshot, swarm_factory, tmp_path):
    tiny_snapshot("llama")
    swarm = swarm_factory(heartbeat_s=0.5)
    tracker = swarm.tracker().wait_healthy()
    head = swarm.node(tracker, MODEL, 0, 3, "--quantization", "float32")
    # The tail has no models dir: it fetches its layers from the tracker (download metrics).
    tail = swarm.bare_node(
        tracker, "tail-fetcher", "--model-id", MODEL, "--shard-start", "3", "--shard-end", "6",
        "--quantization", "float32", "--cache-dir", str(tmp_path / "cache"),
    )  # fmt: skip
    head.wait_healthy()
    tail.wait_healthy()
    wait_for(lambda: covered(tracker, MODEL), timeout=30)

    before = {p.name: scrape(p.url) for p in (tracker, head, tail)}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    resp = httpx.post(
        f"{tracker.url}/v1/completions", json=body, headers={"x-request-id": REQUEST_ID},
        timeout=60,
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == REQUEST_ID
    generated = resp.json()["usage"]["completion_tokens"]
    assert generated == 6
    missing = httpx.post(f"{tracker.url}/v1/completions", json={**body, "model": "no/such"})
    assert missing.status_code == 404
    assert missing.headers["x-request-id"].startswith("req-")  # generated when not sent
    after = {p.name: scrape(p.url) for p in (tracker, head, tail)}

    def delta(proc, name, **labels) -> float:
        return value(after[proc.name], name, **labels) - value(before[proc.name], name, **labels)

    # Tracker: the request, the error by code, the weights it served to the tail.
    assert delta(tracker, "meshnet_requests_total", path="/v1/completions", status="200") == 1
    assert delta(tracker, "meshnet_errors_total", status="404", code="model_not_found") == 1
    assert value(after[tracker.name], "meshnet_shard_downloads_served_total") >= 1
    assert value(after[tracker.name], "meshnet_shard_served_bytes_total") > 0
    assert value(after[tracker.name], "meshnet_swarm_nodes", model=MODEL, state="serving") == 2
    assert value(after[tracker.name], "meshnet_swarm_uncovered_layers", model=MODEL) == 0
    # Head: tokens, prefill/decode latency, the hop to the tail, bytes it sent.
    assert delta(head, "meshnet_tokens_generated_total") == generated
    assert delta(head, "meshnet_prompt_tokens_total") == resp.json()["usage"]["prompt_tokens"]
    assert delta(head, "meshnet_prefill_seconds_count") == 1
    # decode steps answered; guess steps (ADR-0019, on by default over a chain): a traversal
    # is a step waited for, with the right guesses whose answers rode along behind it
    steps = delta(head, "meshnet_decode_step_seconds_count")
    assert 1 <= steps <= generated - 1
    traversals = steps - delta(head, "meshnet_spec_decode_num_accepted_tokens_total")
    assert delta(head, "meshnet_tokens_per_traversal_count") == traversals
    assert delta(head, "meshnet_tokens_per_traversal_sum") == generated - 1
    assert delta(head, "meshnet_hop_seconds_count", hop=tail.url) == steps + 1
    assert delta(head, "meshnet_wire_sent_bytes_total") > 0
    assert delta(head, "meshnet_tokens_served_total") == generated
    # Tail: bytes received, tokens run through it, the verified fetch of its shard.
    assert delta(tail, "meshnet_wire_received_bytes_total") == delta(
        head, "meshnet_wire_sent_bytes_total"
    )
    assert delta(tail, "meshnet_tokens_served_total") == generated
    assert value(after[tail.name], "meshnet_shard_fetches_total", result="ok") == 1
    assert value(after[tail.name], "meshnet_shard_fetched_bytes_total") > 0
    for name in (head.name, tail.name):  # sessions are freed, the budget is reported
        assert value(after[name], "meshnet_active_sessions") == 0
        assert value(after[name], "meshnet_kv_tokens") == 0
        assert value(after[name], "meshnet_kv_budget_tokens") == 32768
    assert total(after[head.name], "meshnet_request_seconds_count") > 0

    # Logs (info level): one structured line per event, ids included, no prompt text.
    for proc in (tail, head, tracker):  # nodes first: they deregister
        proc.stop()  # flush and end: the whole log is on disk
    logs = {p.name: p.log_path.read_text() for p in (tracker, head, tail)}
    for name, text in logs.items():
        assert PROMPT not in text, f"prompt text leaked into {name}'s log"
        for line in filter(None, text.splitlines()):  # the ready line, else one event a line
            assert line.startswith("meshnet-") or LOGFMT_HEAD.match(line), line
    routed = [line for line in logs[tracker.name].splitlines() if 'msg="request routed"' in line]
    assert len(routed) == 1 and f"request_id={REQUEST_ID}" in routed[0]
    done = [line for line in logs[head.name].splitlines() if 'msg="generation done"' in line]
    assert len(done) == 1
    assert f"request_id={REQUEST_ID}" in done[0]
    assert re.search(r"session_id=[0-9a-f]{32}\b", done[0])
    assert f"tokens={generated}" in done[0]
    assert "not_found" in logs[tracker.name]  # the 404 is one info line with its code


def test_debug_level_logs_the_prompt_as_json_lines(tiny_snapshot, swarm_factory):
    """The opposite side: at debug the prompt is logged, and --log-format json is one object
    per line."""
    tiny_snapshot("llama")
    swarm = swarm_factory(heartbeat_s=0.5)
    tracker = swarm.tracker("--model-id", MODEL, "--shard-start", "0", "--shard-end", "6",
                            "--log-level", "debug", "--log-format", "json").wait_healthy()  # fmt: skip
    wait_for(lambda: covered(tracker, MODEL), timeout=30)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    resp = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    tracker.stop()
    records = [
        json.loads(line)
        for line in tracker.log_path.read_text().splitlines()
        if line.startswith("{")
    ]
    assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    prompt_lines = [r for r in records if PROMPT in r["msg"]]
    assert prompt_lines and all(r["level"] == "debug" for r in prompt_lines)
    request_id = resp.headers["x-request-id"]
    assert any(
        r["msg"] == "generation done" and r.get("request_id") == request_id and r["session_id"]
        for r in records
    )

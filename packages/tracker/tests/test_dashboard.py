"""The dashboard page, its JSON and the tracker's /metrics, in-process (no sockets)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from meshnet_common.protocol import Heartbeat, NodeAnnouncement, NodeState
from meshnet_tracker.app import create_app
from meshnet_tracker.registry import Registry
from meshnet_tracker.settings import TrackerSettings

MODEL = "org/model"


def announcement(node_id: str, start: int, end: int, num_layers: int = 8) -> dict:
    return {
        "node_id": node_id,
        "url": f"http://{node_id}.test:8000",
        "shard": {"model_id": MODEL, "shard_start": start, "shard_end": end},
        "num_layers": num_layers,
        "quantization": "int8",
        "device": "cpu",
        "memory_declared_bytes": 4 << 30,
        "memory_free_bytes": 3 << 30,
        "kv_budget_tokens": 4096,
    }


@pytest.fixture
def tracker() -> Iterator[TestClient]:
    settings = TrackerSettings(models_dir=None, verify_nodes=False, operator_token="op")
    app = create_app(settings, node=None)
    with TestClient(app) as client:
        yield client


def metrics(client: TestClient) -> dict[tuple[str, frozenset], float]:
    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def test_page_is_self_contained_html(tracker):
    resp = tracker.get("/")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/html")
    html = resp.text
    assert '<script src="/static/dashboard.js"' in html
    assert 'href="/static/dashboard.css"' in html
    assert not re.search(r"""(src|href)=["']https?://""", html)  # no CDN: swarms run offline
    assert 'rel="icon" href="data:,"' in html  # no favicon request, so no 404 in the console
    js = tracker.get("/static/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "/v1/dashboard" in js.text and "innerHTML" not in js.text  # node data as text only
    css = tracker.get("/static/dashboard.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    missing = tracker.get("/static/../app.py")
    assert missing.status_code == 404
    assert tracker.get("/static/nothing.js").json()["error"]["type"] == "not_found_error"


def test_dashboard_json_counts_layers_and_shows_gaps(tracker):
    empty = tracker.get("/v1/dashboard").json()
    assert empty["models"] == [] and empty["nodes"] == []
    secrets = {}
    for node_id, start, end in (("head", 0, 3), ("middle", 2, 6)):
        resp = tracker.post("/v1/nodes/register", json=announcement(node_id, start, end))
        assert resp.status_code == 200, resp.text
        secrets[node_id] = resp.json()["node_secret"]
    proof = {"x-meshnet-node-secret": secrets["head"]}
    data = tracker.get("/v1/dashboard").json()
    assert data["tracker"]["heartbeat_interval_s"] == 2.0
    [model] = data["models"]
    assert model == {
        "id": MODEL,
        "num_layers": 8,
        "covered": False,
        "gaps": [[6, 8]],
        "layer_counts": [1, 1, 2, 1, 1, 1, 0, 0],
        "serving_nodes": 2,
    }
    head, middle = data["nodes"]
    assert (head["node_id"], middle["node_id"]) == ("head", "middle")
    assert head["shard_start"] == 0 and head["shard_end"] == 3
    assert head["quantization"] == "int8" and head["state"] == "serving"
    assert head["memory_declared_bytes"] == 4 << 30 and head["memory_free_bytes"] == 3 << 30
    assert head["kv_budget_tokens"] == 4096
    assert head["active_sessions"] == 0 and head["tokens_per_s"] == 0.0
    assert 0 <= head["last_heartbeat_s"] < 5 and head["local"] is False

    beat = {"node_id": "head", "state": "serving", "active_sessions": 3, "kv_tokens": 120,
            "memory_free_bytes": 1 << 30, "tokens_served": 10}  # fmt: skip
    assert tracker.post("/v1/nodes/heartbeat", json=beat, headers=proof).json()["known"] is True
    head = tracker.get("/v1/dashboard").json()["nodes"][0]
    assert (head["active_sessions"], head["kv_tokens"], head["memory_free_bytes"]) == (
        3, 120, 1 << 30,
    )  # fmt: skip
    operator = {"x-meshnet-operator-token": "op"}  # removing another node: the operator's call
    assert tracker.delete("/v1/nodes/middle", headers=operator).status_code == 200
    model = tracker.get("/v1/dashboard").json()["models"][0]
    assert model["gaps"] == [[3, 8]] and model["layer_counts"][3:] == [0] * 5


def test_each_node_shows_its_precision_dtype_and_group(tracker):
    """int4 names its group, a float32 compute dtype shows after a dot; an older node that
    announces no dtype reads as bfloat16 (float32 for a float32 shard)."""
    declared = {
        "a": {"quantization": "int4", "quant_group_size": 64},
        "b": {"quantization": "fp8"},
        "c": {"quantization": "int8", "dtype": "float32"},
        "d": {"quantization": "float32"},
        "e": {"quantization": "bfloat16"},
    }
    for i, (node_id, fields) in enumerate(declared.items()):
        body = announcement(node_id, i, i + 1) | fields
        assert tracker.post("/v1/nodes/register", json=body).status_code == 200
    nodes = {n["node_id"]: n for n in tracker.get("/v1/dashboard").json()["nodes"]}
    shown = {node_id: nodes[node_id]["precision"] for node_id in declared}
    assert shown == {"a": "int4 g64", "b": "fp8", "c": "int8 · float32", "d": "float32",
                     "e": "bfloat16"}  # fmt: skip
    assert nodes["d"]["dtype"] == "float32" and nodes["a"]["quant_group_size"] == 64
    js = tracker.get("/static/dashboard.js").text
    assert "node.precision" in js


def test_tokens_per_second_from_heartbeats():
    now = [100.0]
    registry = Registry(2.0, clock=lambda: now[0])
    registry.register(NodeAnnouncement.model_validate(announcement("n", 0, 8)))

    def beat(served: int) -> None:
        registry.heartbeat(Heartbeat(node_id="n", state=NodeState.SERVING, active_sessions=1,
                                     kv_tokens=0, memory_free_bytes=0, tokens_served=served))  # fmt: skip

    beat(500)  # the first heartbeat is the baseline: a node's count starts before joining
    assert registry.get("n").tokens_per_s == 0.0
    now[0] += 2.0
    beat(540)
    assert registry.get("n").tokens_per_s == pytest.approx(20.0)
    now[0] += 4.0
    beat(540)
    assert registry.get("n").tokens_per_s == 0.0
    now[0] += 2.0
    beat(3)  # the node restarted: its counter went back; no negative rate
    assert registry.get("n").tokens_per_s == 0.0


def test_metrics_request_ids_and_error_codes(tracker):
    resp = tracker.post("/v1/nodes/register", json=announcement("head", 0, 3))
    assert resp.headers["x-request-id"].startswith("req-")
    echoed = tracker.get("/health", headers={"x-request-id": "client-chosen.42"})
    assert echoed.headers["x-request-id"] == "client-chosen.42"
    odd = tracker.get("/health", headers={"x-request-id": "no spaces or <tags> please"})
    assert odd.headers["x-request-id"].startswith("req-")  # not echoed into logs verbatim

    before = metrics(tracker)
    body = {"model": "no/such-model", "prompt": "hi", "max_tokens": 1}
    assert tracker.post("/v1/completions", json=body).status_code == 404
    covered = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert tracker.post("/v1/completions", json=covered).status_code == 503  # layers [3, 8)
    after = metrics(tracker)

    def delta(name: str, **labels) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("meshnet_errors_total", status="404", code="model_not_found") == 1
    assert delta("meshnet_errors_total", status="503", code="model_not_covered") == 1
    assert delta("meshnet_requests_total", path="/v1/completions", status="404") == 1
    assert delta("meshnet_request_seconds_count", path="/v1/completions") == 2
    assert after[("meshnet_swarm_nodes", frozenset({("model", MODEL), ("state", "serving")}))] == 1
    assert after[("meshnet_swarm_uncovered_layers", frozenset({("model", MODEL)}))] == 5
    names = {name for name, _ in after}
    for name in ("meshnet_tokens_generated_total", "meshnet_prefill_seconds_count",
                 "meshnet_decode_step_seconds_count", "meshnet_wire_sent_bytes_total",
                 "meshnet_shard_downloads_served_total"):  # fmt: skip
        assert name in names


def test_dashboard_and_metrics_stay_open_behind_a_swarm_token():
    """Like /health and /v1/coverage they reveal no secret; internal routes still need it."""
    app = create_app(
        TrackerSettings(models_dir=None, swarm_token="s3cret", verify_nodes=False), node=None
    )
    with TestClient(app) as client:
        for path in ("/", "/v1/dashboard", "/metrics", "/static/dashboard.js"):
            assert client.get(path).status_code == 200, path
        refused = client.post("/v1/nodes/register", json=announcement("x", 0, 8))
        assert refused.status_code == 401
        samples = metrics(client)
        assert samples[
            ("meshnet_errors_total", frozenset({("status", "401"), ("code", "http_401")}))
        ]
        assert "s3cret" not in client.get("/metrics").text

"""Bounded admission (issue #35, docs/adr/0032): what a node says of itself is kept within
plausible figures and cross-checked, a TLS tracker admits https:// nodes only, and no route
or weight-source URL comes from a client's Host header. (The call-back's own bounds:
test_callback_bounds.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from meshnet_common.layers import LayerRange
from meshnet_common.protocol import MAX_MEMORY_BYTES, Heartbeat, NodeAnnouncement, NodeState
from meshnet_common.web.hosts import require_https, server_url
from meshnet_tracker.app import create_app
from meshnet_tracker.coverage import ServingNode
from meshnet_tracker.registry import LAYER_MS, LINK_MS, Registry
from meshnet_tracker.routing import MAX_SPEEDUP, StepEstimate
from meshnet_tracker.settings import TrackerSettings


def announcement(node_id: str, url: str, **extra) -> dict:
    return {
        "node_id": node_id, "url": url, "url_explicit": True, "state": "joining",
        "shard": {"model_id": "org/m", "shard_start": 0, "shard_end": 4}, "num_layers": 4,
        "quantization": "float32", "device": "cpu", "memory_declared_bytes": 1 << 30,
        "memory_free_bytes": 1 << 29, **extra,
    }  # fmt: skip


@pytest.fixture
def tracker() -> Iterator[TestClient]:
    with TestClient(create_app(TrackerSettings(models_dir=None), node=None)) as client:
        yield client


@pytest.mark.parametrize("field", ["memory_declared_bytes", "memory_free_bytes"])
def test_memory_beyond_any_machine_is_refused(tracker, field):
    body = announcement("n", "http://127.0.0.1:9000", **{field: MAX_MEMORY_BYTES + 1})
    resp = tracker.post("/v1/nodes/register", json=body)
    assert resp.status_code in (400, 422), resp.text
    ok = tracker.post("/v1/nodes/register", json=announcement("n", "http://127.0.0.1:9000"))
    assert ok.status_code == 200, ok.text


def test_heartbeat_figures_are_clamped_to_plausible_ranges():
    registry = Registry(2.0)
    registry.register(NodeAnnouncement(**announcement("n", "http://127.0.0.1:9000")), proof=None)
    beat = Heartbeat(node_id="n", state=NodeState.JOINING, active_sessions=0, kv_tokens=0,
                     memory_free_bytes=0, layer_ms=0.0,
                     links={"http://127.0.0.1:9001": 0.0, "http://127.0.0.1:9002": 1e6})  # fmt: skip
    assert registry.heartbeat(beat)
    record = registry.get("n")
    assert record.layer_ms == LAYER_MS[0]
    assert dict(record.links) == {"http://127.0.0.1:9001": LINK_MS[0],
                                  "http://127.0.0.1:9002": LINK_MS[1]}  # fmt: skip


def node(node_id: str, start: int, end: int, layer_ms=None, links=()) -> ServingNode:
    return ServingNode(node_id=node_id, url=f"http://{node_id}.test:8000", model_id="org/m",
                       layers=LayerRange(start, end), layer_ms=layer_ms, links=links)  # fmt: skip


def test_a_claimed_speed_counts_for_no_more_than_the_evidence():
    honest = [node("a", 0, 2, 1.0), node("b", 2, 4, 2.0), node("c", 2, 4, 1.0)]
    rogue = node("r", 2, 4, LAYER_MS[0])
    estimate = StepEstimate([*honest, rogue])
    assert estimate.compute_ms(rogue) == pytest.approx(1.0 / MAX_SPEEDUP)  # median 1.0
    assert estimate.compute_ms(honest[1]) == 2.0  # within the range: as measured


def test_a_link_counts_as_at_least_what_its_other_end_measured():
    head = node("h", 0, 2, 1.0, links=(("http://t.test:8000", LINK_MS[0]),))  # claims ~0
    tail = node("t", 2, 4, 1.0, links=(("http://h.test:8000", 12.0),))  # measured the way back
    other = node("o", 2, 4, 1.0)
    estimate = StepEstimate([head, tail, other])
    assert estimate.link_ms(head, tail) == 12.0
    assert estimate.link_ms(tail, head) == 12.0
    assert estimate.link_ms(head, other) == estimate.link_default  # nobody measured it


def test_a_tls_tracker_admits_https_nodes_only(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text(""), key.write_text("")  # never loaded in-process
    settings = TrackerSettings(models_dir=None, tls_cert=cert, tls_key=key)
    with TestClient(create_app(settings, node=None)) as client:
        plain = client.post("/v1/nodes/register", json=announcement("n", "http://127.0.0.1:9000"))
        assert plain.status_code == 400, plain.text
        error = plain.json()["error"]
        assert error["param"] == "url" and error["code"] == "insecure_url"
        assert "--tls-cert" in error["message"]
        secure = client.post("/v1/nodes/register", json=announcement("n", "https://127.0.0.1:9000"))
        assert secure.status_code == 200, secure.text


def test_require_https_only_when_serving_tls():
    require_https("http://127.0.0.1:1", "--tracker", tls=False)
    require_https(None, "--tracker")
    require_https("https://127.0.0.1:1", "--tracker")
    with pytest.raises(ValueError, match="--tracker http://127.0.0.1:1 is plain http"):
        require_https("http://127.0.0.1:1", "--tracker")


def test_the_servers_own_url_comes_from_its_socket_not_the_host_header():
    scope = {"scheme": "http", "server": ("192.168.1.4", 8080),
             "headers": [(b"host", b"evil.example:666")]}  # fmt: skip
    assert server_url(scope) == "http://192.168.1.4:8080"
    assert server_url({"scheme": "https", "server": ("::1", 8443)}) == "https://[::1]:8443"

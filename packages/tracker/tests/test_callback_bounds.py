"""The registration call-back is no port scanner (issue #35, docs/adr/0032): a URL is
``scheme://host[:port][/]`` only; the tracker calls it without the swarm token, reads a
bounded answer, and answers a closed port, an open port answering garbage or a flood, and
another node's port all alike. Real sockets on 127.0.0.1."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from answering_port import AnsweringPort, http_reply
from fastapi.testclient import TestClient
from swarm_harness import closed_port

from meshnet_tracker.api import admission
from meshnet_tracker.app import create_app
from meshnet_tracker.settings import TrackerSettings

TOKEN = {"x-meshnet-swarm-token": "swarm-1"}


def announcement(node_id: str, url: str) -> dict:
    return {
        "node_id": node_id, "url": url, "url_explicit": True,
        "shard": {"model_id": "org/m", "shard_start": 0, "shard_end": 4}, "num_layers": 4,
        "quantization": "float32", "device": "cpu", "memory_declared_bytes": 1 << 30,
        "memory_free_bytes": 1 << 29,
    }  # fmt: skip


@pytest.fixture
def ports() -> Iterator[dict[str, AnsweringPort]]:
    servers = {
        "garbage": AnsweringPort(http_reply(b"<html>not a node</html>")),
        "flood": AnsweringPort(http_reply(b'{"node_id": "' + b"x" * (8 << 20) + b'"}')),
        "other node": AnsweringPort(http_reply(b'{"node_id": "someone-else", "status": "ok"}')),
    }
    with contextlib.ExitStack() as stack:
        yield {kind: stack.enter_context(server) for kind, server in servers.items()}


@pytest.fixture
def tracker(monkeypatch) -> Iterator[TestClient]:
    monkeypatch.setattr(admission, "CALLBACK_BACKOFF_S", 0.0)
    settings = TrackerSettings(models_dir=None, swarm_token="swarm-1")  # verify_nodes: on
    with TestClient(create_app(settings, node=None)) as client:
        yield client


def test_probes_of_closed_and_open_ports_get_one_answer(tracker, ports):
    urls = {"closed": f"http://127.0.0.1:{closed_port()}", **{k: s.url for k, s in ports.items()}}
    answers = {}
    for kind, url in urls.items():
        resp = tracker.post("/v1/nodes/register", json=announcement("probe", url), headers=TOKEN)
        body = resp.json()
        body["error"]["message"] = body["error"]["message"].replace(url, "URL")
        answers[kind] = (resp.status_code, body)
    assert len({repr(a) for a in answers.values()}) == 1, answers
    status, body = answers["closed"]
    assert status == 400 and body["error"]["code"] == "node_unreachable"
    for server in ports.values():
        assert server.requests, "the tracker called the port back"
        assert all("x-meshnet-swarm-token" not in r for r in server.requests)  # no credential
    assert "probe" not in {n["node_id"] for n in tracker.get("/v1/dashboard").json()["nodes"]}


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:1?", "http://127.0.0.1:1/x", "http://127.0.0.1:1#f",
        "http://user@127.0.0.1:1", "http://127.0.0.1:1/?a=b", "ftp://127.0.0.1:21",
        "http://127.0.0.1:123456",
    ],
)  # fmt: skip
def test_registration_urls_are_scheme_host_and_port_only(tracker, url):
    resp = tracker.post("/v1/nodes/register", json=announcement("n", url), headers=TOKEN)
    assert resp.status_code in (400, 422), resp.text
    assert "url" in resp.json()["error"]["message"] + str(resp.json()["error"]["param"])

"""The tracker's HTTP API in-process: registration, coverage, routes and the OpenAI entry.

Registered nodes are made-up URLs; the one test that needs a real head proxies to an
in-process node app through ``httpx.ASGITransport`` (no sockets, no subprocesses).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from signed_evidence import evidence

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.runtime import build_runtime
from meshnet_node.runtime import create_app as create_node_app
from meshnet_node.settings import NodeSettings
from meshnet_tracker.app import create_app
from meshnet_tracker.settings import TrackerSettings

LLAMA = "meshnet-tiny/llama"  # 6 layers, in the models dir
ERROR_KEYS = {"message", "type", "param", "code"}


class AppsTransport(httpx.AsyncBaseTransport):
    """Sends each request to the in-process ASGI app registered for its host."""

    def __init__(self, apps: dict[str, FastAPI]) -> None:
        self._transports = {host: httpx.ASGITransport(app=app) for host, app in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        transport = self._transports.get(request.url.host)
        if transport is None:
            raise httpx.ConnectError(f"no app at {request.url.host}", request=request)
        return await transport.handle_async_request(request)


def assert_error(resp: httpx.Response, status: int, error_type: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_KEYS
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if error_type is not None:
        assert body["error"]["type"] == error_type
    return body["error"]


def announcement(
    node_id: str = "n1",
    start: int = 0,
    end: int = 6,
    *,
    num_layers: int = 6,
    model: str = LLAMA,
    url: str | None = None,
) -> dict:
    return {
        "version": 1,
        "node_id": node_id,
        "url": url or f"http://{node_id}.test:8000",
        "shard": {"model_id": model, "shard_start": start, "shard_end": end},
        "num_layers": num_layers,
        "quantization": "float32",
        "device": "cpu",
        "memory_declared_bytes": 1 << 30,
        "memory_free_bytes": 1 << 29,
        "state": "serving",
    }


@pytest.fixture(scope="module")
def llama_snapshot(tiny_snapshot) -> Path:
    return tiny_snapshot("llama")  # also makes sure the models dir holds it


@pytest.fixture
def tracker(models_dir, llama_snapshot) -> Iterator[TestClient]:
    settings = TrackerSettings(models_dir=models_dir, verify_nodes=False, operator_token="op")
    with TestClient(create_app(settings, node=None)) as client:
        yield client


OPERATOR = {"x-meshnet-operator-token": "op"}
_SECRETS: dict[tuple[int, str], str] = {}  # (tracker, node id) -> its node secret


def proof(tracker: TestClient, node_id: str) -> dict[str, str]:
    """The header proving ``node_id`` (docs/adr/0032), once it registered."""
    secret = _SECRETS.get((id(tracker), node_id))
    return {"x-meshnet-node-secret": secret} if secret else {}


def register(tracker: TestClient, **kwargs) -> httpx.Response:
    body = announcement(**kwargs)
    resp = tracker.post("/v1/nodes/register", json=body, headers=proof(tracker, body["node_id"]))
    assert resp.status_code == 200, resp.text
    _SECRETS[(id(tracker), body["node_id"])] = resp.json()["node_secret"]
    return resp


def heartbeat(tracker: TestClient, beat: dict) -> httpx.Response:
    headers = proof(tracker, beat["node_id"])
    return tracker.post("/v1/nodes/heartbeat", json=beat, headers=headers)


def llama_coverage(tracker: TestClient) -> dict:
    models = {m["id"]: m for m in tracker.get("/v1/coverage").json()["models"]}
    return models[LLAMA]


# -- registration and coverage -------------------------------------------------------------


def test_health(tracker):
    assert tracker.get("/health").json() == {"status": "ok", "nodes": 0}


def test_models_dir_models_are_known_but_uncovered(tracker):
    model = llama_coverage(tracker)
    assert model["num_layers"] == 6
    assert model["covered"] is False
    assert model["gaps"] == [[0, 6]]
    assert model["nodes"] == []


def test_register_shows_node_and_gaps(tracker):
    resp = register(tracker, node_id="head", start=0, end=3)
    secret = resp.json().pop("node_secret")
    assert resp.json() == {
        "node_id": "head",
        "heartbeat_interval_s": 2.0,
        "url": "http://head.test:8000",
        "node_secret": secret,
        "certificate": None,  # it announced no key (docs/adr/0032)
        "tracker_key": resp.json()["tracker_key"],
    }
    assert len(secret) >= 32
    model = llama_coverage(tracker)
    assert model["covered"] is False
    assert model["gaps"] == [[3, 6]]
    assert model["nodes"] == [
        {
            "node_id": "head",
            "url": "http://head.test:8000",
            "shard_start": 0,
            "shard_end": 3,
            "state": "serving",
            "quantization": "float32",
            "dtype": "float32",
            "quant_group_size": None,
        }
    ]
    register(tracker, node_id="tail", start=2, end=6)
    model = llama_coverage(tracker)
    assert model["covered"] is True and model["gaps"] == []
    assert [n["node_id"] for n in model["nodes"]] == ["head", "tail"]
    assert tracker.get("/health").json()["nodes"] == 2


def _mutate(**changes):
    body = announcement()
    for path, value in changes.items():
        target = body
        *parents, leaf = path.split("__")
        for key in parents:
            target = target[key]
        if value is DROP:
            del target[leaf]
        else:
            target[leaf] = value
    return body


DROP = object()
BAD_REGISTRATIONS = {
    "extra field": _mutate(extra="x"),
    "extra shard field": _mutate(shard__extra=1),
    "missing url": _mutate(url=DROP),
    "url not http": _mutate(url="ftp://n1.test:8000"),
    "url with a path": _mutate(url="http://n1.test:8000/v1/forward"),
    "url not a url": _mutate(url="not a url at all"),
    "url with a space": _mutate(url="http://n1 .test:8000"),
    "end equals start": _mutate(shard__shard_start=3, shard__shard_end=3),
    "end before start": _mutate(shard__shard_start=4, shard__shard_end=2),
    "negative start": _mutate(shard__shard_start=-1),
    "range beyond num_layers": _mutate(shard__shard_end=7),
    "range far beyond": _mutate(shard__shard_start=6, shard__shard_end=8),
    "model id without org": _mutate(shard__model_id="llama"),
    "model id with two slashes": _mutate(shard__model_id="a/b/c"),
    "model id with a space": _mutate(shard__model_id="org/my model"),
    "node id with a space": _mutate(node_id="my node"),
    "empty node id": _mutate(node_id=""),
    "node id too long": _mutate(node_id="n" * 65),
    "version 2": _mutate(version=2),
    "unknown quantization": _mutate(quantization="int3"),
    "unknown dtype": _mutate(dtype="float16"),
    "unknown group size": _mutate(quant_group_size=48),
    "auto is never announced": _mutate(quantization="auto"),
    "zero layers": _mutate(num_layers=0),
    "negative memory": _mutate(memory_free_bytes=-1),
    "unknown state": _mutate(state="sleeping"),
}


@pytest.mark.parametrize("body", BAD_REGISTRATIONS.values(), ids=BAD_REGISTRATIONS.keys())
def test_invalid_registration_is_400(tracker, body):
    assert_error(tracker.post("/v1/nodes/register", json=body), 400, "invalid_request_error")
    assert llama_coverage(tracker)["nodes"] == []


@pytest.mark.parametrize("model_id", ["../etc", "org/..", "./x", "org--x/name"])
def test_registration_with_a_model_id_the_models_dir_refuses_is_400(tracker, model_id):
    body = announcement(model=model_id)
    assert_error(tracker.post("/v1/nodes/register", json=body), 400, "invalid_request_error")


@pytest.mark.parametrize("raw", [b"{not json", b"[]", b"null", b"\xff", b""])
def test_unparseable_registration_is_400(tracker, raw):
    resp = tracker.post(
        "/v1/nodes/register", content=raw, headers={"content-type": "application/json"}
    )
    assert_error(resp, 400)


def test_oversized_registration_is_413(tracker):
    body = json.dumps(announcement()) + " " * (64 * 1024)
    resp = tracker.post(
        "/v1/nodes/register", content=body, headers={"content-type": "application/json"}
    )
    assert_error(resp, 413)


def test_registration_disagreeing_with_the_known_layer_count_is_400(tracker):
    resp = tracker.post("/v1/nodes/register", json=announcement(start=6, end=12, num_layers=12))
    assert_error(resp, 400)


def test_heartbeat(tracker):
    beat = {
        "node_id": "ghost",
        "state": "serving",
        "active_sessions": 0,
        "kv_tokens": 0,
        "memory_free_bytes": 1,
    }
    resp = heartbeat(tracker, beat)
    assert resp.status_code == 200
    assert resp.json() == {
        "known": False, "directives": [], "probe": [], "quarantined": None, "certificate": None,
        "revoked": [],
    }  # fmt: skip
    register(tracker, node_id="ghost")
    assert heartbeat(tracker, beat).json()["known"] is True
    assert_error(heartbeat(tracker, {**beat, "active_sessions": -1}), 400)
    assert_error(heartbeat(tracker, {**beat, "bogus": 1}), 400)


def test_delete_node(tracker):
    register(tracker, node_id="gone")
    resp = tracker.delete("/v1/nodes/gone", headers=proof(tracker, "gone"))  # it leaves
    assert resp.status_code == 200 and resp.json() == {"removed": "gone"}
    assert llama_coverage(tracker)["nodes"] == []
    assert_error(tracker.delete("/v1/nodes/gone"), 404, "not_found_error")


# -- routes and models ---------------------------------------------------------------------


def test_route_with_gaps_is_503_naming_them(tracker):
    error = assert_error(tracker.get("/v1/route", params={"model": LLAMA}), 503)
    assert "[0, 6)" in error["message"]
    register(tracker, node_id="a", start=0, end=2)
    register(tracker, node_id="b", start=4, end=5)
    error = assert_error(tracker.get("/v1/route", params={"model": LLAMA}), 503)
    assert error["code"] == "model_not_covered"
    assert "[2, 4), [5, 6)" in error["message"]


def test_route_unknown_model_is_404(tracker):
    error = assert_error(tracker.get("/v1/route", params={"model": "org/nope"}), 404)
    assert error["code"] == "model_not_found"
    assert_error(tracker.get("/v1/route"), 400)  # model is required


def test_route_over_overlapping_nodes(tracker):
    register(tracker, node_id="a", start=0, end=4)
    register(tracker, node_id="b", start=2, end=6)
    body = tracker.get("/v1/route", params={"model": LLAMA}).json()
    assert body["model_id"] == LLAMA
    assert body["hops"] == [
        {"node_id": "a", "url": "http://a.test:8000", "shard_start": 0, "shard_end": 4},
        {"node_id": "b", "url": "http://b.test:8000", "shard_start": 4, "shard_end": 6},
    ]
    register(tracker, node_id="c", start=0, end=2)
    hops = tracker.get("/v1/route", params={"model": LLAMA, "head": "c"}).json()["hops"]
    assert [(h["node_id"], h["shard_start"]) for h in hops] == [("c", 0), ("b", 2)]
    resp = tracker.get("/v1/route", params={"model": LLAMA, "head": "b"})
    assert_error(resp, 503)


def test_heartbeats_name_the_links_to_time_and_their_times_steer_routes(tracker):
    """A node is told which next hops to time; the round trips and compute it reports make
    the tracker route around a slow link (docs/adr/0021)."""
    register(tracker, node_id="a", start=0, end=3)
    register(tracker, node_id="b", start=3, end=6)
    register(tracker, node_id="c", start=2, end=6)
    beat = {"state": "serving", "active_sessions": 0, "kv_tokens": 0, "memory_free_bytes": 1}
    reply = heartbeat(tracker, {**beat, "node_id": "a"}).json()
    assert reply["probe"] == ["http://b.test:8000", "http://c.test:8000"]
    assert heartbeat(tracker, {**beat, "node_id": "b"}).json()["probe"] == []

    def route() -> list[str]:
        hops = tracker.get("/v1/route", params={"model": LLAMA, "head": "a"}).json()["hops"]
        return [h["node_id"] for h in hops]

    assert route() == ["a", "b"]  # nothing measured: ids break the tie
    links = {"http://b.test:8000": 40.0, "http://c.test:8000": 3.0}
    timed = {**beat, "node_id": "a", "layer_ms": 1.5, "links": links}
    assert heartbeat(tracker, timed).status_code == 200
    assert route() == ["a", "c"]
    bad = {**timed, "links": {"http://b.test:8000": -1.0}}
    assert_error(heartbeat(tracker, bad), 400)
    too_many = {**timed, "links": {f"http://n{i}.test:1": 1.0 for i in range(17)}}
    assert_error(heartbeat(tracker, too_many), 400)


def test_models_lists_only_covered_models(tracker):
    assert tracker.get("/v1/models").json() == {"object": "list", "data": []}
    register(tracker, node_id="a", start=0, end=3)
    register(tracker, node_id="x", start=0, end=1, num_layers=2, model="org/partial")
    assert tracker.get("/v1/models").json()["data"] == []
    register(tracker, node_id="b", start=3, end=6)
    data = tracker.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [LLAMA]
    assert data[0]["object"] == "model"
    assert data[0]["meshnet"] == {"num_layers": 6, "nodes": 2}


# -- the OpenAI entry point ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_entry_for_uncovered_model_is_503_naming_the_gap(tracker, path):
    body = {"model": LLAMA, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(tracker.post(path, json=body), 503, "service_unavailable")
    assert "[0, 6)" in error["message"]
    register(tracker, node_id="a", start=0, end=3)
    error = assert_error(tracker.post(path, json=body), 503)
    assert "[3, 6)" in error["message"]
    assert LLAMA in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_entry_errors(tracker, path):
    error = assert_error(tracker.post(path, json={"model": "org/nope", "prompt": "hi"}), 404)
    assert error["param"] == "model"
    for raw in (b"{not json", b"\xff\xfe", b""):
        resp = tracker.post(path, content=raw, headers={"content-type": "application/json"})
        assert_error(resp, 400, "invalid_request_error")
    assert_error(tracker.post(path, json=[1, 2]), 400)  # not a JSON object
    for body in ({"prompt": "hi"}, {"model": 5, "prompt": "hi"}):
        error = assert_error(tracker.post(path, json=body), 400)
        assert error["param"] == "model"


def test_unknown_path_is_404_in_error_shape(tracker):
    assert_error(tracker.get("/v1/nothing"), 404, "not_found_error")
    assert_error(tracker.get("/v1/forward"), 404)  # no node mounted: no data path


def test_unreachable_head_is_502(tracker):
    register(tracker, node_id="far", start=0, end=6)
    state = tracker.app.state.tracker
    state.client = state.callback = httpx.AsyncClient(
        transport=AppsTransport({})
    )  # nothing answers
    resp = tracker.post("/v1/completions", json={"model": LLAMA, "prompt": "hi"})
    assert assert_error(resp, 502)["code"] == "hop_failed"


@pytest.fixture(scope="module")
def whole_node(llama_snapshot) -> Iterator[FastAPI]:
    """An in-process node serving all of llama: the head the tracker proxies to."""

    async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
        raise AssertionError("the tracker must send the route")

    settings = NodeSettings(
        model_id=LLAMA,
        model_path=llama_snapshot,
        layers=LayerRange(0, 6),
        quantization=Precision.FLOAT32,
    )
    app = create_node_app(build_runtime(settings, route_provider=no_route))
    with TestClient(app) as client:
        yield client


def test_covered_model_is_proxied_to_the_head(tracker, whole_node):
    register(tracker, node_id="node", start=0, end=6)
    state = tracker.app.state.tracker
    unused = state.client
    state.client = state.callback = httpx.AsyncClient(
        transport=AppsTransport({"node.test": whole_node.app})
    )
    asyncio.run(unused.aclose())
    request = {"model": LLAMA, "prompt": "The capital", "max_tokens": 5, "temperature": 0}
    request["ignore_eos"] = True
    via_tracker = tracker.post("/v1/completions", json=request)
    assert via_tracker.status_code == 200, via_tracker.text
    direct = whole_node.post("/v1/completions", json=request, headers={"x-meshnet-route": ""})
    assert via_tracker.json()["choices"] == direct.json()["choices"]
    assert via_tracker.json()["usage"]["completion_tokens"] == 5
    # Streaming passes through and still ends with [DONE].
    stream = tracker.post("/v1/completions", json={**request, "stream": True})
    assert stream.status_code == 200
    assert stream.text.rstrip("\n").endswith("data: [DONE]")
    # Errors from the head come back with their status and body.
    resp = tracker.post("/v1/completions", json={**request, "temperature": 9})
    assert assert_error(resp, 400)["param"] == "temperature"


# -- admission: the tracker calls a registering node back ----------------------------------


def test_registration_is_confirmed_by_calling_the_node_back(models_dir, llama_snapshot, whole_node):
    app = create_app(TrackerSettings(models_dir=models_dir), node=None)  # verify_nodes: on
    with TestClient(app) as tracker:
        state = tracker.app.state.tracker
        state.client = state.callback = httpx.AsyncClient(
            transport=AppsTransport({"node.test": whole_node.app})
        )
        node_id = whole_node.app.state.runtime.node_id
        body = announcement(node_id=node_id, url="http://node.test:8000")
        ok = tracker.post("/v1/nodes/register", json=body)
        assert ok.status_code == 200, ok.text
        assert ok.json()["url"] == "http://node.test:8000"
        # Another process answers at the address: not this node, so it is refused.
        impostor = announcement(node_id="impostor", url="http://node.test:8000")
        error = assert_error(tracker.post("/v1/nodes/register", json=impostor), 400)
        assert (
            error["code"] == "node_unreachable" and "cannot reach node impostor" in error["message"]
        )
        # Nothing answers: refused with the flag to fix it, and never put on the map.
        far = announcement(node_id="far", start=0, end=3)
        error = assert_error(tracker.post("/v1/nodes/register", json=far), 400)
        assert error["code"] == "node_unreachable" and "--advertise-url" in error["message"]
        # A node still loading is not called back: it is on the map as joining, not routed.
        loading = {**announcement(node_id="loading", start=0, end=3), "state": "joining"}
        assert tracker.post("/v1/nodes/register", json=loading).status_code == 200
        nodes = {n["node_id"]: n["state"] for n in llama_coverage(tracker)["nodes"]}
        assert nodes == {node_id: "serving", "loading": "joining"}
        route = tracker.get("/v1/route", params={"model": LLAMA}).json()
        assert [h["node_id"] for h in route["hops"]] == [node_id]


# -- coverage expected back (docs/adr/0023) ------------------------------------------------


def test_a_gap_a_loading_node_will_fill_is_coverage_pending(tracker):
    register(tracker, node_id="a", start=0, end=3)
    error = assert_error(tracker.get("/v1/route", params={"model": LLAMA}), 503)
    assert error["code"] == "model_not_covered"  # nothing on its way: fail at once
    loading = {**announcement(node_id="b", start=3, end=6), "state": "joining"}
    assert tracker.post("/v1/nodes/register", json=loading).status_code == 200
    error = assert_error(tracker.get("/v1/route", params={"model": LLAMA}), 503)
    assert error["code"] == "coverage_pending" and "[3, 6)" in error["message"]


def test_a_node_the_head_failed_on_that_is_still_on_the_map_is_coverage_pending(tracker):
    register(tracker, node_id="a", start=0, end=3)
    register(tracker, node_id="b", start=3, end=6)
    params = {"model": LLAMA, "head": "a", "exclude": "http://b.test:8000"}
    error = assert_error(tracker.get("/v1/route", params=params), 503)
    assert error["code"] == "coverage_pending"  # it may be restarting: worth a wait
    tracker.delete(
        "/v1/nodes/b", headers=proof(tracker, "b")
    )  # gone for good (deregistered or expired): no prospect
    error = assert_error(tracker.get("/v1/route", params=params), 503)
    assert error["code"] == "model_not_covered"


def test_the_openai_entry_waits_for_coverage_then_fails_naming_the_gap(models_dir, llama_snapshot):
    settings = TrackerSettings(models_dir=models_dir, verify_nodes=False, coverage_wait_s=1.2)
    with TestClient(create_app(settings, node=None)) as tracker:
        register(tracker, node_id="a", start=0, end=3)
        loading = {**announcement(node_id="b", start=3, end=6), "state": "joining"}
        tracker.post("/v1/nodes/register", json=loading)
        started = time.monotonic()
        body = {"model": LLAMA, "prompt": "hi"}
        error = assert_error(tracker.post("/v1/completions", json=body), 503)
        waited = time.monotonic() - started
    assert 0.9 <= waited < 5 and "waited" in error["message"] and "[3, 6)" in error["message"]


def test_repeated_verdicts_quarantine_a_node_until_lifted(tracker):
    """docs/adr/0026: verdicts from heads' audits; the map, the heartbeat and the dashboard.
    docs/adr/0032: each from an authenticated reporter, counted once per reporter."""
    for node_id in ("honest", "faulty", "head", "head2"):
        register(tracker, node_id=node_id)
    verdict = {"model_id": LLAMA, "reporter": "head", "shard_start": 0, "shard_end": 6,
               "error": 0.7, "tolerance": 3.5e-4, "witnesses": ["honest"]}  # fmt: skip
    beat = {"node_id": "faulty", "state": "serving", "active_sessions": 0, "kv_tokens": 0,
            "memory_free_bytes": 1}  # fmt: skip

    def serving() -> set[str]:
        models = tracker.get("/v1/coverage").json()["models"]
        return {n["node_id"] for m in models for n in m["nodes"] if n["state"] == "serving"}

    secret = tracker.app.state.tracker.registry.secret_of("faulty")

    def report(reporter: str, **changes) -> httpx.Response:
        body = {**verdict, "reporter": reporter, "evidence": evidence(secret, "faulty"), **changes}
        return tracker.post(
            "/v1/nodes/faulty/verdicts", json=body, headers=proof(tracker, reporter)
        )

    first = report("head")
    assert first.json() == {"strikes": 1, "quarantined": False}
    assert {"honest", "faulty"} <= serving()  # one verdict may be a fluke
    assert report("head").json() == {"strikes": 1, "quarantined": False}  # same reporter: once
    second = report("head2")
    assert second.json() == {"strikes": 2, "quarantined": True}
    assert "faulty" not in serving() and "honest" in serving()
    reason = heartbeat(tracker, beat).json()["quarantined"]
    assert "2 verdicts" in reason and "honest" in reason
    shown = {n["node_id"]: n for n in tracker.get("/v1/dashboard").json()["nodes"]}
    assert shown["faulty"]["state"] == "quarantined" and shown["faulty"]["quarantined"] == reason
    register(tracker, node_id="faulty")  # re-registering does not end it
    assert "faulty" not in serving()

    assert_error(
        tracker.post("/v1/nodes/ghost/verdicts", json=verdict, headers=proof(tracker, "head")), 404
    )
    assert_error(report("head", error=-1), 400)
    # Only the operator lifts it: not the node itself, not a swarm member.
    assert_error(
        tracker.delete("/v1/nodes/faulty/quarantine", headers=proof(tracker, "faulty")), 401
    )
    assert tracker.delete("/v1/nodes/faulty/quarantine", headers=OPERATOR).status_code == 200
    assert "faulty" in serving()
    assert heartbeat(tracker, beat).json()["quarantined"] is None
    assert_error(tracker.delete("/v1/nodes/faulty/quarantine", headers=OPERATOR), 404)

"""Claimed compute cross-checked against measured step times (issue #35 item 5,
docs/adr/0032): heads report the wall time of the decode steps of each route they used;
the tracker holds it against what the route's nodes claim and counts a node's compute as
claimed times its measured slowdown. Pure estimator tests over made-up swarms, then the
tracker in-process through real heartbeats."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from meshnet_common.layers import LayerRange
from meshnet_common.protocol import MAX_ROUTE_TIME_HOPS, MAX_ROUTE_TIMES
from meshnet_tracker.app import create_app
from meshnet_tracker.coverage import ModelCoverage, ServingNode
from meshnet_tracker.routing import (
    MAX_SLOWDOWN,
    RouteReport,
    StepEstimate,
    choose_route,
    measured_slowdowns,
    with_slowdowns,
)
from meshnet_tracker.settings import TrackerSettings
from meshnet_tracker.state import EXPLORE_AFTER_S, EXPLORE_EVERY

MODEL = "org/measured"
LAYERS = 8
LINK_MS = 1.0
OVERHEAD_MS = 1.0  # what every step pays beyond compute and links (HTTP, sampling)


def url(node_id: str) -> str:
    return f"http://{node_id}.test:8000"


def node(node_id: str, start: int, end: int, layer_ms: float) -> ServingNode:
    links = ((url("liar"), LINK_MS), (url("honest"), LINK_MS)) if start == 0 else ()
    return ServingNode(node_id=node_id, url=url(node_id), model_id=MODEL,
                       layers=LayerRange(start, end), layer_ms=layer_ms, links=links)  # fmt: skip


# Real decode compute per layer; the liar claims 1/30 of its own.
REAL = {"h1": 1.0, "h2": 1.0, "h3": 1.0, "honest": 1.0, "liar": 1.5}


def swarm() -> ModelCoverage:
    nodes = [node(h, 0, 4, REAL[h]) for h in ("h1", "h2", "h3")]
    nodes += [node("honest", 4, 8, 1.0), node("liar", 4, 8, REAL["liar"] / 30)]
    return ModelCoverage(MODEL, LAYERS, tuple(nodes))


def measured(reporter: str, *hops: str, real: dict[str, float] = REAL) -> RouteReport:
    """What ``reporter`` measures of the route through ``hops`` (ranges of 4 layers each)."""
    route = (reporter, *hops)
    step = sum(real[n] * 4 for n in route) + LINK_MS * len(hops) + OVERHEAD_MS
    return RouteReport(reporter, route, step)


def route_of(model: ModelCoverage, head: str) -> list[str]:
    return [hop.node.node_id for hop in choose_route(model, head=head)]


def test_a_liar_is_measured_about_30x_slow_and_loses_its_routes_to_an_honest_replica():
    model = swarm()
    assert route_of(model, "h1") == ["h1", "liar"]  # its claim attracts the route
    reports = [measured("h1", "liar"), measured("h2", "honest"), measured("h3", "honest")]
    slowdowns = measured_slowdowns(model, reports)
    assert slowdowns["liar"] == pytest.approx(30, rel=0.1)
    assert set(slowdowns) == {"liar", "h1"}  # h1 measured only the liar's route: see below
    checked = with_slowdowns(model, slowdowns)
    assert route_of(checked, "h1") == ["h1", "honest"]
    liar = next(n for n in checked.nodes if n.node_id == "liar")
    assert StepEstimate(checked.serving).compute_ms(liar) == pytest.approx(1.5, rel=0.1)
    assert StepEstimate(checked.serving, as_claimed=True).compute_ms(liar) == 0.05


def test_an_honest_node_on_the_liars_route_is_not_penalised_when_another_is_normal():
    model = swarm()
    reports = [measured("h1", "liar"), measured("h1", "honest"), measured("h2", "honest")]
    slowdowns = measured_slowdowns(model, reports)
    assert set(slowdowns) == {"liar"}
    assert slowdowns["liar"] == pytest.approx(30, rel=0.1)


def test_a_middle_node_sharing_the_liars_route_is_cleared_by_another_heads_route():
    """Three stages of 3 layers: the middle node is on the liar's route and on a normal one;
    the head that used only the liar's route is penalised until it measures another."""
    nodes = (
        ServingNode("h1", url("h1"), MODEL, LayerRange(0, 3), layer_ms=1.0),
        ServingNode("h2", url("h2"), MODEL, LayerRange(0, 3), layer_ms=1.0),
        ServingNode("mid", url("mid"), MODEL, LayerRange(3, 6), layer_ms=1.0),
        ServingNode("honest", url("honest"), MODEL, LayerRange(6, 9), layer_ms=1.0),
        ServingNode("liar", url("liar"), MODEL, LayerRange(6, 9), layer_ms=2.0 / 30),
    )
    model = ModelCoverage(MODEL, 9, nodes)
    links_ms = 2 * 1.0  # nobody measured a link: 1 ms each
    reports = [
        RouteReport("h1", ("h1", "mid", "liar"), 3 + 3 + 3 * 2.0 + links_ms + OVERHEAD_MS),
        RouteReport("h2", ("h2", "mid", "honest"), 3 + 3 + 3 + links_ms + OVERHEAD_MS),
    ]
    slowdowns = measured_slowdowns(model, reports)
    assert set(slowdowns) == {"liar", "h1"}
    assert slowdowns["liar"] == pytest.approx(30, rel=0.1)


def test_one_slanderous_reporter_cannot_penalise_a_node_others_see_as_normal():
    model = swarm()
    honest = [measured("h2", "honest"), measured("h3", "honest")]
    slander = RouteReport("h1", ("h1", "honest"), 100 * measured("h1", "honest").step_ms)
    slowdowns = measured_slowdowns(model, [*honest, slander])
    assert "honest" not in slowdowns
    assert set(slowdowns) == {"h1"}  # the slanderer's own route counts against itself only
    # A route that does not chain the model's layers over serving nodes is ignored.
    bogus = [RouteReport("h1", ("h1",), 1e4), RouteReport("h1", ("h1", "h2"), 1e4),
             RouteReport("h1", ("h1", "gone"), 1e4), RouteReport("h1", ("honest",), 1e4)]  # fmt: skip
    assert measured_slowdowns(model, [*honest, *bogus]) == {}


def test_a_head_does_not_vouch_for_itself_against_others():
    """A lying head entered mid-route by another head: its own fast report does not clear
    what the other head measured."""
    nodes = (
        ServingNode("g", url("g"), MODEL, LayerRange(0, 1), layer_ms=1.0),
        ServingNode("bad", url("bad"), MODEL, LayerRange(0, 6), layer_ms=0.05),  # real 1.5
        ServingNode("h", url("h"), MODEL, LayerRange(0, 6), layer_ms=1.0),
        ServingNode("h2", url("h2"), MODEL, LayerRange(0, 6), layer_ms=1.0),
        ServingNode("t", url("t"), MODEL, LayerRange(6, 8), layer_ms=1.0),
    )
    model = ModelCoverage(MODEL, LAYERS, nodes)
    reports = [
        RouteReport("g", ("g", "bad", "t"), 1 + 5 * 1.5 + 2 + 2 + OVERHEAD_MS),
        RouteReport("h", ("h", "t"), 8 + 1 + OVERHEAD_MS),
        RouteReport("h2", ("h2", "t"), 8 + 1 + OVERHEAD_MS),
        RouteReport("bad", ("bad", "t"), 6 * 0.05 + 2 + 1),  # it says its steps are fast
    ]
    assert measured_slowdowns(model, reports)["bad"] == pytest.approx(30, rel=0.1)


def test_no_reports_no_slowdowns():
    model = swarm()
    assert measured_slowdowns(model, []) == {}
    assert with_slowdowns(model, {}) is model
    fair = [measured("h1", "honest"), measured("h2", "honest"), measured("h3", "liar",
            real={**REAL, "liar": 0.05})]  # fmt: skip
    assert measured_slowdowns(model, fair) == {}  # a fast node that is fast is believed


IDS = ("h1", "h2", "h3", "honest", "liar", "gone")


@given(st.lists(st.tuples(st.sampled_from(IDS), st.lists(st.sampled_from(IDS), max_size=3),
                          st.floats(1e-3, 6e4)), max_size=12))  # fmt: skip
def test_any_reports_give_slowdowns_of_serving_nodes_within_bounds(reports):
    model = swarm()
    found = [RouteReport(reporter, (reporter, *hops), ms) for reporter, hops, ms in reports]
    slowdowns = measured_slowdowns(model, found)
    assert set(slowdowns) <= {n.node_id for n in model.serving}
    assert all(1 < s <= MAX_SLOWDOWN for s in slowdowns.values())
    # Whatever h1 (or anyone not a head) reports, a node two other heads measured as
    # claimed stays clear.
    others = [r for r in found if r.reporter not in ("h2", "h3")]
    normal = [measured("h2", "honest"), measured("h3", "honest")]
    assert "honest" not in measured_slowdowns(model, [*others, *normal])


# -- the tracker, through real heartbeats ---------------------------------------------------

SECRET = "x-meshnet-node-secret"


class Swarm:
    """A tracker in-process and the secrets its nodes were issued."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.secrets: dict[str, str] = {}

    def register(self, node_id: str, start: int, end: int) -> None:
        body = {
            "node_id": node_id, "url": url(node_id), "url_explicit": True,
            "shard": {"model_id": MODEL, "shard_start": start, "shard_end": end},
            "num_layers": LAYERS, "quantization": "float32", "device": "cpu",
            "memory_declared_bytes": 1 << 30, "memory_free_bytes": 1 << 29,
        }  # fmt: skip
        resp = self.client.post("/v1/nodes/register", json=body)
        assert resp.status_code == 200, resp.text
        self.secrets[node_id] = resp.json()["node_secret"]

    def beat(self, node_id: str, *, signed: bool = True, **fields):
        body = {"node_id": node_id, "state": "serving", "active_sessions": 0, "kv_tokens": 0,
                "memory_free_bytes": 1, **fields}  # fmt: skip
        headers = {SECRET: self.secrets[node_id]} if signed else {}
        return self.client.post("/v1/nodes/heartbeat", json=body, headers=headers)

    def route(self, head: str) -> list[str]:
        resp = self.client.get("/v1/route", params={"model": MODEL, "head": head})
        assert resp.status_code == 200, resp.text
        return [h["node_id"] for h in resp.json()["hops"]]

    def slowdowns(self) -> dict[str, float]:
        nodes = self.client.get("/v1/dashboard").json()["nodes"]
        return {n["node_id"]: n["slowdown"] for n in nodes if n["slowdown"] != 1}


@pytest.fixture
def tracker() -> Iterator[Swarm]:
    settings = TrackerSettings(models_dir=None, verify_nodes=False)
    with TestClient(create_app(settings, node=None)) as client:
        yield Swarm(client)


def route_time(*hops: str, step_ms: float) -> dict:
    return {"hops": [url(h) for h in hops], "step_ms": step_ms}


def test_heartbeats_report_route_times_and_a_liar_loses_its_routes(tracker):
    for head in ("h1", "h2", "h3"):
        tracker.register(head, 0, 4)
    tracker.register("honest", 4, 8)
    tracker.register("liar", 4, 8)
    links = {url("honest"): LINK_MS, url("liar"): LINK_MS}
    for head in ("h1", "h2", "h3"):
        assert tracker.beat(head, layer_ms=1.0, links=links).status_code == 200
    assert tracker.beat("honest", layer_ms=1.0).status_code == 200
    assert tracker.beat("liar", layer_ms=0.05).status_code == 200  # real: 1.5
    assert tracker.route("h1") == ["h1", "liar"]

    normal = measured("h2", "honest").step_ms
    slow = measured("h1", "liar").step_ms
    # Not signed with h2's secret: refused, and it counts for nothing.
    forged = tracker.beat("h2", signed=False, route_times=[route_time("honest", step_ms=1e4)])
    assert forged.status_code == 401
    for head, hop, ms in (("h1", "liar", slow), ("h2", "honest", normal),
                          ("h3", "honest", normal)):  # fmt: skip
        assert tracker.beat(head, route_times=[route_time(hop, step_ms=ms)]).status_code == 200
    slowdowns = tracker.slowdowns()
    assert slowdowns["liar"] == pytest.approx(30, rel=0.1) and "honest" not in slowdowns
    assert tracker.route("h1") == ["h1", "honest"]  # hysteresis or not: clearly faster

    # h1's latest report of a route replaces its previous one: a fast liar is no liar.
    fixed = measured("h1", "liar", real={**REAL, "liar": 0.05}).step_ms
    assert tracker.beat("h1", route_times=[route_time("liar", step_ms=fixed)]).status_code == 200
    assert "liar" not in tracker.slowdowns()


def test_route_time_bounds_are_refused_with_4xx(tracker):
    tracker.register("h1", 0, 4)
    long_host = "a" * 279  # a URL of 300 characters, the most the protocol takes

    def hops(n: int, i: int = 0) -> list[str]:
        return [f"http://{long_host}{i:02d}{j:02d}.test:8000" for j in range(n)]

    fullest = [{"hops": hops(MAX_ROUTE_TIME_HOPS, i), "step_ms": 5.0} for i in range(16)]
    assert len(fullest[0]["hops"][0]) == 300 and len(fullest) == MAX_ROUTE_TIMES
    assert tracker.beat("h1", route_times=fullest).status_code == 200  # fits the body limit
    refused = [
        [{"hops": [url("a")], "step_ms": 5.0}] * (MAX_ROUTE_TIMES + 1),
        [{"hops": hops(MAX_ROUTE_TIME_HOPS + 1), "step_ms": 5.0}],
        [{"hops": [], "step_ms": 5.0}],
        [{"hops": [url("a")], "step_ms": 0}],
        [{"hops": [url("a")], "step_ms": -1.0}],
        [{"hops": [url("a")], "step_ms": 60_001.0}],
        [{"hops": ["http://a.test/path"], "step_ms": 5.0}],
        [{"hops": [url("a")], "step_ms": 5.0, "steps": 3}],
        [{"hops": [url("a")]}],
    ]
    for route_times in refused:
        resp = tracker.beat("h1", route_times=route_times)
        assert 400 <= resp.status_code < 500, (route_times, resp.text)


def test_with_one_head_a_route_around_the_liar_is_tried_and_then_measured(tracker):
    tracker.register("h1", 0, 4)
    tracker.register("honest", 4, 8)
    tracker.register("liar", 4, 8)
    links = {url("honest"): LINK_MS, url("liar"): LINK_MS}
    assert tracker.beat("h1", layer_ms=1.0, links=links).status_code == 200
    assert tracker.beat("honest", layer_ms=1.0).status_code == 200
    assert tracker.beat("liar", layer_ms=0.05).status_code == 200  # real: 1.5
    # Every route goes through the liar: at first (a replica just joined) always, later one
    # in EXPLORE_EVERY tries the replica no head has timed yet, so that the liar has
    # something to be compared with.
    assert [tracker.route("h1") for _ in range(EXPLORE_EVERY)] == [["h1", "liar"]] * 8
    registry = tracker.client.app.state.tracker.registry
    for node_id in ("h1", "honest", "liar"):  # as if they joined a while ago
        registry.get(node_id).since -= EXPLORE_AFTER_S + 1
    routes = [tracker.route("h1") for _ in range(EXPLORE_EVERY)]
    assert routes[:-1] == [["h1", "liar"]] * (EXPLORE_EVERY - 1)
    assert routes[-1] == ["h1", "honest"]
    slow, normal = measured("h1", "liar").step_ms, measured("h1", "honest").step_ms
    times = [route_time("liar", step_ms=slow), route_time("honest", step_ms=normal)]
    assert tracker.beat("h1", route_times=times).status_code == 200
    assert tracker.slowdowns()["liar"] == pytest.approx(30, rel=0.1)
    # both measured now: no more detours, and the routes keep to the honest replica
    assert [tracker.route("h1") for _ in range(EXPLORE_EVERY)] == [["h1", "honest"]] * 8

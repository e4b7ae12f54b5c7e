"""Trust against a member (docs/adr/0032): per-node secrets, takeovers refused, verdicts
from authenticated reporters counted once, never against the only replica, quarantine kept
across ids at one address and lifted by the operator only. In-process, no sockets."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from signed_evidence import MODEL, announcement, evidence

from meshnet_common.protocol import NodeAnnouncement
from meshnet_tracker.app import create_app
from meshnet_tracker.registry import MISSED_HEARTBEATS, Registry
from meshnet_tracker.settings import TrackerSettings

SECRET = "x-meshnet-node-secret"
OPERATOR = {"x-meshnet-operator-token": "op-7"}
ERROR_KEYS = {"message", "type", "param", "code"}


def beat(node_id: str, **changes) -> dict:
    return {"node_id": node_id, "state": "serving", "active_sessions": 0, "kv_tokens": 0,
            "memory_free_bytes": 1, **changes}  # fmt: skip


def verdict(reporter: str, **changes) -> dict:
    return {"model_id": MODEL, "reporter": reporter, "shard_start": 0, "shard_end": 4,
            "error": 0.7, "tolerance": 3.5e-4, "witnesses": ["honest"], **changes}  # fmt: skip


def error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert set(resp.json()) == {"error"} and set(resp.json()["error"]) == ERROR_KEYS
    return resp.json()["error"]


class Swarm:
    """A tracker in-process and the secrets its nodes were issued."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.secrets: dict[str, str] = {}

    def register(self, node_id: str, *args, **changes) -> httpx.Response:
        body = announcement(node_id, *args, **changes)
        resp = self.client.post("/v1/nodes/register", json=body, headers=self.proof(node_id))
        if resp.status_code == 200:
            self.secrets[node_id] = resp.json()["node_secret"]
        return resp

    def proof(self, node_id: str) -> dict[str, str]:
        return {SECRET: self.secrets[node_id]} if node_id in self.secrets else {}

    def report(self, suspect: str, reporter: str, **changes) -> httpx.Response:
        """A verdict with evidence the suspect signed (``evidence=None``: without)."""
        if "evidence" not in changes and suspect in self.secrets:
            start = changes.get("shard_start", 0)
            changes["evidence"] = evidence(self.secrets[suspect], suspect, start)
        return self.client.post(
            f"/v1/nodes/{suspect}/verdicts", json=verdict(reporter, **changes),
            headers=self.proof(reporter),
        )  # fmt: skip

    def nodes(self) -> dict[str, dict]:
        return {n["node_id"]: n for n in self.client.get("/v1/dashboard").json()["nodes"]}

    def states(self) -> dict[str, str]:
        return {node_id: n["state"] for node_id, n in self.nodes().items()}


@pytest.fixture
def swarm() -> Iterator[Swarm]:
    settings = TrackerSettings(models_dir=None, verify_nodes=False, operator_token="op-7")
    with TestClient(create_app(settings, node=None)) as client:
        yield Swarm(client)


# -- per-node identity ---------------------------------------------------------------------


def test_a_live_id_is_not_taken_over_without_its_secret(swarm):
    first = swarm.register("victim")
    assert first.status_code == 200 and len(first.json()["node_secret"]) >= 32
    for state in ("serving", "joining"):  # joining skipped the call-back: no way in either
        body = announcement("victim", url="http://thief.test:9", state=state)
        for headers in ({}, {SECRET: "guess"}):
            taken = swarm.client.post("/v1/nodes/register", json=body, headers=headers)
            assert error(taken, 409)["code"] == "node_id_taken"
    shown = swarm.nodes()["victim"]
    assert shown["url"] == "http://victim.test:8000" and shown["state"] == "serving"
    # The node itself registers again with its secret, and keeps it.
    again = swarm.register("victim", 0, 2)
    assert again.status_code == 200 and again.json()["node_secret"] == first.json()["node_secret"]


def test_heartbeats_and_leaves_need_the_nodes_own_secret(swarm):
    swarm.register("a")
    swarm.register("b")
    stolen = swarm.client.post("/v1/nodes/heartbeat", json=beat("a", active_sessions=9),
                               headers=swarm.proof("b"))  # fmt: skip
    assert error(stolen, 401)["code"] == "node_unauthenticated"
    assert error(swarm.client.post("/v1/nodes/heartbeat", json=beat("a")), 401)
    assert swarm.nodes()["a"]["active_sessions"] == 0
    ok = swarm.client.post("/v1/nodes/heartbeat", json=beat("a", active_sessions=2),
                           headers=swarm.proof("a"))  # fmt: skip
    assert ok.json()["known"] is True and swarm.nodes()["a"]["active_sessions"] == 2
    # b may not remove a; a may leave; the operator may remove b.
    assert error(swarm.client.delete("/v1/nodes/a", headers=swarm.proof("b")), 401)
    assert error(swarm.client.delete("/v1/nodes/b"), 401)["code"] == "operator_only"
    assert swarm.client.delete("/v1/nodes/a", headers=swarm.proof("a")).status_code == 200
    assert swarm.client.delete("/v1/nodes/b", headers=OPERATOR).status_code == 200
    assert swarm.nodes() == {}


def test_a_joining_node_becomes_serving_by_registering_not_by_a_heartbeat(swarm):
    swarm.register("late", state="joining")
    resp = swarm.client.post("/v1/nodes/heartbeat", json=beat("late"), headers=swarm.proof("late"))
    assert resp.status_code == 200 and swarm.states()["late"] == "joining"
    assert swarm.register("late", state="serving").status_code == 200
    assert swarm.states()["late"] == "serving"


def test_a_node_that_lost_its_secret_gets_its_id_back_once_the_record_expires():
    now = [0.0]
    registry = Registry(1.0, clock=lambda: now[0])
    ann = NodeAnnouncement.model_validate(announcement("restarted"))
    old = registry.register(ann).secret
    with pytest.raises(Exception, match="missed heartbeats"):
        registry.register(ann)  # restarted without the secret: the live record holds the id
    now[0] += MISSED_HEARTBEATS + 0.1
    assert registry.prune() == ["restarted"]
    fresh = registry.register(ann).secret
    assert fresh != old and registry.authentic("restarted", fresh)
    assert not registry.authentic("restarted", old)


def test_the_tracker_node_is_removed_by_the_operator_only(swarm):
    registry = swarm.client.app.state.tracker.registry
    ann = NodeAnnouncement.model_validate(announcement("tracker-node", 0, 2))
    registry.register(ann, local=True)
    swarm.register("other")
    for headers in ({}, swarm.proof("other"), {SECRET: registry.get("tracker-node").secret}):
        assert error(swarm.client.delete("/v1/nodes/tracker-node", headers=headers), 401)
    assert "tracker-node" in swarm.nodes()
    assert swarm.client.delete("/v1/nodes/tracker-node", headers=OPERATOR).status_code == 200


def test_operator_actions_are_refused_when_no_operator_token_is_set():
    settings = TrackerSettings(models_dir=None, verify_nodes=False)
    with TestClient(create_app(settings, node=None)) as client:
        swarm = Swarm(client)
        swarm.register("a")
        refused = error(client.delete("/v1/nodes/a", headers=OPERATOR), 401)
        assert "--operator-token" in refused["message"]
        assert error(client.delete("/v1/nodes/a/quarantine", headers=OPERATOR), 401)


# -- verdicts ------------------------------------------------------------------------------


def test_verdicts_from_nobody_or_an_impostor_count_for_nothing(swarm):
    for node_id in ("honest", "faulty", "head"):
        swarm.register(node_id)
    for _ in range(3):
        assert error(swarm.report("faulty", "nobody"), 401)["code"] == "node_unauthenticated"
        forged = swarm.client.post("/v1/nodes/faulty/verdicts", json=verdict("head"),
                                   headers=swarm.proof("honest"))  # fmt: skip
        assert error(forged, 401)
    assert error(swarm.report("head", "head"), 400)["param"] == "reporter"  # not itself
    assert swarm.client.app.state.tracker.registry.strikes("faulty") == 0
    assert set(swarm.states().values()) == {"serving"}


def test_verdicts_without_evidence_quarantine_nobody(swarm):
    """Authenticated reporters, but no rows the suspect signed (or rows signed by another
    key, or a lone witness): every verdict refused, nothing counted."""
    for node_id in ("honest", "faulty", "h1", "h2", "h3"):
        swarm.register(node_id)
    forged = evidence("not-its-secret", "faulty")
    for reporter in ("h1", "h2", "h3"):
        for bad in (None, forged):
            refused = swarm.report("faulty", reporter, evidence=bad)
            assert error(refused, 400)["code"] == "bad_evidence"
    assert swarm.client.app.state.tracker.registry.strikes("faulty") == 0
    assert set(swarm.states().values()) == {"serving"}


def test_one_reporter_counts_once(swarm):
    for node_id in ("honest", "faulty", "head"):
        swarm.register(node_id)
    replies = [swarm.report("faulty", "head").json() for _ in range(5)]
    assert replies[-1] == {"strikes": 1, "quarantined": False}
    assert swarm.states()["faulty"] == "serving"


def test_the_only_replica_of_a_range_is_never_quarantined(swarm):
    swarm.register("front", 0, 2)
    swarm.register("back", 2, 4)
    swarm.register("h1", 0, 2)
    swarm.register("h2", 0, 2)
    for reporter in ("h1", "h2", "front"):
        assert swarm.report("back", reporter, shard_start=2).json()["quarantined"] is False
    assert swarm.states()["back"] == "serving"
    assert swarm.client.get("/v1/coverage").json()["models"][0]["covered"] is True
    # Once a replica serves its layers, the same verdicts take it off.
    swarm.register("back2", 2, 4)
    assert swarm.report("back", "h1", shard_start=2).json()["quarantined"] is True
    assert swarm.states()["back"] == "quarantined"
    # Now back2 is the only good replica of [2, 4): verdicts against it change nothing.
    for reporter in ("h1", "h2"):
        assert swarm.report("back2", reporter, shard_start=2).json()["quarantined"] is False
    assert swarm.states()["back2"] == "serving"


def test_quarantine_outlives_a_new_id_at_the_same_address_and_only_the_operator_lifts_it(swarm):
    for node_id in ("honest", "faulty", "h1", "h2"):
        swarm.register(node_id)
    swarm.report("faulty", "h1")
    assert swarm.report("faulty", "h2").json() == {"strikes": 2, "quarantined": True}
    swarm.client.delete("/v1/nodes/faulty", headers=swarm.proof("faulty"))  # it leaves...
    reborn = swarm.register("reborn", url="http://faulty.test:8000")  # ...and comes back
    assert reborn.status_code == 200 and swarm.states()["reborn"] == "quarantined"
    assert swarm.register("faulty").status_code == 200  # its old id: still quarantined
    assert swarm.states()["faulty"] == "quarantined"
    for headers in ({}, swarm.proof("faulty"), swarm.proof("h1")):
        assert error(swarm.client.delete("/v1/nodes/faulty/quarantine", headers=headers), 401)
    assert swarm.client.delete("/v1/nodes/faulty/quarantine", headers=OPERATOR).status_code == 200
    assert swarm.client.delete("/v1/nodes/reborn/quarantine", headers=OPERATOR).status_code == 200
    assert swarm.states()["faulty"] == "serving" and swarm.states()["reborn"] == "serving"


# -- fuzz: bad bodies answer 4xx, never 5xx, and change nothing ------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                 max_size=4),
    max_leaves=12,
)  # fmt: skip


def _mutated(base: dict) -> st.SearchStrategy:
    keys = st.sampled_from(sorted(set(base) - {"node_id"}))  # a new id may register
    return st.dictionaries(keys, _json, max_size=4).map(lambda bad: {**base, **bad})


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Swarm]:
    # Heartbeats every minute: the records outlive hundreds of fuzzed calls on a slow host.
    settings = TrackerSettings(
        models_dir=None, verify_nodes=False, operator_token="op-7", heartbeat_interval_s=60.0
    )
    with TestClient(create_app(settings, node=None)) as client:
        swarm = Swarm(client)
        for node_id in ("honest", "faulty", "head"):
            swarm.register(node_id)
        yield swarm


def _snapshot(swarm: Swarm) -> tuple:
    nodes = swarm.nodes()
    registry = swarm.client.app.state.tracker.registry
    return (
        {k: (n["url"], n["state"], n["shard_start"], n["shard_end"]) for k, n in nodes.items()},
        {k: registry.get(k).secret for k in nodes},
        {k: registry.strikes(k) for k in nodes},
    )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.one_of(_json, _mutated(announcement("faulty")), _mutated(announcement("head"))),
       with_proof=st.booleans())  # fmt: skip
def test_fuzzed_registrations_of_live_ids_answer_4xx_and_change_nothing(fuzzed, body, with_proof):
    before = _snapshot(fuzzed)
    headers = {SECRET: "not-the-secret"} if with_proof else {}
    resp = fuzzed.client.post("/v1/nodes/register", json=body, headers=headers)
    assert 400 <= resp.status_code < 500, resp.text
    assert set(resp.json()) == {"error"}
    assert _snapshot(fuzzed) == before


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.one_of(_json, _mutated(verdict("head"))),
       suspect=st.sampled_from(["faulty", "honest", "ghost", "head"]),
       proof_of=st.sampled_from([None, "honest", "faulty"]))  # fmt: skip
def test_fuzzed_verdicts_answer_4xx_and_quarantine_nobody(fuzzed, body, suspect, proof_of):
    before = _snapshot(fuzzed)
    headers = fuzzed.proof(proof_of) if proof_of else {}
    if isinstance(body, dict) and body.get("reporter") == proof_of:
        body = {**body, "reporter": "head"}  # the proof never matches the reporter
    resp = fuzzed.client.post(f"/v1/nodes/{suspect}/verdicts", json=body, headers=headers)
    assert 400 <= resp.status_code < 500, resp.text
    assert set(resp.json()) == {"error"}
    assert _snapshot(fuzzed) == before

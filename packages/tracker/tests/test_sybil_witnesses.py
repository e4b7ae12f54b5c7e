"""Witnesses a verdict may call on (docs/adr/0032): a token holder's Sybil ids cannot
quarantine an honest node. Only called-back, serving, unquarantined nodes of the suspect's
model and precision, holding the audited layers, on hosts of their own and serving for a
while, testify; registrations per source address are bounded. In-process, no sockets."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient
from signed_evidence import MODEL, announcement

from meshnet_common.layers import LayerRange
from meshnet_common.protocol import Evidence
from meshnet_common.trust.evidence import Signer, check_evidence, row_bytes, sign_row
from meshnet_common.trust.identity import NodeKey
from meshnet_tracker.app import create_app
from meshnet_tracker.settings import TrackerSettings

DIGEST = "ab" * 32
TOLERANCE = 3.5e-4
SECRET = "x-meshnet-node-secret"


def row(node_id: str, secret: str, value: float, start: int = 0) -> dict:
    """A row ``node_id`` signed with ``secret`` (its own, or a forger's guess)."""
    raw = row_bytes([value] * 8)
    return {"node_id": node_id, "row": base64.b64encode(raw).decode(),
            "signature": sign_row(secret, node_id, start, DIGEST, raw)}  # fmt: skip


def verdict(reporter: str, witnesses: list[str], evidence: dict) -> dict:
    return {"model_id": MODEL, "reporter": reporter, "shard_start": 0, "shard_end": 4,
            "error": 0.7, "tolerance": TOLERANCE, "witnesses": witnesses,
            "evidence": evidence}  # fmt: skip


class Tracker:
    """A tracker in-process and the secrets it issued."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.secrets: dict[str, str] = {}

    def register(self, node_id: str, *args, **changes):
        resp = self.client.post(
            "/v1/nodes/register", json=announcement(node_id, *args, **changes),
            headers={SECRET: self.secrets[node_id]} if node_id in self.secrets else {},
        )  # fmt: skip
        if resp.status_code == 200:
            self.secrets[node_id] = resp.json()["node_secret"]
        return resp

    def report(self, suspect: str, reporter: str, witnesses: list[str], evidence: dict):
        return self.client.post(
            f"/v1/nodes/{suspect}/verdicts", json=verdict(reporter, witnesses, evidence),
            headers={SECRET: self.secrets[reporter]},
        )  # fmt: skip

    def state(self, node_id: str) -> str:
        nodes = self.client.get("/v1/dashboard").json()["nodes"]
        return next(n["state"] for n in nodes if n["node_id"] == node_id)


def tracker(**settings) -> Iterator[Tracker]:
    config = TrackerSettings(models_dir=None, verify_nodes=False, **settings)
    with TestClient(create_app(config, node=None)) as client:
        yield Tracker(client)


@pytest.fixture
def swarm() -> Iterator[Tracker]:
    yield from tracker()


def test_two_joining_sybils_with_one_honest_row_of_the_victim_cannot_quarantine_it(swarm):
    """The attack as reported: a token holder registers two joining ids (no call-back, yet
    each got a secret), fetches one honestly signed row from the victim, forges the rest
    (its two witnesses' rows, which agree with each other), and reports twice."""
    assert swarm.register("victim").status_code == 200
    assert swarm.register("replica").status_code == 200  # so it is not the only replica
    for sybil in ("sybil-1", "sybil-2"):
        assert swarm.register(sybil, state="joining").status_code == 200
    honest = row("victim", swarm.secrets["victim"], 1.0)  # what it answered an audit
    evidence = {"inputs_sha256": DIGEST, "start_layer": 0, "suspect_rows": [honest],
                "witness_rows": [row(s, swarm.secrets[s], 5.0) for s in ("sybil-1", "sybil-2")]}  # fmt: skip
    for reporter in ("sybil-1", "sybil-2"):
        refused = swarm.report("victim", reporter, ["sybil-1", "sybil-2"], evidence)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "bad_evidence"
        assert "never called back" in refused.json()["error"]["message"]
    assert swarm.client.app.state.tracker.registry.strikes("victim") == 0
    assert swarm.state("victim") == "serving"


def test_sybils_serving_from_one_host_or_too_young_cannot_quarantine_either(swarm):
    """Called back, but on the victim's host (or one host for both), or just arrived: no
    verdict counts. The same witnesses from hosts of their own, serving long enough, do."""
    registry = swarm.client.app.state.tracker.registry
    for node_id in ("victim", "replica"):
        swarm.register(node_id)
    swarm.register("w-1", url="http://victim.test:8001")  # the victim's host
    swarm.register("w-2", url="http://victim.test:8002")
    swarm.register("w-3", url="http://elsewhere.test:8000")
    swarm.register("w-4", url="http://elsewhere.test:8001")  # w-3's host
    swarm.register("w-5")
    swarm.register("w-6")
    honest = row("victim", swarm.secrets["victim"], 1.0)

    def evidence(*witnesses: str) -> dict:
        rows = [row(w, swarm.secrets[w], 5.0) for w in witnesses]
        return {"inputs_sha256": DIGEST, "start_layer": 0, "suspect_rows": [honest],
                "witness_rows": rows}  # fmt: skip

    young = swarm.report("victim", "replica", ["w-5", "w-6"], evidence("w-5", "w-6"))
    assert young.status_code == 400 and "not served long enough" in young.text
    clock = registry.clock  # ten minutes on: every witness is old enough
    registry.clock = lambda: clock() + 601.0
    for pair in (("w-1", "w-2"), ("w-3", "w-4")):
        refused = swarm.report("victim", "replica", list(pair), evidence(*pair))
        assert refused.status_code == 400 and "shares its host" in refused.text
    assert registry.strikes("victim") == 0
    # w-5 and w-6 (hosts of their own, called back, serving long enough) are witnesses.
    counted = swarm.report("victim", "replica", ["w-5", "w-6"], evidence("w-5", "w-6"))
    assert counted.status_code == 200 and registry.strikes("victim") == 1


def test_witnesses_registered_from_one_machine_cannot_quarantine_either(swarm):
    """Distinct host names in their URLs, but their registrations came from one address
    (an IPv6 /64 counts as one machine)."""
    registry = swarm.client.app.state.tracker.registry
    for node_id in ("victim", "replica"):
        swarm.register(node_id)
    for node_id, address in (("w-7", "2001:db8::7"), ("w-8", "2001:db8::8")):
        member = Tracker(TestClient(swarm.client.app, client=(address, 40000)))
        assert member.register(node_id).status_code == 200
        swarm.secrets[node_id] = member.secrets[node_id]
    clock = registry.clock
    registry.clock = lambda: clock() + 601.0
    honest = row("victim", swarm.secrets["victim"], 1.0)
    evidence = {"inputs_sha256": DIGEST, "start_layer": 0, "suspect_rows": [honest],
                "witness_rows": [row(w, swarm.secrets[w], 5.0) for w in ("w-7", "w-8")]}  # fmt: skip
    refused = swarm.report("victim", "replica", ["w-7", "w-8"], evidence)
    assert refused.status_code == 400 and "shares its host 2001:db8::/64" in refused.text
    assert registry.strikes("victim") == 0


def test_a_joining_registration_gets_no_certificate_to_call_peers_with(swarm):
    """Its secret lets it heartbeat; a certificate (signed calls to peers) waits until the
    tracker called it back as serving."""
    key = NodeKey().public
    joining = swarm.register("sybil", state="joining", public_key=key)
    assert joining.status_code == 200 and joining.json()["certificate"] is None
    beat = {"node_id": "sybil", "state": "joining", "active_sessions": 0, "kv_tokens": 0,
            "memory_free_bytes": 1}  # fmt: skip
    answer = swarm.client.post("/v1/nodes/heartbeat", json=beat,
                               headers={SECRET: swarm.secrets["sybil"]})  # fmt: skip
    assert answer.status_code == 200 and answer.json()["certificate"] is None
    serving = swarm.register("sybil", public_key=key)
    assert serving.status_code == 200 and serving.json()["certificate"]


def test_registrations_per_source_address_are_bounded():
    for swarm in tracker(max_nodes_per_source=3):
        for node_id in ("a", "b", "c"):
            assert swarm.register(node_id, state="joining").status_code == 200
        refused = swarm.register("d", state="joining")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_nodes"
        assert swarm.register("a").status_code == 200  # its own id again: no new record
        swarm.client.delete("/v1/nodes/c", headers={SECRET: swarm.secrets["c"]})
        assert swarm.register("d", state="joining").status_code == 200


# -- each condition on a witness, in the pure check -----------------------------------


def signer(host: str, **changes) -> Signer:
    return replace(
        Signer(secret=f"secret-{host}", called_back=True, serving=True, model_id=MODEL,
               precision="float32", layers=LayerRange(0, 4), hosts=frozenset({host, f"ip-{host}"}),
               since=0.0),
        **changes,
    )  # fmt: skip


def check(signers: dict[str, Signer], start: int = 0) -> str | None:
    rows = {n: row(n, s.secret, 1.0 if n == "suspect" else 5.0, start) for n, s in signers.items()}
    evidence = Evidence.model_validate({
        "inputs_sha256": DIGEST, "start_layer": start, "suspect_rows": [rows["suspect"]],
        "witness_rows": [r for n, r in rows.items() if n != "suspect"],
    })  # fmt: skip
    return check_evidence(
        evidence, "suspect", signers.get, TOLERANCE, now=1000.0, witness_age_s=600.0
    )


FIT = {"suspect": signer("s"), "w1": signer("h1"), "w2": signer("h2")}


@pytest.mark.parametrize(
    ("w2", "why"),
    [
        (signer("h2", called_back=False), "never called back"),
        (signer("h2", serving=False), "not serving"),
        (signer("h2", model_id="org/other"), "not the suspect's model"),
        (signer("h2", precision="bfloat16"), "not the suspect's model at float32"),
        (signer("h2", layers=LayerRange(1, 4)), "not every audited layer"),
        (signer("h2", layers=LayerRange(0, 3)), "not every audited layer"),
        (signer("s"), "shares its host"),
        (signer("h1"), "shares its host"),
        (signer("h2", hosts=frozenset({"h2", "ip-h1"})), "shares its host ip-h1"),
        (signer("h2", since=401.0), "not served long enough"),
    ],
)
def test_each_witness_condition(w2, why):
    assert check(FIT) is None  # fit witnesses: the verdict counts
    found = check({**FIT, "w2": w2})
    assert found is not None and why in found, found


def test_witnesses_hold_the_layers_the_suspect_was_audited_on():
    suspect = signer("s", layers=LayerRange(2, 6))
    witnesses = {"w1": signer("h1", layers=LayerRange(0, 6)),
                 "w2": signer("h2", layers=LayerRange(3, 8))}  # fmt: skip
    assert check({"suspect": suspect, **witnesses}, start=3) is None  # audited [3, 6)
    assert "not every audited layer" in check({"suspect": suspect, **witnesses}, start=2)
    assert "not in the suspect's range" in check({"suspect": suspect, **witnesses}, start=1)


def test_the_operators_own_processes_on_the_trackers_machine_are_witnesses(swarm):
    """Nodes registering from loopback at loopback URLs are processes on the tracker's own
    machine (no member reaches it from there): each port is a machine of its own, so a swarm
    on one machine still convicts. From any other address one host stays one witness."""
    registry = swarm.client.app.state.tracker.registry
    local = Tracker(TestClient(swarm.client.app, client=("127.0.0.1", 40000)))
    for node_id, port in (("victim", 9001), ("replica", 9002), ("w-1", 9003), ("w-2", 9004)):
        assert local.register(node_id, url=f"http://127.0.0.1:{port}").status_code == 200
    swarm.secrets.update(local.secrets)
    clock = registry.clock
    registry.clock = lambda: clock() + 601.0
    honest = row("victim", swarm.secrets["victim"], 1.0)
    evidence = {"inputs_sha256": DIGEST, "start_layer": 0, "suspect_rows": [honest],
                "witness_rows": [row(w, swarm.secrets[w], 5.0) for w in ("w-1", "w-2")]}  # fmt: skip
    counted = swarm.report("victim", "replica", ["w-1", "w-2"], evidence)
    assert counted.status_code == 200 and registry.strikes("victim") == 1
    # the same ports behind one remote address are one machine
    remote = Tracker(TestClient(swarm.client.app, client=("192.0.2.9", 40000)))
    for node_id, port in (("r-1", 9005), ("r-2", 9006)):
        assert remote.register(node_id, url=f"http://127.0.0.1:{port}").status_code == 200
    swarm.secrets.update(remote.secrets)
    registry.clock = lambda: clock() + 1202.0
    evidence["witness_rows"] = [row(w, swarm.secrets[w], 5.0) for w in ("r-1", "r-2")]
    refused = swarm.report("victim", "w-1", ["r-1", "r-2"], evidence)
    assert refused.status_code == 400 and "shares its host" in refused.text

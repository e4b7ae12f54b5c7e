"""Verification (docs/adr/0026): what an audited session records, a replica's recomputation
of it, the choice of hops to audit, and the verdict logic, on made-up replicas."""

from __future__ import annotations

import asyncio
import hashlib
import random

import pytest
import torch
from audit_fakes import FakeView, checked

from meshnet_common import wire
from meshnet_common.layers import LayerRange
from meshnet_common.metrics import Metrics
from meshnet_common.precision import Precision
from meshnet_common.trust.evidence import row_bytes, sign_row
from meshnet_node.engine.faults import NoisyOutputs
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.sessions import InputRecord
from meshnet_node.engine.stage import Stage
from meshnet_node.verification.audit import pack, unpack
from meshnet_node.verification.verifier import (
    Replica,
    Verifier,
    audit_targets,
    relative_error,
    replicas_in_coverage,
)

# -- the record ---------------------------------------------------------------------------


def rows(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count, dtype=torch.float32).reshape(1, count, 1)


def test_a_record_keeps_inputs_in_order_and_forgets_past_a_rewind():
    record = InputRecord()
    record.add(0, rows(0, 5), torch.tensor([4.0]))
    record.add(5, rows(5, 1), torch.tensor([5.0]))
    record.add(6, rows(6, 3), torch.tensor([8.0]))  # a step with two drafts
    assert record.length == 9 and record.inputs().reshape(-1).tolist() == list(range(9))
    record.add(7, rows(70, 2), torch.tensor([71.0]))  # one draft kept: the next step at 7
    assert record.inputs().reshape(-1).tolist() == [*range(7), 70, 71]
    assert record.last.tolist() == [71.0]
    record.truncate(3)
    assert record.length == 3 and record.inputs().reshape(-1).tolist() == [0, 1, 2]
    assert record.last is None  # the output of a forgotten row


def test_packed_frames_round_trip_and_truncation_is_refused():
    a, b = torch.randn(1, 3, 4).to(torch.bfloat16), torch.randn(7)
    body = pack(wire.encode_tensor(a), wire.encode_tensor(b))
    got_a, got_b = unpack(body, 2, max_bytes=1 << 20)
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    for bad in (body[:-1], body + b"x", body[:3]):
        with pytest.raises(ValueError):
            unpack(bad, 2, max_bytes=1 << 20)


# -- a stage's record and a replica's recomputation ---------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_snapshot):
    return tiny_snapshot("llama")


def run_session(stage: Stage, inputs: torch.Tensor, steps: int) -> None:
    """A prompt then ``steps`` one-row decode steps, with inputs as a chain would send."""
    stage.open_session("s", record=True, start_layer=stage.shard.layers.start)
    stage.step("s", 0, hidden=inputs[:, :6], sample=False)
    for position in range(6, 6 + steps):
        stage.step("s", position, hidden=inputs[:, position : position + 1], sample=False)


@pytest.mark.parametrize("precision", [Precision.FLOAT32, Precision.BFLOAT16])
@pytest.mark.parametrize("layers", [(2, 4), (4, 6)])  # a middle stage and the tail
def test_a_replica_recomputes_the_recorded_row_within_the_tolerance(llama, precision, layers):
    shard = load_shard(llama, LayerRange(*layers), precision)
    stage, replica = Stage(shard), Stage(load_shard(llama, LayerRange(*layers), precision))
    torch.manual_seed(0)
    inputs = torch.randn(1, 10, shard.hidden_size).to(precision.compute_dtype)
    run_session(stage, inputs, 4)
    record = stage.sessions.get("s").record
    assert record.length == 10 and torch.equal(record.inputs(), inputs)
    again = replica.recompute(record.inputs(), layers[0])
    assert relative_error(record.last, again) <= precision.verify_tolerance / 10
    assert len(replica.sessions) == 0  # the throwaway session is gone

    noisy = NoisyOutputs(0.3)  # as started with --test-only-perturb 0.3
    faulty = Stage(load_shard(llama, LayerRange(*layers), precision), output_fault=noisy)
    wrong = faulty.recompute(record.inputs(), layers[0])
    assert relative_error(wrong, again) > precision.verify_tolerance


def test_a_session_opened_without_audit_records_nothing(llama):
    stage = Stage(load_shard(llama, LayerRange(2, 4), Precision.FLOAT32))
    stage.open_session("plain")
    stage.step("plain", 0, hidden=torch.randn(1, 3, stage.shard.hidden_size), sample=False)
    assert stage.sessions.get("plain").record is None


# -- which hops, and the verdicts ---------------------------------------------------------

HEAD_END = 2
P, A, B = (Replica(n, f"http://{n}.test", 2, 4) for n in ("p", "a", "b"))
TAIL = Replica("tail", "http://tail.test", 4, 6)


def test_audit_targets_are_hops_with_a_replica_of_the_same_span():
    wide = Replica("wide", "http://wide.test", 1, 4)  # enters at 2 as well: it qualifies
    long = Replica("long", "http://long.test", 2, 6)  # ends elsewhere: only for the tail
    int8 = Replica("int8", "http://int8.test", 2, 4, "int8")  # other arithmetic
    route = (P.url, TAIL.url)
    mid, tail = audit_targets(route, HEAD_END, [P, wide, long, int8, TAIL])
    assert mid.primary == P and mid.start == 2 and mid.alternates == (wide,)
    assert tail.primary == TAIL and tail.start == 4 and tail.alternates == (long,)
    assert audit_targets(route, HEAD_END, [P, TAIL]) == []  # no replica: nothing to compare
    assert audit_targets(("http://unknown.test", TAIL.url), HEAD_END, [P, A, TAIL]) == []


def test_replicas_come_from_the_serving_nodes_of_the_coverage_map():
    coverage = {"models": [{"id": "m/x", "nodes": [
        {"node_id": "p", "url": P.url, "shard_start": 2, "shard_end": 4, "state": "serving",
         "quantization": "bfloat16"},
        {"node_id": "q", "url": "http://q.test", "shard_start": 2, "shard_end": 4,
         "state": "quarantined", "quantization": "bfloat16"},
    ]}]}  # fmt: skip
    assert replicas_in_coverage(coverage, "m/x") == [Replica("p", P.url, 2, 4)]
    assert replicas_in_coverage(coverage, "m/other") == []


class FakeNodes:
    """Each replica computes ``truth`` plus its own error; a noisy one differs every time."""

    def __init__(
        self, offsets: dict[str, float], noisy: set[str] = frozenset(), decode: float = 0.0
    ) -> None:
        self.truth = torch.ones(8)
        self.offsets, self.noisy = offsets, noisy
        self.decode = decode  # how far the hop's decode step lay from any prefill
        self.calls: list[str] = []
        self.draws = 0

    def output(self, node: str) -> torch.Tensor:
        noise = 0.0
        if node in self.noisy:  # another error on every computation
            self.draws += 1
            noise = 0.5 * self.draws
        return self.truth + self.offsets.get(node, 0.0) + noise

    async def record(self, url, session_id, key):
        claimed = self.output(url.split("//")[1].split(".")[0]) + self.decode
        return b"the inputs frame", claimed, 2

    async def recompute(self, url, inputs, start):
        """The row, signed as a node signs it with the secret the tracker issued it."""
        node = url.split("//")[1].split(".")[0]
        self.calls.append(node)
        row = self.output(node)
        digest = hashlib.sha256(inputs).hexdigest()
        return row, sign_row(f"secret-{node}", node, start, digest, row_bytes(row.tolist()))

    async def aclose(self):
        pass


def audit(nodes: FakeNodes, replicas, route=(P.url, TAIL.url)):
    verifier = Verifier(1.0, FakeView(replicas), nodes, model_id="m/x", node_id="head",
                        head_end=HEAD_END, metrics=Metrics(), rng=random.Random(1))  # fmt: skip
    return asyncio.run(verifier.audit("s", "k", route))


def test_replicas_that_agree_within_the_tolerance_are_agreed():
    finding = audit(FakeNodes({"a": 1e-3}), [P, A, TAIL])
    assert finding.outcome == "agreed" and finding.error < Precision.BFLOAT16.verify_tolerance


def test_a_decode_step_that_only_its_arithmetic_sets_apart_is_agreed():
    # A near-tie flipped in the decode step (an MoE router, say): every recomputation,
    # the hop's own included, agrees. No one is blamed.
    for replicas in ([P, A, TAIL], [P, A, B, TAIL]):
        nodes = FakeNodes({}, decode=0.5)
        finding = audit(nodes, replicas)
        assert finding.outcome == "agreed" and len(nodes.calls) == 2 and nodes.calls[-1] == "p"


def test_with_three_replicas_the_odd_one_out_is_convicted():
    finding = audit(FakeNodes({"p": 0.5}), [P, A, B, TAIL])
    assert finding.outcome == "convicted" and finding.suspect == P
    assert {w.node_id for w in finding.witnesses} == {"a", "b"}
    finding = audit(FakeNodes({"a": 0.5, "b": 0.5}), [P, A, B, TAIL])
    assert finding.outcome == "convicted" and finding.suspect == P  # the two others agree
    finding = audit(FakeNodes({"p": 0.5, "a": -0.5, "b": 1.5}), [P, A, B, TAIL])
    assert finding.outcome == "disputed" and finding.suspect is None


def test_a_conviction_carries_evidence_the_tracker_accepts():
    """The signed rows prove the conviction to whoever holds the secrets (the tracker);
    a row changed after signing, or evidence without a second witness, proves nothing."""
    secret_of = lambda node: f"secret-{node}"  # noqa: E731
    tol = Precision.BFLOAT16.verify_tolerance
    three = audit(FakeNodes({"p": 0.5}), [P, A, B, TAIL])
    assert checked(three.evidence, "p", secret_of, tol) is None
    assert checked(three.evidence, "a", secret_of, tol) is not None  # not a's rows
    two = audit(FakeNodes({}, noisy={"p"}), [P, A, TAIL])
    assert len(two.evidence.suspect_rows) == 2
    assert checked(two.evidence, "p", secret_of, tol) is None
    forged = three.evidence.model_copy(
        update={"suspect_rows": (three.evidence.witness_rows[0].model_copy(
            update={"node_id": "p"}),)}  # a witness's row passed off as the suspect's
    )  # fmt: skip
    assert "signature" in checked(forged, "p", secret_of, tol)
    lone = three.evidence.model_copy(update={"witness_rows": three.evidence.witness_rows[:1]})
    assert "two witnesses" in checked(lone, "p", secret_of, tol)
    assert "needs evidence" in checked(None, "p", secret_of, tol)


def test_with_two_replicas_the_one_that_cannot_reproduce_itself_is_convicted():
    finding = audit(FakeNodes({}, noisy={"p"}), [P, A, TAIL])
    assert finding.outcome == "convicted" and finding.suspect == P
    finding = audit(FakeNodes({}, noisy={"a"}), [P, A, TAIL])
    assert finding.outcome == "convicted" and finding.suspect == A
    # Both deterministic, one of them wrong: two machines cannot tell which.
    finding = audit(FakeNodes({"a": 0.5}), [P, A, TAIL])
    assert finding.outcome == "disputed" and finding.suspect is None


def test_the_tolerance_follows_the_precision():
    assert 0.05 < Precision.BFLOAT16.verify_tolerance < 0.1
    assert Precision.INT8.verify_tolerance == Precision.BFLOAT16.verify_tolerance
    assert 1e-4 < Precision.FLOAT32.verify_tolerance < 1e-3


# -- a node's audit routes and its quarantine, in-process ---------------------------------


def test_audit_routes_hand_over_the_record_and_recompute_it(llama):
    import json as json_module

    from fastapi.testclient import TestClient

    from meshnet_common.protocol import H_SESSION_KEY, H_START_LAYER
    from meshnet_node.dataplane.steps import OpenSpec, Step
    from meshnet_node.runtime import build_runtime, create_app
    from meshnet_node.settings import NodeSettings

    async def no_route(_model_id, _exclude=frozenset()):
        return ()

    settings = NodeSettings(model_id="meshnet-tiny/llama", model_path=llama,
                            layers=LayerRange(2, 6), quantization=Precision.FLOAT32)  # fmt: skip
    runtime = build_runtime(settings, route_provider=no_route)
    hidden = torch.randn(1, 6, runtime.service.stage.shard.hidden_size)
    with TestClient(create_app(runtime)) as client:

        def forward(position, rows, open_spec=None):
            headers = Step("s1", "k", position, open_spec=open_spec, sample=True).to_headers()
            body = wire.encode_tensor(hidden[:, position : position + rows])
            return client.post("/v1/forward", headers=headers, content=body)

        opened = forward(0, 4, OpenSpec(temperature=0, start_layer=2, audit=True))
        assert opened.status_code == 200, opened.text
        assert forward(4, 1).status_code == 200
        refused = client.post("/v1/node/audit/record/s1", headers={H_SESSION_KEY: "other"})
        assert refused.status_code == 404  # another chain's key: no record for it
        got = client.post("/v1/node/audit/record/s1", headers={H_SESSION_KEY: "k"})
        assert got.status_code == 200 and got.headers[H_START_LAYER] == "2"
        inputs, last = unpack(got.content, 2, max_bytes=1 << 24)
        assert torch.equal(inputs, hidden[:, :5]) and last.shape == (
            runtime.service.stage.shard.vocab_size,
        )
        again = client.post("/v1/node/audit/recompute", content=wire.encode_tensor(inputs),
                            headers={H_START_LAYER: "2"})  # fmt: skip
        assert again.status_code == 200
        recomputed = wire.decode_tensor(again.content)
        assert relative_error(last, recomputed) <= Precision.FLOAT32.verify_tolerance
        bad = client.post("/v1/node/audit/recompute", content=b"junk", headers={H_START_LAYER: "2"})
        assert bad.status_code == 400 and "error" in bad.json()

        # Quarantined, the node runs no step: 503 naming itself, which heads route around.
        runtime.quarantine("2 verdicts")
        refused = forward(5, 1)
        assert refused.status_code == 503
        error = json_module.loads(refused.content)["error"]
        assert error["code"] == "quarantined" and error["param"] == runtime.url
        assert "meshnet_quarantined 1.0" in client.get("/metrics").text
        runtime.quarantine(None)
        assert forward(5, 1).status_code == 200

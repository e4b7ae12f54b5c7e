"""Heads audited by the hop after them (docs/adr/0032): a head stage recomputes a row from
token ids, the record keeps a session's ids, the recompute and holds routes, and the hop's
auditor convicting a faulty head (and agreeing with honest ones), in-process."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch
from audit_fakes import FakeView, checked

from meshnet_common import wire
from meshnet_common.errors import InvalidRequest
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import H_START_LAYER
from meshnet_common.trust.evidence import (
    H_AUDIT_SIGNATURE,
    row_bytes,
    sign_row,
)
from meshnet_node.dataplane import answer_bytes
from meshnet_node.dataplane.steps import OpenSpec, Step
from meshnet_node.engine.faults import noisy_outputs
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.sessions import InputRecord
from meshnet_node.engine.stage import Stage
from meshnet_node.verification.audit import H_KEY_DIGEST, key_digest
from meshnet_node.verification.head_audit import HeadAuditor
from meshnet_node.verification.verifier import Replica, relative_error

FP32 = Precision.FLOAT32
TOL = FP32.verify_tolerance


@pytest.fixture(scope="module")
def llama(tiny_snapshot):
    return tiny_snapshot("llama")


def head_stage(llama, precision=FP32, perturb=0.0) -> Stage:
    """A head stage of ``[0, 2)``; ``perturb``: as started with ``--test-only-perturb``."""
    shard = load_shard(llama, LayerRange(0, 2), precision)
    return Stage(shard, output_fault=noisy_outputs(perturb))


# -- a head stage recomputes from token ids -----------------------------------------------


@pytest.mark.parametrize("precision", [Precision.FLOAT32, Precision.BFLOAT16])
def test_a_head_stage_recomputes_the_row_its_steps_produced_from_the_ids(llama, precision):
    head, replica = head_stage(llama, precision), head_stage(llama, precision)
    ids = torch.randint(
        0, head.shard.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0)
    )
    head.open_session("s")
    head.step("s", 0, token_ids=ids[:, :6], sample=False)
    for position in range(6, 10):  # decode steps, as a generation runs them
        out = head.step("s", position, token_ids=ids[:, position : position + 1], sample=False)
    decoded = out.hidden[0, -1]
    head.open_session("whole")  # the same ids in one prefill: the recomputation's arithmetic
    whole = head.step("whole", 0, token_ids=ids, sample=False).hidden[0, -1]

    again = replica.recompute(ids, 0)
    assert again.shape == (head.shard.hidden_size,) and again.dtype == decoded.dtype
    assert torch.equal(again, whole)
    assert relative_error(decoded, again) <= precision.verify_tolerance / 8
    assert len(replica.sessions) == 0  # the throwaway session is gone
    with pytest.raises(InvalidRequest):
        replica.recompute(ids, 1)  # a head runs from layer 0
    faulty = head_stage(llama, precision, perturb=0.5)
    assert relative_error(faulty.recompute(ids, 0), again) > precision.verify_tolerance


def test_a_record_keeps_ids_by_position_and_hands_the_last_row_with_an_id():
    record = InputRecord()
    rows = torch.arange(9, dtype=torch.float32).reshape(1, 9, 1)
    record.add(0, rows[:, :5], torch.zeros(1))
    record.note_ids(0, [10, 11, 12, 13, 14])
    record.add(5, rows[:, 5:6], torch.zeros(1))
    ids, row = record.known()
    assert ids == [10, 11, 12, 13, 14] and row.tolist() == [4.0]  # position 5: no id yet
    record.note_ids(5, [15])
    record.add(6, rows[:, 6:9], torch.zeros(1))  # a step with drafts
    record.note_ids(6, [16, 17, 18])
    assert record.known()[0] == list(range(10, 19)) and record.known()[1].tolist() == [8.0]
    record.truncate(7)  # one draft kept: the next step starts at 7
    assert record.known()[0] == [10, 11, 12, 13, 14, 15, 16]
    assert record.known()[1].tolist() == [6.0]
    assert InputRecord().known() == ([], None)


# -- the routes: a head's recomputation from ids, and which head holds a session ----------


def test_a_head_recomputes_an_ids_frame_signed_and_says_whether_it_holds_a_session(llama):
    from fastapi.testclient import TestClient

    from meshnet_node.runtime import build_runtime, create_app
    from meshnet_node.settings import NodeSettings

    async def no_route(_model_id, _exclude=frozenset()):
        return ()

    settings = NodeSettings(model_id="meshnet-tiny/llama", model_path=llama,
                            layers=LayerRange(0, 2), quantization=FP32)  # fmt: skip
    runtime = build_runtime(settings, route_provider=no_route)
    runtime.audit_secret = lambda: "s3cret"
    stage = runtime.service.stage
    ids = torch.tensor([[1, 5, 9, 2, 7]], dtype=torch.int64)
    with TestClient(create_app(runtime)) as client:
        frame = wire.encode_tensor(ids)
        got = client.post("/v1/node/audit/recompute", content=frame, headers={H_START_LAYER: "0"})
        assert got.status_code == 200, got.text
        row = wire.decode_tensor(got.content)
        assert torch.equal(row, stage.recompute(ids, 0))
        digest = hashlib.sha256(frame).hexdigest()
        raw = row_bytes(row.float().reshape(-1).tolist())
        assert got.headers[H_AUDIT_SIGNATURE] == sign_row("s3cret", runtime.node_id, 0, digest, raw)
        for bad, start in ((wire.encode_tensor(ids.float()), "0"),  # not ids
                           (wire.encode_tensor(ids + stage.shard.vocab_size), "0"),
                           (frame, "1")):  # fmt: skip
            refused = client.post("/v1/node/audit/recompute", content=bad,
                                  headers={H_START_LAYER: start})  # fmt: skip
            assert refused.status_code == 400, refused.text

        stage.open_session("held", owner="key-1")
        path = "/v1/node/audit/holds/{}"
        for session, key, held in (("held", "key-1", True), ("held", "key-2", False),
                                   ("other", "key-1", False)):  # fmt: skip
            answer = client.post(path.format(session),
                                 headers={H_KEY_DIGEST: key_digest(session, key)})  # fmt: skip
            assert answer.status_code == 200 and answer.json() == {"holds": held}
        assert client.post(path.format("held")).json() == {"holds": False}  # no digest


# -- the hop's auditor, in-process ---------------------------------------------------------


def replica(name: str, start: int, end: int) -> Replica:
    return Replica(name, f"http://{name}.test", start, end, "float32", "float32")


class HeadNodes:
    """The audit client, answered by real stages: which holds a session, and their
    recomputations signed as a node signs them with the secret the tracker issued it."""

    def __init__(self, stages: dict[str, Stage]) -> None:
        self.stages = stages
        self.recomputed: list[str] = []

    @staticmethod
    def name(url: str) -> str:
        return url.split("//")[1].split(".")[0]

    async def holds(self, url, session_id, key):
        session = self.stages[self.name(url)].sessions.peek(session_id)
        return session is not None and session.owner == key

    async def recompute(self, url, inputs, start):
        node = self.name(url)
        self.recomputed.append(node)
        ids = wire.decode_tensor(inputs)
        assert ids.dtype == torch.int64 and start == 0
        row = self.stages[node].recompute(ids, start)
        digest = hashlib.sha256(inputs).hexdigest()
        return row, sign_row(f"secret-{node}", node, start, digest, row_bytes(row.tolist()))

    async def aclose(self):
        pass


@pytest.fixture(scope="module")
def tail_runtime(llama):
    from meshnet_node.runtime import build_runtime
    from meshnet_node.settings import NodeSettings

    async def no_route(_model_id, _exclude=frozenset()):
        return ()

    settings = NodeSettings(model_id="meshnet-tiny/llama", model_path=llama,
                            layers=LayerRange(2, 6), quantization=FP32,
                            verify_fraction=1.0)  # fmt: skip
    return build_runtime(settings, route_provider=no_route, view=FakeView(()))


def auditor_for(runtime, heads: dict[str, Stage]) -> tuple[HeadAuditor, HeadNodes, FakeView]:
    """The tail's auditor, its map showing ``heads`` (and the tail), its client them."""
    auditor = runtime.service.head_audit
    assert isinstance(auditor, HeadAuditor)  # built for a node with --verify-fraction
    view = FakeView([*(replica(n, 0, 2) for n in heads), replica(runtime.node_id, 2, 6)])
    nodes = HeadNodes(heads)
    auditor.view = auditor.convictions.view = view
    auditor.client = nodes
    auditor._map = None  # the map of an earlier test is not this one's
    return auditor, nodes, view


async def generate(
    service, head: Stage, session_id: str, steps: int, *, ids=True, audit=False
) -> None:
    """A generation through ``head`` and the tail ``service``, as a head's data path runs
    it: the prompt in one chunk, then one decode step at a time; audits settle after each.
    ``audit``: the head audits its chain too (its open header asks every hop to record)."""
    key, prompt = f"key-{session_id}", [1, 5, 9, 2, 7, 3]
    head.open_session(session_id, owner=key)
    out = head.step(session_id, 0, token_ids=torch.tensor([prompt]), owner=key, sample=False)
    position, inputs = 0, prompt
    for _ in range(steps + 1):
        answer = await service.handle_step(Step(
            session_id, key, position, sample=True, ids=tuple(inputs) if ids else None,
            open_spec=OpenSpec(start_layer=2, audit=audit) if position == 0 else None,
        ), out.hidden)  # fmt: skip
        audits = service.head_audit._tasks
        await asyncio.gather(*list(audits))
        position += len(inputs)
        inputs = [answer_bytes.decode(answer.body).token_id]
        out = head.step(session_id, position, token_ids=torch.tensor([inputs]), owner=key,
                        sample=False)  # fmt: skip
    head.close_session(session_id)
    service.stage.close_session(session_id)


def outcomes(service) -> dict[str, float]:
    audits = service.metrics.audits
    return {o: audits.labels(o)._value.get() for o in ("agreed", "convicted", "skipped")}


def test_the_hop_convicts_a_head_that_computes_wrong_with_evidence(llama, tail_runtime):
    good, bad = head_stage(llama), head_stage(llama, perturb=0.5)
    auditor, nodes, view = auditor_for(tail_runtime, {"good": good, "bad": bad})
    service = tail_runtime.service
    before = outcomes(service)
    asyncio.run(generate(service, bad, "through-bad", 3, audit=True))
    after = outcomes(service)
    assert after["convicted"] - before["convicted"] == 3  # after each decode step
    assert after["agreed"] == before["agreed"]
    assert {node for node, _ in view.reports} == {"bad"}
    assert auditor.suspects() == {"http://bad.test"}
    node_id, verdict = view.reports[0]
    assert verdict.reporter == tail_runtime.node_id
    assert (verdict.shard_start, verdict.shard_end) == (0, 2) and verdict.witnesses == ("good",)
    # The evidence is the head's own recomputations: it does not reproduce its output.
    assert len(verdict.evidence.suspect_rows) == 2 and verdict.evidence.start_layer == 0
    assert checked(verdict.evidence, "bad", lambda n: f"secret-{n}", TOL) is None
    assert checked(verdict.evidence, "bad", lambda n: "another secret", TOL) is not None
    assert checked(verdict.evidence, "good", lambda n: f"secret-{n}", TOL) is not None


def test_the_hop_agrees_with_an_honest_head_and_skips_what_it_cannot_audit(llama, tail_runtime):
    heads = {"good": head_stage(llama), "twin": head_stage(llama)}
    auditor, nodes, view = auditor_for(tail_runtime, heads)
    service = tail_runtime.service
    before = outcomes(service)
    asyncio.run(generate(service, heads["good"], "through-good", 3))
    after = outcomes(service)
    assert after["agreed"] - before["agreed"] == 3 and after["convicted"] == before["convicted"]
    assert nodes.recomputed == ["twin"] * 3  # the claim agreed with the twin's: no more asked
    assert view.reports == []

    # An older head sends no ids: nothing to recompute from, the session is not audited.
    nodes.recomputed.clear()
    asyncio.run(generate(service, heads["good"], "no-ids", 2, ids=False))
    assert outcomes(service)["skipped"] - after["skipped"] == 1 and nodes.recomputed == []

    # A head the map does not show (or that does not hold the session): no sender, no audit.
    stranger = head_stage(llama)
    skipped = outcomes(service)["skipped"]
    asyncio.run(generate(service, stranger, "from-a-stranger", 2))
    assert outcomes(service)["skipped"] - skipped == 1 and nodes.recomputed == []
    assert view.reports == []

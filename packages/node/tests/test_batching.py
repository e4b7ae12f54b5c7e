"""Batched decode: several sessions' decode steps in one pass give each session's own tokens."""

from __future__ import annotations

import asyncio

import pytest
import torch
from stage_drivers import decode_sessions, hidden_steps

from meshnet_common.errors import Conflict, NotFound
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.tiny import snapshots as tiny
from meshnet_node.dataplane.service import NodeService
from meshnet_node.engine.families import attention_module
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import DecodeItem, Stage
from meshnet_node.scheduling.micro_batches import micro_batches
from meshnet_node.scheduling.policy import PassQueue
from meshnet_node.settings import NodeSettings

FAMILIES = list(tiny.FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decode_equals_one_session_at_a_time(tiny_snapshot, family):
    snapshot = tiny_snapshot(family)
    stages = [
        Stage(load_shard(snapshot, LayerRange(a, b), Precision.FLOAT32))
        for a, b in ((0, 3), (3, 6))
    ]
    assert decode_sessions(stages, batched=True) == decode_sessions(stages, batched=False)


def test_a_bad_item_fails_alone(tiny_snapshot):
    stage = Stage(load_shard(tiny_snapshot("llama"), LayerRange(0, 6), Precision.FLOAT32))
    for sid in ("a", "b"):
        stage.open_session(sid)
        stage.step(sid, 0, token_ids=torch.tensor([[5, 6, 7]]))
    results = stage.step_batch(
        [
            DecodeItem("a", 3, token_ids=torch.tensor([[8]])),
            DecodeItem("b", 9, token_ids=torch.tensor([[8]])),  # wrong position
            DecodeItem("nope", 3, token_ids=torch.tensor([[8]])),
        ]
    )
    assert results[0].token is not None
    assert isinstance(results[1], Conflict) and isinstance(results[2], NotFound)
    assert stage.sessions.peek("a").length == 4 and stage.sessions.peek("b").length == 3


def test_concurrent_decode_steps_are_merged(tiny_snapshot):
    snapshot = tiny_snapshot("llama")
    stage = Stage(load_shard(snapshot, LayerRange(0, 6), Precision.FLOAT32))
    settings = NodeSettings(
        model_id="meshnet-tiny/llama", model_path=snapshot, layers=LayerRange(0, 6)
    )
    sids = [f"c{i}" for i in range(6)]
    for sid in sids:
        stage.open_session(sid)
        stage.step(sid, 0, token_ids=torch.tensor([[5, 6, 7]]))

    async def run() -> tuple[list, NodeService]:
        service = NodeService(stage, settings, model_id=settings.model_id)
        outs = await asyncio.gather(
            *(service.run_stage(stage, sid, 3, token_ids=torch.tensor([[9]])) for sid in sids)
        )
        await service.aclose()
        return outs, service

    outs, service = asyncio.run(run())
    assert service.scheduler.queue.batches >= 1 and service.scheduler.queue.batched_steps >= 2
    assert len({o.token.token_id for o in outs}) == 1  # same history, same next token
    assert all(stage.sessions.peek(sid).length == 4 for sid in sids)


def test_a_head_splits_its_sessions_into_one_micro_batch_per_stage(tiny_snapshot):
    """On a head whose chains have 3 stages, 6 sessions' decode steps run as 3 passes of
    2: every stage of the chain then has a batch of its own to compute (pipelining)
    instead of one batch moving down the chain in lockstep. A stage that is not a head
    batches whatever waits."""
    snapshot = tiny_snapshot("llama")
    settings = NodeSettings(
        model_id="meshnet-tiny/llama", model_path=snapshot, layers=LayerRange(0, 3)
    )
    sids = [f"p{i}" for i in range(6)]

    def batches_of(layers: LayerRange) -> tuple[list[int], list]:
        stage = Stage(load_shard(snapshot, layers, Precision.FLOAT32))
        for sid in sids:
            stage.open_session(sid)
            if stage.shard.is_head:
                stage.step(sid, 0, token_ids=torch.tensor([[5, 6, 7]]), sample=False)
            else:
                stage.step(sid, 0, hidden=torch.ones(1, 3, stage.shard.config.hidden_size))

        async def run() -> tuple[list[int], list]:
            service = NodeService(stage, settings, model_id=settings.model_id)
            service.set_micro_batches(3)
            sizes: list[int] = []
            original = stage.step_batch
            stage.step_batch = lambda items: sizes.append(len(items)) or original(items)
            tensor = {"token_ids": torch.tensor([[9]])} if stage.shard.is_head else {
                "hidden": torch.ones(1, 1, stage.shard.config.hidden_size)}  # fmt: skip
            outs = await asyncio.gather(
                *(service.run_stage(stage, sid, 3, sample=False, **tensor) for sid in sids)
            )
            await service.aclose()
            return sizes, outs

        return asyncio.run(run())

    sizes, outs = batches_of(LayerRange(0, 3))
    assert sizes == [2, 2, 2]
    assert all(torch.allclose(o.hidden, outs[0].hidden, atol=1e-5) for o in outs)  # same input
    sizes, _ = batches_of(LayerRange(3, 6))  # not a head: one pass for all
    assert sizes == [6]


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_batched_rows_equal_one_token_steps_bit_for_bit(tiny_snapshot, family):
    """A middle stage in bfloat16: every row of a batched step is the one-token step's
    output exactly. Every family but DeepSeek's (its attention expands the cache it reads)
    runs each attention module once for all rows (``attend_together``)."""
    stage = Stage(load_shard(tiny_snapshot(family), LayerRange(2, 4), Precision.BFLOAT16))
    alone = hidden_steps(stage, batched=False)
    together = hidden_steps(stage, batched=True)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
    modules = [attention_module(layer) for layer in stage.shard.modules.layers]
    assert all("_meshnet_attention" in m.__dict__ for m in modules)  # set up by the loader
    rows_only = {m.__dict__.get("_meshnet_rows_only", False) for m in modules}
    assert rows_only == {family == "deepseek_v3"}


LOOPBACK = ("http://127.0.0.1:9001", "http://localhost:9002")
REMOTE = ("http://10.0.0.2:8000", "https://gpu-box.lan:8000")


@pytest.mark.parametrize(
    ("route", "threads", "cpus", "expected"),
    [
        ((), 1, 2, 1),  # head and tail in one: nothing to pipeline
        (LOOPBACK, 1, 2, 2),  # three stages on a 2-core machine: two compute at once
        (LOOPBACK, 1, 16, 3),  # enough cores: every stage its own micro-batch
        (LOOPBACK, 4, 8, 2),  # 4 threads a stage: two stages fill 8 CPUs
        (LOOPBACK, 8, 4, 1),  # one stage's threads take the machine
        (REMOTE, 1, 1, 3),  # other machines compute beside this one, whatever its CPUs
        (("http://[::1]:9001", *REMOTE), 1, 1, 3),  # 2 here share 1 CPU: 1 + 2 elsewhere
    ],
)
def test_a_head_keeps_one_micro_batch_per_stage_that_computes_in_parallel(
    route, threads, cpus, expected
):
    """Stages at a loopback address share the head's CPUs; a micro-batch beyond what they
    can run at once would repeat each pass's fixed cost for no parallelism."""
    assert micro_batches(route, threads, cpus) == expected


def _head_service(tiny_snapshot, sids: list[str]):
    """A head stage (layers 0-3 of the tiny Llama) with ``sids`` prefilled, and a service
    whose batcher keeps 2 micro-batches; ``passes`` records each pass's session ids."""
    snapshot = tiny_snapshot("llama")
    settings = NodeSettings(
        model_id="meshnet-tiny/llama", model_path=snapshot, layers=LayerRange(0, 3)
    )
    stage = Stage(load_shard(snapshot, LayerRange(0, 3), Precision.FLOAT32))
    for sid in sids:
        stage.open_session(sid)
        stage.step(sid, 0, token_ids=torch.tensor([[5, 6, 7]]), sample=False)
    passes: list[list[str]] = []
    original = stage.step_batch
    stage.step_batch = lambda items: passes.append([i.session_id for i in items]) or original(items)
    return stage, settings, passes


def test_a_session_keeps_its_micro_batch_whatever_the_order_steps_arrive_in(tiny_snapshot):
    """Slots (ADR-0029): each session is given the least filled micro-batch at its first
    step and keeps it, so later passes group the same sessions even when their steps
    arrive interleaved with the other micro-batch's."""
    sids = [f"q{i}" for i in range(6)]
    stage, settings, passes = _head_service(tiny_snapshot, sids)

    async def run() -> None:
        service = NodeService(stage, settings, model_id=settings.model_id)
        service.set_micro_batches(2)
        for position, order in ((3, sids), (4, sids[::-1]), (5, sids[1:] + sids[:1])):
            await asyncio.gather(*(
                service.run_stage(stage, sid, position, token_ids=torch.tensor([[9]]),
                                  sample=False) for sid in order
            ))  # fmt: skip
        await service.aclose()

    asyncio.run(run())
    groups = [frozenset(p) for p in passes]
    assert len(groups) == 6 and all(len(g) == 3 for g in groups)
    assert len(set(groups)) == 2  # the same two micro-batches every step
    assert set(groups) == {frozenset(sids[0::2]), frozenset(sids[1::2])}


def test_a_micro_batch_waits_for_a_member_still_down_the_chain(tiny_snapshot):
    """A member whose last step went down the chain with its slot, and comes back later
    than the others, is waited for (up to a cycle: a pass per micro-batch) instead of
    leaving it to a pass of its own, which would split the micro-batch for good."""
    sids = [f"r{i}" for i in range(4)]
    stage, settings, passes = _head_service(tiny_snapshot, sids)

    async def step(service, sid: str, position: int, after: int = 0) -> None:
        # Decided by events, not a delay: the late member sends once ``after`` others wait.
        while len(service.scheduler.queue.entries) < after:
            await asyncio.sleep(0)
        await service.run_stage(stage, sid, position, token_ids=torch.tensor([[9]]),
                                sample=False)  # fmt: skip

    async def run() -> None:
        service = NodeService(stage, settings, model_id=settings.model_id)
        service.set_micro_batches(2)
        await asyncio.gather(*(step(service, sid, 3) for sid in sids))  # all in phase
        # A cycle of 20 s: a pass that did not wait for the late member would stall here
        # that long; one that waits ends as soon as it arrives.
        service.scheduler.queue.pass_s = 10.0
        late = sids[2]  # slot 0 is r0 and r2
        await asyncio.gather(*(step(service, s, 4, 3 if s == late else 0) for s in sids))
        await service.aclose()

    asyncio.run(run())
    assert {frozenset(p) for p in passes[-2:]} == {frozenset({"r0", "r2"}), frozenset({"r1", "r3"})}


def test_one_micro_batch_waits_for_a_member_still_down_the_chain(tiny_snapshot):
    """Where the stages take turns on shared cores (one micro-batch), a head of a chain
    keeps every session in one slot and waits for a member still down the chain (up to the
    chain's measured return time), so the whole batch moves down the chain as one."""
    sids = [f"u{i}" for i in range(4)]
    stage, settings, passes = _head_service(tiny_snapshot, sids)
    assert not stage.shard.is_tail

    async def step(service, sid: str, position: int, after: int = 0) -> None:
        while len(service.scheduler.queue.entries) < after:  # the late member: once 3 wait, ...
            await asyncio.sleep(0)
        if after:
            await asyncio.sleep(10 * service.scheduler.queue.gather_s)  # ... past the gather window
        await service.run_stage(stage, sid, position, token_ids=torch.tensor([[9]]),
                                sample=False)  # fmt: skip

    async def run() -> None:
        service = NodeService(stage, settings, model_id=settings.model_id)
        assert service.scheduler.queue.depth == 1
        await asyncio.gather(*(step(service, sid, 3) for sid in sids))  # all in phase
        service.scheduler.queue.return_s = 10.0  # a pass that did not wait would stall 10 s
        late = sids[1]
        await asyncio.gather(*(step(service, s, 4, 3 if s == late else 0) for s in sids))
        await service.aclose()

    asyncio.run(run())
    assert passes and all(frozenset(p) == frozenset(sids) for p in passes)


def test_one_slow_return_moves_the_chains_return_time_a_little():
    queue = PassQueue()
    queue._note_return(0.030)
    queue._note_return(10.0)  # a failover's replay, a client that paused
    assert queue.return_s == pytest.approx(0.8 * 0.030 + 0.2 * 0.060)

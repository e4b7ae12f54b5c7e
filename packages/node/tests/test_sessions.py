"""Sessions on a stage: isolation, bad steps rejected without damage, budget and expiry."""

from __future__ import annotations

import time

import pytest
import torch
from baselines import split_greedy

from meshnet_common.errors import CapacityExceeded, Conflict, InvalidRequest, NotFound
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import SamplingSpec
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.sessions import Session
from meshnet_node.engine.stage import Stage


@pytest.fixture(scope="module")
def llama_stages(tiny_snapshot):
    snapshot = tiny_snapshot("llama")
    bounds = [(0, 2), (2, 4), (4, 6)]
    return [
        Stage(load_shard(snapshot, LayerRange(a, b), Precision.FLOAT32), kv_budget_tokens=4096)
        for a, b in bounds
    ]


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_interleaved_sessions_match_each_alone(llama_stages):
    prompts = {"a": ids(150, 1), "b": ids(40, 2)}
    alone = {sid: split_greedy(llama_stages, p, 8, session_id=sid)[0] for sid, p in prompts.items()}
    head, *rest = llama_stages
    for stage in llama_stages:
        for sid in prompts:
            stage.open_session(sid)
    feeds = {sid: list(p) for sid, p in prompts.items()}
    positions = dict.fromkeys(prompts, 0)
    produced: dict[str, list[int]] = {sid: [] for sid in prompts}
    while any(len(v) < 8 for v in produced.values()):
        for sid in prompts:  # alternate sessions every step
            if len(produced[sid]) == 8:
                continue
            chunk = feeds[sid][:128]
            feeds[sid] = feeds[sid][128:]
            out = head.step(sid, positions[sid], token_ids=torch.tensor([chunk]))
            for stage in rest:
                out = stage.step(sid, positions[sid], hidden=out.hidden)
            positions[sid] += len(chunk)
            if not feeds[sid]:
                produced[sid].append(out.token.token_id)
                feeds[sid] = [out.token.token_id]
    for stage in llama_stages:
        for sid in prompts:
            stage.close_session(sid)
    assert produced == alone


def test_bad_steps_are_rejected_and_session_survives(llama_stages):
    head, middle, tail = llama_stages
    prompt = ids(20, 3)
    expected = split_greedy(llama_stages, prompt, 4, session_id="ref")[0]
    for stage in llama_stages:
        stage.open_session("s")
    hidden = head.step("s", 0, token_ids=torch.tensor([prompt])).hidden
    good = middle.step("s", 0, hidden=hidden).hidden
    bad_calls = [
        (Conflict, lambda: tail.step("s", 5, hidden=good)),  # wrong position
        (NotFound, lambda: tail.step("nope", 0, hidden=good)),  # unknown session
        (InvalidRequest, lambda: tail.step("s", 0, hidden=good[:, :, :32])),  # hidden size
        (InvalidRequest, lambda: tail.step("s", 0, hidden=good.to(torch.float16))),  # dtype
        (InvalidRequest, lambda: tail.step("s", 0, hidden=good * float("nan"))),
        (InvalidRequest, lambda: tail.step("s", 0, hidden=torch.zeros(1, 2049, 64))),  # too long
        (InvalidRequest, lambda: tail.step("s", 0, token_ids=torch.tensor([[1]]))),  # wrong input
        (InvalidRequest, lambda: head.step("s", 20, token_ids=torch.tensor([[10**6]]))),  # vocab
        (InvalidRequest, lambda: tail.step("s", -1, hidden=good)),
    ]
    for error, call in bad_calls:
        with pytest.raises(error):
            call()
    tokens = [tail.step("s", 0, hidden=good).token.token_id]
    position = len(prompt)
    for _ in range(3):
        out = head.step("s", position, token_ids=torch.tensor([[tokens[-1]]]))
        for stage in (middle, tail):
            out = stage.step("s", position, hidden=out.hidden)
        tokens.append(out.token.token_id)
        position += 1
    for stage in llama_stages:
        stage.close_session("s")
    assert tokens == expected


def test_kv_budget_refuses_new_sessions_retryably(tiny_snapshot):
    shard = load_shard(tiny_snapshot("llama"), LayerRange(0, 6), Precision.FLOAT32)
    stage = Stage(shard, kv_budget_tokens=100)
    stage.open_session("a")
    stage.step("a", 0, token_ids=torch.tensor([ids(100, 4)]))
    with pytest.raises(CapacityExceeded) as info:
        stage.open_session("b")
    assert info.value.status == 503
    stage.close_session("a")
    stage.open_session("b")  # freed explicitly: room again
    with pytest.raises(CapacityExceeded):
        stage.step("b", 0, token_ids=torch.tensor([ids(101, 5)]))


def test_idle_sessions_expire(tiny_snapshot):
    shard = load_shard(tiny_snapshot("llama"), LayerRange(0, 6), Precision.FLOAT32)
    stage = Stage(shard, idle_timeout_s=0.05)
    stage.open_session("idle")
    assert stage.sessions.expire_idle() == []  # not idle yet
    assert stage.sessions.expire_idle(now=time.monotonic() + 0.1) == ["idle"]
    with pytest.raises(NotFound):
        stage.step("idle", 0, token_ids=torch.tensor([[1]]))


def test_session_owner_is_enforced(llama_stages):
    head = llama_stages[0]
    head.open_session("owned", owner="chain-1")
    with pytest.raises(NotFound):
        head.step("owned", 0, token_ids=torch.tensor([[1]]), owner="someone-else")
    head.step("owned", 0, token_ids=torch.tensor([[1]]), owner="chain-1")
    head.close_session("owned")


def test_bad_session_ids_are_refused(llama_stages):
    for bad in ["", "a" * 129, "../x", "sp ace"]:
        with pytest.raises(InvalidRequest):
            llama_stages[0].open_session(bad)


def test_a_scored_prompts_calls_end_before_its_last_row():
    """ADR-0053: a prompt's calls are ``prompt_call`` rows from its start; a scored one's
    (``SamplingSpec.score_end``) also ends before its last row."""
    assert SamplingSpec(prompt_tokens=300, prompt_logprobs=0).score_end == 299
    assert SamplingSpec(prompt_tokens=300).score_end is None
    assert SamplingSpec(prompt_tokens=1, prompt_logprobs=0).score_end is None
    plain = Session("p", cache=None, prompt_call=256)
    assert [plain.call_end(p) for p in (0, 256)] == [256, 512]
    scored = Session("s", cache=None, prompt_call=256, score_end=299)
    assert [scored.call_end(p) for p in (0, 256, 299)] == [256, 299, 555]

"""Decode steps that run ahead on a stage that is head and tail (docs/adr/0047): the same
tokens as one step at a time, never past an end token, max_tokens or another pass waiting,
and the same text behind the endpoint."""

from __future__ import annotations

import torch
from fastapi.testclient import TestClient
from transformers import AutoConfig

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.engine.ahead import Ahead, run_ahead, steps_of
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import DecodeItem, Stage
from meshnet_node.head import generation
from meshnet_node.runtime import build_runtime, create_app
from meshnet_node.scheduling import scheduler
from meshnet_node.scheduling.scheduler import _decode_call
from meshnet_node.settings import NodeSettings

PROMPT = [5, 17, 42, 99, 7, 3]
MODEL_ID = "meshnet-tiny/llama"


def _whole(snapshot) -> LayerRange:
    return LayerRange(0, AutoConfig.from_pretrained(snapshot).num_hidden_layers)


def _opened(stage: Stage, sid: str) -> int:
    """A greedy session with the prompt run: its first sampled token."""
    stage.open_session(sid)
    return stage.step(sid, 0, token_ids=torch.tensor([PROMPT])).token.token_id


def _one_by_one(stage: Stage, sid: str, first: int, steps: int) -> list[tuple[int, float]]:
    tokens, token = [], first
    for i in range(steps):
        out = stage.step(sid, len(PROMPT) + i, token_ids=torch.tensor([[token]]))
        token = out.token.token_id
        tokens.append((token, out.token.logprob))
    return tokens


def _item(sid: str, token: int, position: int = len(PROMPT), ahead=None) -> DecodeItem:
    return DecodeItem(sid, position, token_ids=torch.tensor([[token]]), ahead=ahead)


def test_a_step_that_runs_ahead_gives_the_tokens_of_steps_one_at_a_time(tiny_snapshot):
    snapshot = tiny_snapshot("llama")
    for precision in (Precision.FLOAT32, Precision.INT4):
        stage = Stage(load_shard(snapshot, _whole(snapshot), precision))
        first = _opened(stage, "plain")
        want = _one_by_one(stage, "plain", first, 6)
        assert _opened(stage, "ahead") == first
        out = run_ahead(stage, _item("ahead", first), Ahead(5), lambda: True)
        got = [(t.token_id, t.logprob) for t in [out.token, *out.more]]
        assert got == want and steps_of(out) == 6
        # every token but the last is in the cache: the next step starts after them
        assert stage.sessions.peek("ahead").length == len(PROMPT) + 6
        nxt = stage.step("ahead", len(PROMPT) + 6, token_ids=torch.tensor([[got[-1][0]]]))
        assert nxt.token.token_id == _one_by_one(stage, "plain2", _opened(stage, "plain2"), 7)[-1][0]  # fmt: skip


def test_running_ahead_stops_after_an_end_token_and_when_told(tiny_snapshot):
    snapshot = tiny_snapshot("llama")
    stage = Stage(load_shard(snapshot, _whole(snapshot), Precision.FLOAT32))
    first = _opened(stage, "plain")
    want = [t for t, _ in _one_by_one(stage, "plain", first, 6)]
    end = want[2]
    stop_at = want.index(end)  # the first time it comes
    first_ahead = _opened(stage, "ends")
    out = run_ahead(stage, _item("ends", first_ahead), Ahead(5, frozenset({end})), lambda: True)
    assert [t.token_id for t in [out.token, *(out.more or [])]] == want[: stop_at + 1]
    asked = []
    first_told = _opened(stage, "told")
    out = run_ahead(stage, _item("told", first_told), Ahead(5), lambda: asked.append(1) or len(asked) < 3)  # fmt: skip
    assert steps_of(out) == 3  # yes, yes, no
    out = run_ahead(stage, _item("told", want[1], len(PROMPT) + 3), Ahead(0), lambda: True)
    assert out.more is None


def test_a_step_runs_ahead_only_for_a_stages_only_session(tiny_snapshot):
    """Another open session's steps would wait behind it: they share passes instead."""
    snapshot = tiny_snapshot("llama")
    stage = Stage(load_shard(snapshot, _whole(snapshot), Precision.FLOAT32))
    first = _opened(stage, "a")
    ahead = Ahead(4)
    alone = _decode_call(stage, [_item("a", first, ahead=ahead)], lambda: False)[0]()
    assert steps_of(alone) == 5
    _opened(stage, "b")
    position = len(PROMPT) + 5
    token = alone.more[-1].token_id
    shared = _decode_call(stage, [_item("a", token, position, ahead)], lambda: False)[0]()
    assert steps_of(shared) == 1
    stage.close_session("b")
    waiting = _decode_call(stage, [_item("a", shared.token.token_id, position + 1, ahead)], lambda: True)[0]()  # fmt: skip
    assert steps_of(waiting) == 1  # another pass waits: it stops after its own step


def _completions(snapshot, bodies: list[dict]) -> list[dict]:
    settings = NodeSettings(model_id=MODEL_ID, model_path=snapshot, layers=_whole(snapshot),
                            quantization=Precision.INT4.value)  # fmt: skip

    async def no_route(_model_id, _exclude=frozenset()):
        return ()

    runtime = build_runtime(settings, route_provider=no_route)
    with TestClient(create_app(runtime)) as http:
        answers = []
        for body in bodies:
            resp = http.post("/v1/completions", json={"model": MODEL_ID, **body})
            assert resp.status_code == 200, resp.text
            answers.append(resp.json())
        return answers


def test_the_endpoint_gives_the_same_text_with_steps_run_ahead(tiny_snapshot, monkeypatch):
    snapshot = tiny_snapshot("llama")
    greedy = {"temperature": 0, "logprobs": 2}
    bodies = [
        {"prompt": PROMPT, "max_tokens": 21, "ignore_eos": True, **greedy},
        {"prompt": PROMPT[:4], "max_tokens": 3, "ignore_eos": True, **greedy},
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "seed": 7, "ignore_eos": True},
    ]
    steps: list[int] = []

    def counted(*args):
        out = run_ahead(*args)
        steps.append(steps_of(out))
        return out

    monkeypatch.setattr(scheduler, "run_ahead", counted)
    ran = _completions(snapshot, bodies)
    assert max(steps) == 1 + generation.AHEAD_TOKENS  # it did run ahead
    # stop tokens a step running ahead ends on (the tiny model's text is byte fragments,
    # so no stop string, and greedy repeats one token): every fifth id, from the first
    # offset whose first comes mid-way in a seeded sampled text
    vocab = AutoConfig.from_pretrained(snapshot).vocab_size
    stops = [{**bodies[2], "max_tokens": 30, "stop_token_ids": list(range(o, vocab, 5))} for o in range(5)]  # fmt: skip
    ended = [(b, a) for b, a in zip(stops, _completions(snapshot, stops), strict=True)
             if 1 < a["usage"]["completion_tokens"] < 30]  # fmt: skip
    bodies.append(ended[0][0])
    ran.append(ended[0][1])
    monkeypatch.setattr(generation, "AHEAD_TOKENS", 0)  # one step at a time
    plain = _completions(snapshot, bodies)
    for a, b in zip(ran, plain, strict=True):
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"]
        assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"]
        assert a["usage"] == b["usage"]
    assert ran[0]["usage"]["completion_tokens"] == 21 and ran[1]["usage"]["completion_tokens"] == 3
    assert ran[3]["choices"][0]["finish_reason"] == "stop"

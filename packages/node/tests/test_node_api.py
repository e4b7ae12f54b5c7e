"""A node's HTTP API in-process: the forward data path, sessions, and the OpenAI endpoints.

Nodes reach each other through ``httpx.ASGITransport`` (no sockets, no subprocesses): each
node's hop client is swapped for one that dispatches on the URL's host to in-process apps.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import torch
import zstandard
from baselines import hf_chunked_greedy, load_reference_model
from fastapi import FastAPI
from fastapi.testclient import TestClient
from inprocess_hops import HttpxHops

from meshnet_common import wire
from meshnet_common.layers import LayerRange
from meshnet_common.openai_protocol import ChatCompletionRequest
from meshnet_common.precision import Precision
from meshnet_common.protocol import (
    H_CHUNK,
    H_COMPUTE,
    H_OPEN,
    H_POSITION,
    H_ROUTE,
    H_SESSION,
    H_SESSION_KEY,
    SamplingSpec,
)
from meshnet_node.dataplane.links import LINK_PROBE_SESSION
from meshnet_node.dataplane.steps import OpenSpec, Step
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.runtime import NodeRuntime, build_runtime, create_app
from meshnet_node.settings import NodeSettings
from meshnet_node.speculation.drafting import DraftPolicy

MODEL_ID = "meshnet-tiny/llama"
HIDDEN = 64  # the tiny models' hidden size
MIDDLE_URL = "http://middle.test"
TAIL_URL = "http://tail.test"
ERROR_KEYS = {"message", "type", "param", "code"}


# -- in-process plumbing -------------------------------------------------------------------


class AppsTransport(httpx.AsyncBaseTransport):
    """Sends each request to the in-process ASGI app registered for its host."""

    def __init__(self, apps: dict[str, FastAPI]) -> None:
        self._transports = {host: httpx.ASGITransport(app=app) for host, app in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        transport = self._transports.get(request.url.host)
        if transport is None:
            raise httpx.ConnectError(f"no app at {request.url.host}", request=request)
        return await transport.handle_async_request(request)


@dataclass
class InProcessNode:
    runtime: NodeRuntime
    app: FastAPI
    http: TestClient

    @property
    def sessions(self):
        return self.runtime.service.stage.sessions


def settings_for(snapshot: Path, start: int, end: int, **overrides) -> NodeSettings:
    return NodeSettings(
        model_id=MODEL_ID,
        model_path=snapshot,
        layers=LayerRange(start, end),
        quantization=Precision.FLOAT32,
        **overrides,
    )


@contextmanager
def running(
    settings: NodeSettings, *, route: tuple[str, ...] = (), peers: dict[str, FastAPI] | None = None
) -> Iterator[InProcessNode]:
    """Build a node, point its hop client at ``peers``, and run its app's lifespan."""

    async def route_provider(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
        return route

    runtime = build_runtime(settings, route_provider=route_provider)
    if peers is not None:
        runtime.service.links.hops = HttpxHops(httpx.AsyncClient(transport=AppsTransport(peers)))
    app = create_app(runtime)
    with TestClient(app) as http:
        yield InProcessNode(runtime, app, http)


def assert_error(resp: httpx.Response, status: int, error_type: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_KEYS
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if error_type is not None:
        assert body["error"]["type"] == error_type
    return body["error"]


def open_spec(start_layer: int, **sampling) -> dict:
    return {**SamplingSpec(**sampling).model_dump(), "start_layer": start_layer}


def headers(
    session_id: str,
    position: int,
    *,
    key: str = "key",
    route: tuple[str, ...] = (),
    opening: dict | None = None,
    chunk: int = 0,
    sample: bool = True,
) -> dict[str, str]:
    opening = None if opening is None else OpenSpec.model_validate(opening)
    return Step(
        session_id, key, position, chunk=chunk, route=route, open_spec=opening, sample=sample
    ).to_headers()


def hidden(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(
        1, tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)
    )  # (1, T, H)


def frame(tensor: torch.Tensor) -> bytes:
    return wire.encode_tensor(tensor)


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshot(tiny_snapshot) -> Path:
    return tiny_snapshot("llama")


@pytest.fixture(scope="module")
def reference(snapshot):
    return load_reference_model(snapshot, torch.float32)


@pytest.fixture(scope="module")
def first_layers(snapshot) -> Stage:
    """Layers [0, 2) in-process: makes the real activations a middle node expects."""
    return Stage(load_shard(snapshot, LayerRange(0, 2), Precision.FLOAT32))


@pytest.fixture(scope="module")
def tail(snapshot) -> Iterator[InProcessNode]:
    with running(settings_for(snapshot, 4, 6)) as node:
        yield node


@pytest.fixture(scope="module")
def middle(snapshot, tail) -> Iterator[InProcessNode]:
    with running(settings_for(snapshot, 2, 4), peers={"tail.test": tail.app}) as node:
        yield node


@pytest.fixture(scope="module")
def small_tail(snapshot) -> Iterator[InProcessNode]:
    with running(settings_for(snapshot, 4, 6, max_frame_mb=4096 / 2**20)) as node:
        yield node


@pytest.fixture(scope="module")
def whole(snapshot) -> Iterator[InProcessNode]:
    """One node holding [0, 6): head and tail, serving the OpenAI endpoints alone."""
    with running(settings_for(snapshot, 0, 6)) as node:
        yield node


@pytest.fixture(scope="module")
def chain_head(snapshot, middle, tail) -> Iterator[InProcessNode]:
    """A head [0, 2) whose route goes through the middle and tail nodes in-process."""
    peers = {"middle.test": middle.app, "tail.test": tail.app}
    with running(settings_for(snapshot, 0, 2), route=(MIDDLE_URL, TAIL_URL), peers=peers) as node:
        yield node


@pytest.fixture(scope="module")
def tokenizer(whole):
    return whole.runtime.openai.tokenizer


def open_tail_session(tail: InProcessNode, session_id: str, *, key: str = "key") -> None:
    """A tail session holding 3 tokens."""
    resp = tail.http.post(
        "/v1/forward",
        content=frame(hidden(3)),
        headers=headers(session_id, 0, key=key, opening=open_spec(4)),  # fmt: skip
    )
    assert resp.status_code == 200, resp.text


def step_tail(tail: InProcessNode, session_id: str, position: int, *, key: str = "key"):
    return tail.http.post(
        "/v1/forward",
        content=frame(hidden(1, seed=position)),
        headers=headers(session_id, position, key=key),  # fmt: skip
    )


def assert_token(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"token_id", "logprob", "top_logprobs"}
    assert 0 <= body["token_id"] < 512
    compute = [float(ms) for ms in resp.headers[H_COMPUTE].split(",")]  # one per hop
    assert compute and all(ms > 0 for ms in compute)
    return body["token_id"]


# -- health and info -----------------------------------------------------------------------


def test_health_and_node_info(middle):
    health = middle.http.get("/health").json()
    assert health["status"] == "ok"
    assert health["model_id"] == MODEL_ID
    assert (health["shard_start"], health["shard_end"]) == (2, 4)
    info = middle.http.get("/v1/node").json()
    assert info["num_layers"] == 6 and info["quantization"] == "float32"
    assert info["dtype"] == "float32" and info["quant_group_size"] is None


def test_unknown_path_and_method_use_the_error_shape(middle, whole):
    assert_error(middle.http.get("/v1/nothing"), 404, "not_found_error")
    assert_error(middle.http.post("/v1/completions", json={}), 404, "not_found_error")  # not a head
    assert_error(whole.http.get("/v1/completions"), 405)


# -- the forward data path -----------------------------------------------------------------


def test_middle_relays_to_tail_and_matches_reference(middle, tail, first_layers, reference):
    prompt = list(range(10, 30))
    expected, _ = hf_chunked_greedy(reference, prompt, 4)
    sid, key = "relay-1", "relay-key"
    first_layers.open_session(sid)
    try:
        position, feed, tokens = 0, prompt, []
        for _ in range(4):
            acts = first_layers.step(sid, position, token_ids=torch.tensor([feed])).hidden
            resp = middle.http.post(
                "/v1/forward",
                content=frame(acts),
                headers=headers(
                    sid, position, key=key, route=(TAIL_URL,),
                    opening=open_spec(2) if position == 0 else None,
                ),
            )  # fmt: skip
            tokens.append(assert_token(resp))
            position += len(feed)
            feed = [tokens[-1]]
    finally:
        first_layers.close_session(sid)
    assert tokens == expected
    assert tail.sessions.peek(sid).length == position
    # Closing at the middle frees the session on every later hop too.
    resp = middle.http.delete(
        f"/v1/sessions/{sid}", headers={H_SESSION_KEY: key, H_ROUTE: TAIL_URL}
    )
    assert resp.status_code == 200 and resp.json() == {"closed": sid}
    assert middle.sessions.peek(sid) is None
    assert tail.sessions.peek(sid) is None


def test_tail_step_returns_a_token(tail):
    resp = tail.http.post(
        "/v1/forward", content=frame(hidden(5)), headers=headers("tail-1", 0, opening=open_spec(4))
    )
    assert_token(resp)
    assert_token(step_tail(tail, "tail-1", 5))
    not_sampled = tail.http.post(
        "/v1/forward", content=frame(hidden(1)), headers=headers("tail-1", 6, sample=False)
    )
    assert not_sampled.status_code == 200
    assert not_sampled.json()["token_id"] is None
    assert (
        tail.http.delete("/v1/sessions/tail-1", headers={H_SESSION_KEY: "key"}).status_code == 200
    )


def test_tail_reports_logprobs_when_opened_with_them(tail):
    resp = tail.http.post(
        "/v1/forward",
        content=frame(hidden(2)),
        headers=headers("tail-lp", 0, opening=open_spec(4, logprobs=3)),
    )
    body = resp.json()
    assert_token(resp)
    assert body["logprob"] <= 0.0
    assert len(body["top_logprobs"]) == 3
    tail.http.delete("/v1/sessions/tail-lp", headers={H_SESSION_KEY: "key"})


def _bomb(shape: tuple[int, ...]) -> bytes:
    comp = zstandard.ZstdCompressor(level=1).compressobj(size=256 << 20)
    zeros = bytes(1 << 20)
    body = b"".join(comp.compress(zeros) for _ in range(256)) + comp.flush()
    head = wire.encode_tensor(torch.zeros(shape), wire.WireOptions(zstd_level=0))
    return head[: 8 + 4 * len(shape)] + body


def _with(**changes):
    """A bad request: start from a good decode step at position 3 and change one thing."""
    return changes


GOOD_STEP = frame(hidden(1, seed=99))
BAD_STEPS = {
    # name: (changes, expected status)
    "garbage body": (_with(body=b"this is not a tensor frame"), 400),
    "empty body": (_with(body=b""), 400),
    "truncated frame": (_with(body=GOOD_STEP[:-5]), 400),
    "truncated header": (_with(body=GOOD_STEP[:6]), 400),
    "wrong hidden size": (_with(body=frame(torch.zeros(1, 1, 32))), 400),
    "hidden not 3-d": (_with(body=frame(torch.zeros(1, HIDDEN))), 400),
    "batch of 2": (_with(body=frame(torch.zeros(2, 1, HIDDEN))), 400),
    "int64 to a non-head": (_with(body=frame(torch.zeros(1, 1, HIDDEN, dtype=torch.int64))), 400),
    "float16 hidden": (_with(body=frame(torch.zeros(1, 1, HIDDEN, dtype=torch.float16))), 400),
    "NaN hidden": (_with(body=frame(torch.full((1, 1, HIDDEN), float("nan")))), 400),
    "inf hidden": (_with(body=frame(torch.full((1, 1, HIDDEN), float("inf")))), 400),
    "zero tokens": (_with(body=frame(torch.zeros(1, 0, HIDDEN))), 400),
    "over a chunk": (_with(body=frame(torch.zeros(1, 129, HIDDEN))), 400),
    "missing session header": (_with(drop=H_SESSION), 400),
    "empty session header": (_with(set={H_SESSION: ""}), 400),
    "dot-dot session id": (_with(set={H_SESSION: ".."}), 400),
    "session id with a slash": (_with(set={H_SESSION: "a/b"}), 400),
    "overlong session id": (_with(set={H_SESSION: "s" * 129}), 400),
    "missing position header": (_with(drop=H_POSITION), 400),
    "bad position header": (_with(set={H_POSITION: "three"}), 400),
    "negative position": (_with(set={H_POSITION: "-1"}), 400),
    "bad chunk header": (_with(set={H_CHUNK: "1.5"}), 400),
    "bad route header": (_with(set={H_ROUTE: "ftp://elsewhere"}), 400),
    "malformed open header": (_with(set={H_OPEN: "{not json"}), 400),
    "open mid-session": (_with(set={H_OPEN: json.dumps(open_spec(4))}), 400),
    "position ahead": (_with(set={H_POSITION: "5"}), 409),
    "position behind": (_with(set={H_POSITION: "0"}), 409),
    "unknown session": (_with(set={H_SESSION: "no-such-session"}), 404),
    "another key": (_with(set={H_SESSION_KEY: "someone-else"}), 404),
    "no key": (_with(drop=H_SESSION_KEY), 404),
    "zstd bomb, small shape": (_with(body=_bomb((1, 1, HIDDEN))), 400),
    "zstd bomb, huge shape": (_with(body=_bomb((1, 1 << 20, HIDDEN))), 413),
}


@pytest.mark.parametrize("case", BAD_STEPS)
def test_bad_step_is_rejected_and_session_survives(tail, case):
    changes, status = BAD_STEPS[case]
    sid = "bad-" + "".join(c if c.isalnum() else "-" for c in case)
    open_tail_session(tail, sid)
    step = headers(sid, 3)
    if "drop" in changes:
        del step[changes["drop"]]
    step.update(changes.get("set", {}))
    resp = tail.http.post("/v1/forward", content=changes.get("body", GOOD_STEP), headers=step)
    assert_error(resp, status)
    # The session is exactly as before: the good step at position 3 still fits.
    assert tail.sessions.peek(sid).length == 3
    assert_token(step_tail(tail, sid, 3))
    assert (
        tail.http.delete(f"/v1/sessions/{sid}", headers={H_SESSION_KEY: "key"}).status_code == 200
    )


@pytest.mark.parametrize(
    "raw_open",
    [
        "{not json",
        "[1, 2]",
        '"text"',
        json.dumps({"temperature": 0.0, "bogus": 1}),
        json.dumps(open_spec(1)),  # start layer outside [4, 6)
        json.dumps(open_spec(6)),
        json.dumps({**open_spec(4), "start_layer": "4"}),
        json.dumps({**open_spec(4), "temperature": -1.0}),  # out of SamplingSpec's bounds
        json.dumps({**open_spec(4), "top_p": 0.0}),
    ],
)
def test_bad_open_header_opens_nothing(tail, raw_open):
    step = headers("open-bad", 0)
    step[H_OPEN] = raw_open
    assert_error(tail.http.post("/v1/forward", content=frame(hidden(2)), headers=step), 400)
    assert tail.sessions.peek("open-bad") is None


def test_opening_an_existing_session_conflicts(tail):
    open_tail_session(tail, "dup")
    resp = tail.http.post(
        "/v1/forward", content=frame(hidden(3)), headers=headers("dup", 0, opening=open_spec(4))
    )
    assert_error(resp, 409)
    assert tail.sessions.peek("dup").length == 3
    tail.http.delete("/v1/sessions/dup", headers={H_SESSION_KEY: "key"})


def test_session_is_bound_to_its_key(tail):
    open_tail_session(tail, "bound", key="owner")
    assert_error(step_tail(tail, "bound", 3, key="intruder"), 404)
    assert_error(step_tail(tail, "bound", 3, key=""), 404)
    resp = tail.http.delete("/v1/sessions/bound", headers={H_SESSION_KEY: "intruder"})
    assert_error(resp, 404)
    assert_error(tail.http.delete("/v1/sessions/bound"), 404)
    assert tail.sessions.peek("bound") is not None
    assert_token(step_tail(tail, "bound", 3, key="owner"))
    assert (
        tail.http.delete("/v1/sessions/bound", headers={H_SESSION_KEY: "owner"}).status_code == 200
    )


def test_a_link_probe_is_answered_without_a_failure_logged(tail, caplog):
    """The previous hop's link probes (twice a heartbeat) close a session nobody opened: 200,
    and nothing logged at INFO, where a 404 would log a failure each time."""
    with caplog.at_level(logging.INFO):
        resp = tail.http.delete(f"/v1/sessions/{LINK_PROBE_SESSION}")
    assert resp.status_code == 200 and resp.json() == {"probe": True}
    assert not [r for r in caplog.records if r.name.startswith("meshnet")]
    open_tail_session(tail, LINK_PROBE_SESSION)  # a session of that name is closed as any
    resp = tail.http.delete(f"/v1/sessions/{LINK_PROBE_SESSION}", headers={H_SESSION_KEY: "key"})
    assert resp.json() == {"closed": LINK_PROBE_SESSION}
    assert tail.sessions.peek(LINK_PROBE_SESSION) is None


def test_delete_frees_the_session(tail):
    open_tail_session(tail, "freed")
    held = tail.sessions.tokens_held
    resp = tail.http.delete("/v1/sessions/freed", headers={H_SESSION_KEY: "key"})
    assert resp.status_code == 200 and resp.json() == {"closed": "freed"}
    assert tail.sessions.peek("freed") is None
    assert tail.sessions.tokens_held == held - 3
    assert_error(step_tail(tail, "freed", 3), 404)
    assert_error(tail.http.delete("/v1/sessions/freed", headers={H_SESSION_KEY: "key"}), 404)
    open_tail_session(tail, "freed")  # the id can be reused
    tail.http.delete("/v1/sessions/freed", headers={H_SESSION_KEY: "key"})
    assert_error(tail.http.delete("/v1/sessions/a.b", headers={H_SESSION_KEY: "key"}), 400)


def test_body_over_the_limit_is_413(small_tail):
    open_tail_session(small_tail, "small")
    big = frame(hidden(20))  # 5120 bytes of float32, zstd makes it no smaller
    assert len(big) > 4096
    assert_error(small_tail.http.post("/v1/forward", content=big, headers=headers("small", 3)), 413)

    def chunks():  # no content-length: the limit is enforced while reading
        yield big[:3000]
        yield big[3000:]

    resp = small_tail.http.post("/v1/forward", content=chunks(), headers=headers("small", 3))
    assert_error(resp, 413)
    # Small on the wire, too large once decoded: the decoded size is bounded as well.
    compressed = wire.encode_tensor(torch.zeros(1, 20, HIDDEN))
    assert len(compressed) < 4096
    assert_error(
        small_tail.http.post("/v1/forward", content=compressed, headers=headers("small", 3)), 413
    )
    assert_token(step_tail(small_tail, "small", 3))


def test_downstream_errors_are_relayed(middle, tail):
    sid = "relay-err"
    resp = middle.http.post(
        "/v1/forward",
        content=frame(hidden(2)),
        headers=headers(sid, 0, route=(TAIL_URL,), opening=open_spec(2)),
    )
    assert_token(resp)
    tail.http.delete(f"/v1/sessions/{sid}", headers={H_SESSION_KEY: "key"})
    resp = middle.http.post(
        "/v1/forward", content=frame(hidden(1)), headers=headers(sid, 2, route=(TAIL_URL,))
    )
    error = assert_error(resp, 404)
    assert "unknown session" in error["message"]
    resp = middle.http.post(
        "/v1/forward",
        content=frame(hidden(1)),
        headers=headers("unreachable", 0, route=("http://nowhere.test",), opening=open_spec(2)),
    )
    assert assert_error(resp, 502)["code"] == "hop_failed"
    for sid in ("relay-err", "unreachable"):
        middle.http.delete(f"/v1/sessions/{sid}", headers={H_SESSION_KEY: "key"})


def test_tail_rejects_a_route_before_running(tail):
    sid = "tail-route"
    step = headers(sid, 0, route=(TAIL_URL,), opening=open_spec(4))
    assert_error(tail.http.post("/v1/forward", content=frame(hidden(3)), headers=step), 400)
    session = tail.sessions.peek(sid)
    try:
        assert session is None or session.length == 0
    finally:
        tail.sessions.close(sid)


def test_middle_rejects_a_missing_route_before_running(middle):
    sid = "middle-noroute"
    step = headers(sid, 0, opening=open_spec(2))
    assert_error(middle.http.post("/v1/forward", content=frame(hidden(3)), headers=step), 400)
    session = middle.sessions.peek(sid)
    try:
        assert session is None or session.length == 0
    finally:
        middle.sessions.close(sid)


# -- OpenAI endpoints on a head+tail node --------------------------------------------------


def greedy_text(tokenizer, reference, prompt_ids: list[int], max_tokens: int) -> str:
    tokens, _ = hf_chunked_greedy(reference, prompt_ids, max_tokens)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    # A random model can emit lone UTF-8 bytes; those prompts would make text a weak check.
    assert text and "\ufffd" not in text, f"pick another prompt: {text!r}"
    return text


def greedy_logprobs(reference, prompt_ids: list[int], max_tokens: int) -> list[float]:
    tokens, logits = hf_chunked_greedy(reference, prompt_ids, max_tokens)
    return [float(torch.log_softmax(lg, -1)[t]) for t, lg in zip(tokens, logits, strict=True)]


def sse_events(resp: httpx.Response) -> list[str]:
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in resp.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line.removeprefix("data: ") for line in lines]


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_completion_matches_reference(whole, tokenizer, reference):
    prompt = "The capital of France is"
    resp = whole.http.post(
        "/v1/completions", json={"model": MODEL_ID, "prompt": prompt, "max_tokens": 16, **GREEDY}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    ids = tokenizer(prompt).input_ids
    assert body["object"] == "text_completion" and body["model"] == MODEL_ID
    assert body["choices"][0]["text"] == greedy_text(tokenizer, reference, ids, 16)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 16,
        "total_tokens": len(ids) + 16,
    }
    assert len(whole.sessions) == 0


def test_long_token_prompt_matches_reference(whole, tokenizer, reference):
    prompt = [(i * 37) % 400 + 5 for i in range(300)]  # three prefill chunks
    request = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 8, "logprobs": 1, **GREEDY}
    resp = whole.http.post("/v1/completions", json=request)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["text"] == greedy_text(tokenizer, reference, prompt, 8)
    got = choice["logprobs"]["token_logprobs"]
    assert got == pytest.approx(greedy_logprobs(reference, prompt, 8), abs=1e-4)


def test_chain_of_three_nodes_matches_reference(chain_head, middle, tail, tokenizer, reference):
    prompt = [(i * 41) % 400 + 5 for i in range(300)]  # pipelined prefill across the chain
    request = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 8, "logprobs": 1, **GREEDY}
    nodes = (chain_head, middle, tail)
    held = [len(n.sessions) for n in nodes]
    resp = chain_head.http.post("/v1/completions", json=request)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["text"] == greedy_text(tokenizer, reference, prompt, 8)
    got = choice["logprobs"]["token_logprobs"]
    assert got == pytest.approx(greedy_logprobs(reference, prompt, 8), abs=1e-4)
    assert [len(n.sessions) for n in nodes] == held  # every hop's session was freed


def test_a_decode_step_meets_torch_only_on_the_compute_thread(
    chain_head, middle, tail, tokenizer, reference, monkeypatch
):
    """A decode step's input becomes a tensor, and its output the next hop's frame, on the
    compute thread of each node: the event loop, whose caches a pass emptied, makes no
    torch call for them (docs/adr/0011). The tokens stay the reference's."""
    made, encoded = [], []
    make, encode = wire.WireTensor.tensor, wire.encode_tensor

    def recording_make(self):
        made.append((self.shape, threading.current_thread().name))
        return make(self)

    def recording_encode(tensor, options=wire.WireOptions()):
        encoded.append((tuple(tensor.shape), threading.current_thread().name))
        return encode(tensor, options)

    monkeypatch.setattr(wire.WireTensor, "tensor", recording_make)
    monkeypatch.setattr(wire, "encode_tensor", recording_encode)
    prompt = [(i * 31) % 400 + 5 for i in range(40)]
    request = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 5, **GREEDY}
    resp = chain_head.http.post("/v1/completions", json=request)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == greedy_text(tokenizer, reference, prompt, 5)
    one_row = [t for shape, t in made if shape[1:2] == (1,)]
    # 4 decode steps, each made on the head (its token) and on the two hops after it
    assert len(one_row) == 12 and set(one_row) == {"compute"}
    encoded_rows = [t for shape, t in encoded if shape[1:2] == (1,)]
    assert len(encoded_rows) == 8 and set(encoded_rows) == {"compute"}  # head and middle


@pytest.mark.parametrize(("length", "call", "scored"), [(300, None, False), (700, 256, False),
                                                        (300, None, True)])  # fmt: skip
def test_a_prompt_is_computed_in_its_calls_on_every_hop(
    chain_head, middle, tail, tokenizer, reference, monkeypatch, length, call, scored
):  # fmt: skip
    """A prompt travels in 128-token wire chunks, but every hop computes it in the calls its
    head chose (ADR-0053): the whole prompt in one call, as the unsplit model does (up to
    ``--prompt-call-tokens``: a shorter call cuts it from its start on every hop alike); a
    scored one (``echo`` with ``logprobs``) all its rows but the last in one, as a scorer's
    forward, then its last row alone (a pass of one row, not recorded here)."""
    nodes = (chain_head, middle, tail)
    passes: dict[int, list[tuple[int, int]]] = {i: [] for i in range(3)}
    for i, node in enumerate(nodes):
        stage = node.runtime.service.stage
        real = stage.stepping  # every pass (``step`` runs it whole)

        def spy(session_id, position, *, _real=real, _i=i, **kw):
            tensor = kw["token_ids"] if kw.get("token_ids") is not None else kw["hidden"]
            if tensor.shape[1] > 1:  # (1, T) ids or (1, T, H) hidden: a prompt's pass
                passes[_i].append((position, tensor.shape[1]))
            return _real(session_id, position, **kw)

        monkeypatch.setattr(stage, "stepping", spy)
    if call is not None:
        monkeypatch.setattr(chain_head.runtime.service.stage, "prompt_call_tokens", call)
    prompt = [(i * 29) % 400 + 5 for i in range(length)]
    request = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 4, **GREEDY}
    if scored:
        request.update(echo=True, logprobs=1)
    resp = chain_head.http.post("/v1/completions", json=request)
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["text"]
    assert text.endswith(greedy_text(tokenizer, reference, prompt, 4))
    cut = call or length
    want = [(lo, min(cut, length - lo)) for lo in range(0, length, cut)]
    if scored:
        want = [(0, length - 1)]
    assert passes == {0: want, 1: want, 2: want}


class AlwaysDraft(DraftPolicy):
    """Always 4 drafts (in-process steps are too fast for the real policy to find drafting
    worth it)."""

    def choose(self, acceptance, steps):
        return 4


@pytest.mark.parametrize("node", ["whole", "chain_head"])
def test_speculative_greedy_equals_plain_decoding(node, request, tokenizer, reference):
    """Drafts looked up in a repetitive text, verified by the chain (the tail keeps some,
    every hop rewinds past the rest): the text is the unsplit model's greedy text."""
    head = request.getfixturevalue(node)
    generator = head.runtime.openai.generator
    metrics = head.runtime.service.metrics
    prompt = [(i % 7) * 11 + 5 for i in range(70)]  # a phrase repeated
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 40, "logprobs": 1, **GREEDY}
    policy, generator.draft_policy = generator.draft_policy, AlwaysDraft()
    before = (metrics.draft_tokens._value.get(), metrics.accepted_tokens._value.get())
    try:
        resp = head.http.post("/v1/completions", json=body)
    finally:
        generator.draft_policy = policy
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["text"] == greedy_text(tokenizer, reference, prompt, 40)
    got = choice["logprobs"]["token_logprobs"]
    assert got == pytest.approx(greedy_logprobs(reference, prompt, 40), abs=1e-4)
    drafted = metrics.draft_tokens._value.get() - before[0]
    accepted = metrics.accepted_tokens._value.get() - before[1]
    assert drafted > 0 and 0 < accepted <= drafted
    sampled = {**body, "temperature": 0.8, "seed": 3}  # greedy mode: sampled ones don't draft
    generator.draft_policy = AlwaysDraft()
    try:
        assert head.http.post("/v1/completions", json=sampled).status_code == 200
    finally:
        generator.draft_policy = policy
    assert metrics.draft_tokens._value.get() - before[0] == drafted


def test_the_tail_answers_the_head_directly(chain_head, middle, tail, tokenizer, reference):
    """Over two hops the tail posts each sampled token straight to the head, which takes
    whichever answer comes first; a tail that cannot reach the head answers through the
    chain only, for a while, and the text is the same either way."""
    prompt = [(i * 31) % 400 + 5 for i in range(40)]
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 12, "logprobs": 1, **GREEDY}
    want = greedy_text(tokenizer, reference, prompt, 12)
    head_url = chain_head.runtime.service.answer_url
    assert head_url and urlsplit(head_url).hostname == "127.0.0.1"
    direct = chain_head.runtime.service.metrics.direct_answers
    links = tail.runtime.service.links
    hops, links._unreachable_heads = links.hops, {}
    before = direct._value.get()
    try:
        links.hops = HttpxHops(httpx.AsyncClient(transport=AppsTransport({})))  # no head
        resp = chain_head.http.post("/v1/completions", json=body)
        assert resp.json()["choices"][0]["text"] == want
        assert head_url in links._unreachable_heads
        assert direct._value.get() == before
        links._unreachable_heads.clear()
        peers = {"127.0.0.1": chain_head.app}
        links.hops = HttpxHops(httpx.AsyncClient(transport=AppsTransport(peers)))
        resp = chain_head.http.post("/v1/completions", json=body)
    finally:
        links.hops = hops
    choice = resp.json()["choices"][0]
    assert choice["text"] == want
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        greedy_logprobs(reference, prompt, 12), abs=1e-4
    )
    assert direct._value.get() - before >= 6  # (the chain's answer may still win a few)
    assert not tail.runtime.service.links._unreachable_heads
    timing = resp.json().get("meshnet_timing") or {}
    assert timing.get("hops") == 2


def test_a_node_times_the_links_it_is_told_to_and_reports_them(middle, chain_head):
    """The next hops the tracker names are timed over the data path (a close of a session
    that does not exist) and reported in heartbeats with the compute per layer."""
    links = middle.runtime.service.links
    links.set_probe_urls((TAIL_URL, "http://nowhere.test"))
    middle.http.portal.call(links.probe_links)
    assert set(links.rtt_ms) == {TAIL_URL}  # an unreachable hop reports nothing
    assert 0 < links.rtt_ms[TAIL_URL] < 5000
    chain_head.http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "Hi",
                                                  "max_tokens": 3, **GREEDY})  # fmt: skip
    beat = middle.runtime.heartbeat()
    assert beat.links == {TAIL_URL: pytest.approx(links.rtt_ms[TAIL_URL], abs=1e-3)}
    assert beat.layer_ms is not None and beat.layer_ms > 0
    links.set_probe_urls(())
    middle.http.portal.call(links.probe_links)
    assert links.rtt_ms == {}


def test_a_head_reports_the_step_time_of_its_route(chain_head):
    """Plain decode steps (sampled: no drafts, no guesses) are timed per route and reported
    in the head's heartbeats, for the tracker to hold against the hops' claims (ADR-0032)."""
    body = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 12, "temperature": 0.8, "seed": 1,
            "ignore_eos": True}  # fmt: skip
    assert chain_head.http.post("/v1/completions", json=body).status_code == 200
    reported = {r.hops: r.step_ms for r in chain_head.runtime.heartbeat().route_times}
    assert 0 < reported[(MIDDLE_URL, TAIL_URL)] < 60_000


def test_direct_answers_are_checked(chain_head):
    """The answer route: only a step that waits, with its session key, takes an answer."""
    post = chain_head.http.post
    url = "/v1/answers/abcdef0123"
    missing = post(url, content=b"{}", headers={"x-meshnet-position": "3"})
    assert assert_error(missing, 404)["type"] == "not_found_error"
    bad = post(url, content=b"{}", headers={"x-meshnet-position": "x"})
    assert assert_error(bad, 400)["param"] == "x-meshnet-position"
    assert assert_error(post("/v1/answers/not%20an%20id", content=b"{}",
                             headers={"x-meshnet-position": "1"}), 400)  # fmt: skip


@pytest.mark.parametrize("draft", ["same", "smaller"])
def test_a_draft_model_proposes_the_drafts(draft, snapshot, tmp_path, tokenizer, reference):
    """--draft-model: the same model as its own draft has every draft accepted; a smaller
    random one fewer; the text is the unsplit model's greedy text either way."""
    from meshnet_common.tiny.snapshots import make_tiny

    path = snapshot if draft == "same" else make_tiny(
        tmp_path, "llama", "meshnet-tiny/llama-draft", layers=2, seed=1
    )  # fmt: skip
    prompt = [(i * 13) % 400 + 5 for i in range(30)]
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 16, **GREEDY}
    with running(settings_for(snapshot, 0, 6, draft_model=str(path))) as node:
        generator = node.runtime.openai.generator
        assert generator.draft_model is not None
        generator.draft_policy = AlwaysDraft()
        metrics = node.runtime.service.metrics
        resp = node.http.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == greedy_text(tokenizer, reference, prompt, 16)
        drafted = metrics.draft_tokens._value.get()
        accepted = metrics.accepted_tokens._value.get()
    assert drafted > 0 and accepted <= drafted
    if draft == "same":
        assert accepted == drafted


def test_a_draft_model_must_share_the_tokenizer(snapshot, tmp_path):
    import shutil

    from meshnet_common.errors import ModelError

    other = tmp_path / "other"
    shutil.copytree(snapshot, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelError, match="tokenizer"):
        build_runtime(settings_for(snapshot, 0, 6, draft_model=str(other)))
    with pytest.raises(ModelError, match="no such folder"):
        build_runtime(settings_for(snapshot, 0, 6, draft_model=str(tmp_path / "none")))


def chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is the capital of Italy?"},
]


def test_chat_completion_matches_reference(whole, tokenizer, reference):
    resp = whole.http.post(
        "/v1/chat/completions",
        json={"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 12, **GREEDY},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"] == greedy_text(tokenizer, reference, chat_ids(tokenizer, MESSAGES), 12)  # fmt: skip


def test_completion_stream_ends_with_done_and_matches(whole, tokenizer, reference):
    prompt = "Once upon a time"
    request = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 10, "stream": True, **GREEDY}
    request["stream_options"] = {"include_usage": True}
    events = sse_events(whole.http.post("/v1/completions", json=request))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids = tokenizer(prompt).input_ids
    assert text == greedy_text(tokenizer, reference, ids, 10)
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_chat_stream_ends_with_done_and_matches(whole, tokenizer, reference):
    request = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 10, "stream": True, **GREEDY}
    events = sse_events(whole.http.post("/v1/chat/completions", json=request))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == greedy_text(tokenizer, reference, chat_ids(tokenizer, MESSAGES), 10)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_models_lists_the_served_model(whole):
    body = whole.http.get("/v1/models").json()
    assert [m["id"] for m in body["data"]] == [MODEL_ID]


BASE = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4}
BAD_COMPLETIONS = {
    "unknown model": ({**BASE, "model": "org/other"}, 404, "model"),
    "no model": ({"prompt": "Hello"}, 400, "model"),
    "no prompt": ({"model": MODEL_ID}, 400, "prompt"),
    "empty prompt": ({**BASE, "prompt": ""}, 400, "prompt"),
    "prompt of dicts": ({**BASE, "prompt": [{"a": 1}]}, 400, None),
    "token id out of vocab": ({**BASE, "prompt": [1, 2, 10**6]}, 400, "prompt"),
    "negative token id": ({**BASE, "prompt": [-1]}, 400, "prompt"),
    "temperature too high": ({**BASE, "temperature": 5}, 400, "temperature"),
    "top_p zero": ({**BASE, "top_p": 0}, 400, "top_p"),
    "top_k below -1": ({**BASE, "top_k": -2}, 400, "top_k"),
    "suffix": ({**BASE, "suffix": "end"}, 400, "suffix"),
    "best_of above n": ({**BASE, "best_of": 3}, 400, "best_of"),
    "an unknown field": ({**BASE, "frobnicate": 1}, 400, "frobnicate"),
    "stream_options without stream": (
        {**BASE, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    "presence_penalty 3": ({**BASE, "presence_penalty": 3}, 400, "presence_penalty"),
    "repetition_penalty 0": ({**BASE, "repetition_penalty": 0}, 400, "repetition_penalty"),
    "min_p 2": ({**BASE, "min_p": 2}, 400, "min_p"),
    "logit_bias a word": ({**BASE, "logit_bias": {"hello": 5}}, 400, "logit_bias"),
    "logit_bias out of vocab": ({**BASE, "logit_bias": {"999999": 5}}, 400, "logit_bias"),
    "logit_bias 101": ({**BASE, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    "stop_token_ids out of vocab": ({**BASE, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    "empty token-id prompt": ({**BASE, "prompt": [[1, 2], []]}, 400, "prompt"),
    "max_tokens zero": ({**BASE, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens a string": ({**BASE, "max_tokens": "ten"}, 400, "max_tokens"),
    "max_tokens a bool": ({**BASE, "max_tokens": True}, 400, "max_tokens"),
    "max_tokens past context": ({**BASE, "max_tokens": 5000}, 400, "max_tokens"),
    "n zero": ({**BASE, "n": 0}, 400, "n"),
    "n nine": ({**BASE, "n": 9}, 400, "n"),
    "five stops": ({**BASE, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    "empty stop": ({**BASE, "stop": [""]}, 400, "stop"),
    "logprobs 6": ({**BASE, "logprobs": 6}, 400, "logprobs"),
    "prompt past context": ({**BASE, "prompt": [5] * 1024}, 400, "prompt"),
}


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS.values(), ids=BAD_COMPLETIONS.keys())  # fmt: skip
def test_bad_completion_requests(whole, body, status, param):
    error = assert_error(whole.http.post("/v1/completions", json=body), status)
    if param is not None:
        assert error["param"] == param
    assert len(whole.sessions) == 0


CHAT = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 4}
BAD_CHATS = {
    "unknown model": ({**CHAT, "model": "org/other"}, 404),
    "no messages": ({**CHAT, "messages": []}, 400),
    "messages not a list": ({**CHAT, "messages": "hi"}, 400),
    "bad role": ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    "top_logprobs 21": ({**CHAT, "logprobs": True, "top_logprobs": 21}, 400),
    "negative temperature": ({**CHAT, "temperature": -0.5}, 400),
    "tools": ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    "json_schema without a schema": ({**CHAT, "response_format": {"type": "json_schema"}}, 400),
    "an unknown response format": ({**CHAT, "response_format": {"type": "yaml"}}, 400),
    "an image part": (
        {
            **CHAT,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
                    ],
                }
            ],
        },
        400,
    ),
    "audio out": ({**CHAT, "modalities": ["text", "audio"]}, 400),
    "both template flags": ({**CHAT, "continue_final_message": True}, 400),
    "template kwargs tokenize": ({**CHAT, "chat_template_kwargs": {"tokenize": False}}, 400),
}


@pytest.mark.parametrize(("body", "status"), BAD_CHATS.values(), ids=BAD_CHATS.keys())
def test_bad_chat_requests(whole, body, status):
    assert_error(whole.http.post("/v1/chat/completions", json=body), status)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_unparseable_bodies_are_400(whole, path, raw):
    resp = whole.http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(resp, 400, "invalid_request_error")


def test_node_keeps_serving_after_errors(whole):
    whole.http.post("/v1/completions", content=b"{oops")
    whole.http.post("/v1/completions", json={**BASE, "model": "org/other"})
    resp = whole.http.post("/v1/completions", json={**BASE, **GREEDY})
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 4
    assert len(whole.sessions) == 0


def test_json_bodies_have_a_size_limit_and_a_media_type(tiny_snapshot):
    settings = NodeSettings(
        model_id="meshnet-tiny/llama",
        model_path=tiny_snapshot("llama"),
        layers=LayerRange(0, 6),
        quantization=Precision.FLOAT32,
        max_request_mb=1024 / 2**20,
    )

    async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
        return ()

    with TestClient(create_app(build_runtime(settings, route_provider=no_route))) as client:
        big = {"model": "meshnet-tiny/llama", "prompt": "x" * 5000, "max_tokens": 1}
        resp = client.post("/v1/completions", json=big)
        assert resp.status_code == 413 and resp.json()["error"]["message"]
        form = client.post(
            "/v1/completions", content=b"model=x", headers={"content-type": "text/plain"}
        )
        assert form.status_code == 415 and form.json()["error"]["param"] == "content-type"
        ok = client.post("/v1/completions", json={"model": "meshnet-tiny/llama", "prompt": "hi",
                                                  "max_tokens": 2})  # fmt: skip
        assert ok.status_code == 200


# -- sampling fields: penalties, bias, stops, defaults --------------------------------------


def _penalised_greedy(reference, prompt_ids, steps, *, rep=1.0, presence=0.0, frequency=0.0):
    """Greedy decoding by the unsplit model with vLLM's penalties written out here."""
    ids = list(prompt_ids)
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = reference(torch.tensor([ids])).logits[0, -1].float()
            if rep != 1.0:
                seen = torch.tensor(sorted(set(ids)))
                picked = logits[seen]
                logits[seen] = torch.where(picked > 0, picked / rep, picked * rep)
            if out:
                counts = torch.bincount(torch.tensor(out), minlength=logits.numel()).float()
                logits = logits - frequency * counts - presence * (counts > 0).float()
            token = int(torch.argmax(logits))
            out.append(token)
            ids.append(token)
    return out


PENALTY_PROMPT = [(i * 7) % 50 + 5 for i in range(150)]  # repetitive: the penalties bite


def _text(tokenizer, ids) -> str:
    """What the server sends for ``ids``: a character left unfinished at the end is held."""
    return tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def test_repetition_penalty_matches_hf_generate_across_three_nodes(
    chain_head, tokenizer, reference
):
    """The tail counts prompt and output ids that reach it in each step's ids header."""
    ids = torch.tensor([PENALTY_PROMPT])
    want = reference.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
        repetition_penalty=1.8,
    )[0, ids.shape[1] :].tolist()  # fmt: skip
    plain = _penalised_greedy(reference, PENALTY_PROMPT, 10)
    assert want != plain  # the penalty changes the text, so the check means something
    body = {"model": MODEL_ID, "prompt": PENALTY_PROMPT, "max_tokens": 10, "logprobs": 0,
            "repetition_penalty": 1.8, **GREEDY}  # fmt: skip
    choice = chain_head.http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == _text(tokenizer, want)


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.2), (0.5, 0.8)])
def test_presence_and_frequency_penalties(chain_head, whole, reference, tokenizer, presence,
                                          frequency):  # fmt: skip
    want = _penalised_greedy(reference, PENALTY_PROMPT, 10, presence=presence, frequency=frequency)
    body = {"model": MODEL_ID, "prompt": PENALTY_PROMPT, "max_tokens": 10, **GREEDY,
            "presence_penalty": presence, "frequency_penalty": frequency}  # fmt: skip
    for node in (chain_head, whole):  # over hops, and with head and tail in one
        choice = node.http.post("/v1/completions", json=body).json()["choices"][0]
        assert choice["text"] == _text(tokenizer, want)


def test_logit_bias_and_stop_token_ids(whole, reference, tokenizer):
    forced = 77
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 5, **GREEDY,
            "logit_bias": {str(forced): 100}}  # fmt: skip
    choice = whole.http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == _text(tokenizer, [forced] * 5)
    plain = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 6, **GREEDY}
    tokens, _ = hf_chunked_greedy(reference, tokenizer("Hello").input_ids, 6)
    stop_at = tokens[3]
    cut = tokens.index(stop_at)
    stopped = whole.http.post(
        "/v1/completions", json={**plain, "stop_token_ids": [stop_at]}
    ).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == _text(tokenizer, tokens[:cut])


def test_top_k_minus_one_and_min_p_are_honoured(whole):
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4, "temperature": 1.0,
            "seed": 5}  # fmt: skip
    a = whole.http.post("/v1/completions", json={**body, "top_k": -1}).json()
    b = whole.http.post("/v1/completions", json={**body, "top_k": 0}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # both mean no limit
    greedy = whole.http.post("/v1/completions", json={**body, **GREEDY}).json()
    only_top = whole.http.post("/v1/completions", json={**body, "min_p": 1.0}).json()
    assert only_top["choices"][0]["text"] == greedy["choices"][0]["text"]  # min_p 1: argmax


def test_default_max_tokens_follow_openai(whole, tokenizer):
    plain = {"model": MODEL_ID, "prompt": "Hello", "ignore_eos": True, **GREEDY}
    body = whole.http.post("/v1/completions", json=plain).json()
    assert body["usage"]["completion_tokens"] == 16  # completions: 16, as OpenAI and vLLM
    request = ChatCompletionRequest(model=MODEL_ID, messages=MESSAGES)
    job = whole.runtime.openai.chat_jobs(request)[0]
    assert job.max_tokens == whole.runtime.service.stage.max_positions - len(job.prompt_ids)


def test_generation_config_defaults_apply_when_the_request_is_silent():
    from transformers import GenerationConfig

    from meshnet_common.openai_protocol import CompletionRequest
    from meshnet_node.head.params import sampling_defaults, sampling_spec

    defaults = sampling_defaults(GenerationConfig(temperature=0.6, top_p=0.95, top_k=20))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    quiet = CompletionRequest(model=MODEL_ID, prompt="x")
    spec = sampling_spec(quiet, defaults=defaults, vocab_size=512, seed=None, logprobs=0,
                         prompt_tokens=1)  # fmt: skip
    assert (spec.temperature, spec.top_p, spec.top_k) == (0.6, 0.95, 20)
    loud = CompletionRequest(model=MODEL_ID, prompt="x", temperature=0.0, top_k=-1)
    spec = sampling_spec(loud, defaults=defaults, vocab_size=512, seed=None, logprobs=0,
                         prompt_tokens=1)  # fmt: skip
    assert (spec.temperature, spec.top_p, spec.top_k) == (0.0, 0.95, 0)
    none = sampling_spec(quiet, defaults={}, vocab_size=512, seed=None, logprobs=0,
                         prompt_tokens=1)  # fmt: skip
    assert (none.temperature, none.top_p) == (1.0, 1.0)  # OpenAI's defaults


def test_prompts_as_lists_of_token_ids(whole, tokenizer, reference):
    a, b = [(i * 3) % 90 + 5 for i in range(20)], [(i * 5) % 90 + 7 for i in range(30)]
    body = {"model": MODEL_ID, "prompt": [a, b], "max_tokens": 4, **GREEDY}
    choices = whole.http.post("/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in choices] == [
        _text(tokenizer, hf_chunked_greedy(reference, p, 4)[0]) for p in (a, b)
    ]


def test_chat_template_flags_shape_the_prompt(whole, tokenizer):
    serving = whole.runtime.openai
    base = ChatCompletionRequest(model=MODEL_ID, messages=MESSAGES)
    with_prompt = serving.chat_jobs(base)[0].prompt_ids
    without = serving.chat_jobs(base.model_copy(update={"add_generation_prompt": False}))
    assert with_prompt[: len(without[0].prompt_ids)] == without[0].prompt_ids
    assert len(with_prompt) > len(without[0].prompt_ids)  # "<|im_start|>assistant\n"
    partial = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    cont = ChatCompletionRequest(model=MODEL_ID, messages=partial, add_generation_prompt=False,
                                 continue_final_message=True)  # fmt: skip
    text = tokenizer.decode(serving.chat_jobs(cont)[0].prompt_ids)
    assert text.endswith("The capital is")  # the reply continues, no end-of-turn
    tool = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]  # fmt: skip
    assert serving.chat_jobs(ChatCompletionRequest(model=MODEL_ID, messages=tool))


def test_logprobs_zero_and_echo(whole, tokenizer):
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 3, **GREEDY, "logprobs": 0}
    choice = whole.http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == 3 and all(len(t) == 1 for t in lp["top_logprobs"])
    assert [next(iter(t.values())) for t in lp["top_logprobs"]] == lp["token_logprobs"]
    plain = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 3, **GREEDY}
    text = whole.http.post("/v1/completions", json=plain).json()["choices"][0]["text"]
    echoed = whole.http.post("/v1/completions", json={**plain, "echo": True}).json()
    prompt = tokenizer.decode(tokenizer("Hello").input_ids, skip_special_tokens=True)
    assert echoed["choices"][0]["text"] == prompt + text


def prompt_logprobs(reference, prompt_ids: list[int], top: int):
    """The unsplit model's score of each prompt token after the ones before it, and the
    ``top`` best ids at each position: from its forward of every token but the last, as a
    scorer (lm-evaluation-harness's HF backend) runs it, and as meshnet cuts a scored
    prompt's first call (ADR-0053 decision 5). Its forward of all the tokens gives those
    rows other bits where a product's rounding depends on the row count (float32 on an AMD
    EPYC Zen 4: row 162 of 300 here)."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt_ids[:-1]])).logits[0].float()
    rows = torch.log_softmax(logits, -1)
    chosen = rows.gather(1, torch.tensor(prompt_ids[1:]).unsqueeze(1)).reshape(-1)
    return chosen.tolist(), torch.topk(rows, top, dim=-1).indices.tolist()


@pytest.mark.parametrize("node", ["whole", "chain_head"])
def test_echo_with_logprobs_scores_the_prompt(node, request, tokenizer, reference):
    """The prompt's own log-probabilities, computed on the tail (300 tokens: three wire
    chunks, through three nodes), equal the unsplit model's forward of all its tokens but
    the last bit for bit: every hop gathers the chunks and computes them in one call, as a
    scorer's forward does (ADR-0053)."""
    head = request.getfixturevalue(node)
    prompt = [(i * 43) % 400 + 5 for i in range(300)]
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 4, "logprobs": 2, "echo": True,
            **GREEDY}  # fmt: skip
    resp = head.http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want, best = prompt_logprobs(reference, prompt, 2)
    assert lp["token_logprobs"][1 : len(prompt)] == want
    tops = lp["top_logprobs"][1 : len(prompt)]
    for k, top in enumerate(tops):  # the two best, plus the prompt token itself
        assert {tokenizer.decode([i]) for i in best[k]} <= set(top)
        key = tokenizer.decode([prompt[k + 1]])
        if all(tokenizer.decode([i]) != key for i in best[k] if i != prompt[k + 1]):
            assert top[key] == pytest.approx(want[k], abs=1e-4)  # (no other id's text)
    generated = lp["token_logprobs"][len(prompt) :]
    assert generated == pytest.approx(greedy_logprobs(reference, prompt, 4), abs=1e-4)
    text = choice["text"]
    ends = [o + len(t) for o, t in zip(lp["text_offset"], _piece_texts(lp, text), strict=True)]
    assert lp["text_offset"][0] == 0 and ends[-1] == len(text)
    assert text.startswith(tokenizer.decode(prompt, skip_special_tokens=True))


def _piece_texts(lp: dict, text: str) -> list[str]:
    offsets = [*lp["text_offset"], len(text)]
    return [text[a:b] for a, b in zip(offsets, offsets[1:], strict=False)]


def test_echo_with_max_tokens_zero_only_scores(whole, tokenizer, reference):
    prompt = "The capital of France is"
    ids = tokenizer(prompt).input_ids
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    out = whole.http.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    want, _ = prompt_logprobs(reference, ids, 1)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    assert all(t is None or len(t) == 1 for t in choice["logprobs"]["top_logprobs"])
    streamed = _events(whole.http.post("/v1/completions", json={**body, "stream": True}))
    assert len(streamed) == 1 and streamed[0]["choices"][0]["text"] == choice["text"]
    assert streamed[0]["choices"][0]["logprobs"] == choice["logprobs"]
    no_echo = whole.http.post("/v1/completions", json={**body, "echo": False})
    assert assert_error(no_echo, 400)["param"] == "max_tokens"
    assert len(whole.sessions) == 0


def test_echo_stream_offsets_continue_after_the_prompt(whole):
    body = {"model": MODEL_ID, "prompt": "Hello there", "max_tokens": 3, "echo": True,
            "logprobs": 1, "stream": True, **GREEDY}  # fmt: skip
    chunks = _events(whole.http.post("/v1/completions", json=body))
    whole_text = "".join(c["choices"][0]["text"] for c in chunks)
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and offsets[0] == 0
    first = chunks[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"][0] is None and len(chunks) == 4
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [len(first["text"])]
    whole_body = {**body, "stream": False}
    assert whole.http.post("/v1/completions", json=whole_body).json()["choices"][0][
        "text"] == whole_text  # fmt: skip


def _events(resp) -> list[dict]:
    lines = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


def test_stream_usage_and_text_offsets(whole):
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 5, **GREEDY, "logprobs": 1,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = _events(whole.http.post("/v1/completions", json=body))
    *tokens, last = chunks
    assert all(c["usage"] is None for c in tokens) and last["choices"] == []
    assert last["usage"]["completion_tokens"] == 5
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in tokens]
    texts = [c["choices"][0]["text"] for c in tokens]
    assert offsets == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    running = {**body, "stream_options": {"continuous_usage_stats": True}}
    counted = _events(whole.http.post("/v1/completions", json=running))
    assert [c["usage"]["completion_tokens"] for c in counted] == [1, 2, 3, 4, 5]
    chat = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 3, **GREEDY, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    *deltas, final = _events(whole.http.post("/v1/chat/completions", json=chat))
    assert all(c["usage"] is None for c in deltas) and final["usage"]["completion_tokens"] == 3


def test_served_names_and_max_model_len(snapshot):
    settings = settings_for(snapshot, 0, 6, served_model_name=("tiny", "tiny-chat"),
                            max_model_len=64)  # fmt: skip
    with running(settings) as node:
        cards = node.http.get("/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["tiny", "tiny-chat"]
        assert all(c["max_model_len"] == 64 and c["owned_by"] == "meshnet" for c in cards)
        assert all(c["created"] > 0 and c["root"] == MODEL_ID for c in cards)
        body = {"model": "tiny-chat", "prompt": "Hello", "max_tokens": 2, **GREEDY}
        reply = node.http.post("/v1/completions", json=body).json()
        assert reply["model"] == "tiny-chat"  # answered under the name asked for
        long = {**body, "prompt": [5] * 70}
        error = assert_error(node.http.post("/v1/completions", json=long), 400)
        assert error["code"] == "context_length_exceeded"
        assert len(node.sessions) == 0
        announced = node.runtime.announcement()
        assert announced.served_names == ("tiny", "tiny-chat") and announced.max_model_len == 64


# -- structured output -----------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("node_name", ["whole", "chain_head"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates_even_from_a_random_model(request, node_name, temperature):
    import jsonschema

    node = request.getfixturevalue(node_name)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 200, "seed": 3,
            "temperature": temperature, "response_format": fmt}  # fmt: skip
    choice = node.http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_json_object_and_bad_schemas(whole):
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 120, "temperature": 1.0,
            "seed": 1, "n": 4, "response_format": {"type": "json_object"}}  # fmt: skip
    choices = whole.http.post("/v1/completions", json=body).json()["choices"]
    done = [c for c in choices if c["finish_reason"] == "stop"]
    assert done  # a random model closes some objects; every closed one parses
    assert all(isinstance(json.loads(c["text"]), dict) for c in done)
    assert all(c["text"].startswith("{") for c in choices)
    bad = {
        **body,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}},
    }
    assert assert_error(whole.http.post("/v1/completions", json=bad), 400)["param"] == (
        "response_format"
    )
    assert len(whole.sessions) == 0


def test_reasoning_parser_splits_chat_replies(snapshot, tokenizer):
    """The deepseek_r1 convention: until ``</think>`` the reply is reasoning (the template
    may open the block in the prompt), in the response and in the stream."""
    with running(settings_for(snapshot, 0, 6, reasoning_parser="deepseek_r1")) as node:
        body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 6, **GREEDY}
        message = node.http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"]  # no </think> yet
        events = _events(node.http.post("/v1/chat/completions", json={**body, "stream": True}))
        streamed = "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in events)
        assert streamed == message["reasoning_content"]


# -- tool calls ------------------------------------------------------------------------------

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False,
        },
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def tool_node(snapshot, tmp_path_factory) -> Iterator[InProcessNode]:
    """The tiny model with a chat template that shows tools (Hermes style)."""
    import shutil

    copy = tmp_path_factory.mktemp("tools") / "snapshot"
    shutil.copytree(snapshot, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    with running(settings_for(copy, 0, 6)) as node:
        yield node


ASK = [{"role": "user", "content": "Weather in Paris for two days?"}]


def _validate_call(call: dict) -> None:
    import jsonschema

    spec = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert call["type"] == "function" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), spec[call["function"]["name"]])


def test_required_and_named_tool_calls_always_validate(tool_node):
    # one call (a random model would call again and again until max_tokens otherwise)
    body = {"model": MODEL_ID, "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 120,
            "temperature": 0, "parallel_tool_calls": False}  # fmt: skip
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        reply = tool_node.http.post("/v1/chat/completions", json={**body, "tool_choice": choice})
        assert reply.status_code == 200, reply.text
        out = reply.json()["choices"][0]
        assert out["finish_reason"] == "tool_calls", out
        assert out["message"]["content"] is None and out["message"]["tool_calls"]
        for call in out["message"]["tool_calls"]:
            _validate_call(call)
        if isinstance(choice, dict):
            assert [c["function"]["name"] for c in out["message"]["tool_calls"]] == ["get_time"]
    whole_reply = tool_node.http.post(
        "/v1/chat/completions", json={**body, "tool_choice": "required"}
    ).json()["choices"][0]["message"]["tool_calls"]
    events = _events(tool_node.http.post(
        "/v1/chat/completions", json={**body, "tool_choice": "required", "stream": True}
    ))  # fmt: skip
    assert _streamed_calls(events) == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole_reply
    ]  # the arguments arrive piece by piece, and add up to the same call
    assert sum("tool_calls" in e["choices"][0]["delta"] for e in events) > 2
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _streamed_calls(events) -> list[tuple[str, str]]:
    calls: dict[int, list] = {}
    for event in events:
        for call in event["choices"][0]["delta"].get("tool_calls", []):
            if "id" in call:
                calls[call["index"]] = [call["function"]["name"], call["function"]["arguments"]]
            else:
                calls[call["index"]][1] += call["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


def test_tool_requests_the_server_cannot_honour_are_refused(tool_node, whole):
    body = {"model": MODEL_ID, "messages": ASK, "tools": [WEATHER], "max_tokens": 4}
    no_template = whole.http.post("/v1/chat/completions", json=body)  # its template: no tools
    assert assert_error(no_template, 400)["param"] == "tools"  # auto: the model cannot know
    unknown = {**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert assert_error(tool_node.http.post("/v1/chat/completions", json=unknown), 400)
    both = {**body, "response_format": {"type": "json_object"}}
    assert assert_error(tool_node.http.post("/v1/chat/completions", json=both), 400)
    auto = tool_node.http.post("/v1/chat/completions", json={**body, "tool_choice": "auto"})
    assert auto.status_code == 200  # free output: calls only if the model writes them


def test_forced_calls_work_with_a_template_that_cannot_show_tools(whole, tokenizer):
    """The tools go in a system message, and the grammar forces the call (the tiny model's
    own template has no tools)."""
    import jsonschema

    serving = whole.runtime.openai
    body = {
        "model": MODEL_ID,
        "messages": ASK,
        "tools": [WEATHER],
        "max_tokens": 80,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
    }
    prompt = tokenizer.decode(serving.chat_jobs(ChatCompletionRequest(**body))[0].prompt_ids)
    assert "You can call these functions" in prompt and '"name":"get_weather"' in prompt
    reply = whole.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])  # fmt: skip
    system = [{"role": "system", "content": "Be brief."}, *ASK]
    named = {
        **body,
        "messages": system,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    prompt = tokenizer.decode(serving.chat_jobs(ChatCompletionRequest(**named))[0].prompt_ids)
    assert "Be brief.\n\nYou can call these functions" in prompt
    assert "the arguments of get_weather as one JSON object" in prompt
    none = whole.http.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
    assert none.status_code == 200 and "tool_calls" not in none.json()["choices"][0]["message"]


def test_auto_tool_calls_are_parsed_from_hermes_text():
    from meshnet_common.openai_protocol import ChatCompletionRequest as Chat
    from meshnet_node.head import tools

    request = Chat(model=MODEL_ID, messages=ASK, tools=[WEATHER], tool_choice="auto")
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", ' \
        '"days": 2}}\n</tool_call>'  # fmt: skip
    content, calls = tools.parse(request, text)
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert calls[0]["function"]["arguments"] == '{"city":"Paris","days":2}'
    assert tools.parse(request, "No call here.") == ("No call here.", [])


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 8, 13])
def test_tool_streams_cut_anywhere_add_up_to_the_calls(cut):
    from meshnet_common.openai_protocol import ChatCompletionRequest as Chat
    from meshnet_node.head import tools

    def run(choice, text) -> tuple[str, list]:
        stream = tools.ToolStream(Chat(model=MODEL_ID, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice=choice))  # fmt: skip
        deltas = []
        for i in range(0, len(text), cut):
            deltas += stream.feed(text[i : i + cut])
        deltas += stream.finish()
        content = "".join(d.get("content", "") for d in deltas)
        events = [{"choices": [{"delta": d}]} for d in deltas]
        return content, _streamed_calls(events)

    forced = '[{"name":"get_weather","arguments":{"city":"P{a}r\\"is","days":2}},' \
        '{"name":"get_time","arguments":{"zone":"UTC"}}]'  # fmt: skip
    assert run("required", forced) == (
        "",
        [("get_weather", '{"city":"P{a}r\\"is","days":2}'), ("get_time", '{"zone":"UTC"}')],
    )
    named = {"type": "function", "function": {"name": "get_time"}}
    assert run(named, '{"zone":"CET"}') == ("", [("get_time", '{"zone":"CET"}')])
    auto = 'Checking.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    assert run("auto", auto) == ("Checking.", [("get_time", '{"zone":"UTC"}')])
    assert run("auto", "Just text <tool") == ("Just text <tool", [])


def test_a_previous_reply_appended_as_the_client_writes_it_is_accepted(whole):
    """The openai client's message objects carry refusal/annotations/audio/function_call."""
    reply = {"role": "assistant", "content": "Rome.", "refusal": None, "annotations": [],
             "audio": None, "function_call": None, "tool_calls": None}  # fmt: skip
    body = {
        "model": MODEL_ID,
        "max_tokens": 2,
        **GREEDY,
        "messages": [*MESSAGES, reply, {"role": "user", "content": "And Spain?"}],
    }
    assert whole.http.post("/v1/chat/completions", json=body).status_code == 200
    bad = {**body, "messages": [{"role": "user", "content": "hi", "mood": "happy"}]}
    assert assert_error(whole.http.post("/v1/chat/completions", json=bad), 400)
    spoken = {**body, "messages": [{**reply, "audio": {"id": "a1"}}]}
    assert assert_error(whole.http.post("/v1/chat/completions", json=spoken), 400)
    tagged = {**body, "safety_identifier": "u-1", "prompt_cache_key": "k"}
    assert whole.http.post("/v1/chat/completions", json=tagged).status_code == 200


def test_direct_answers_are_asked_for_only_over_slow_links():
    """ADR-0020: on a LAN the chain's answer is as fast; a direct one costs a message."""
    from meshnet_common.metrics import Metrics
    from meshnet_node.dataplane.link_speeds import LinkSpeeds
    from meshnet_node.dataplane.links import HopLinks
    from meshnet_node.settings import HopTimeouts

    links = HopLinks(
        HttpxHops(httpx.AsyncClient()), metrics=Metrics(), timeouts=HopTimeouts(1.0, 1.0, 1.0),
        direct_min_rtt_ms=5.0, speeds=LinkSpeeds(wire.WireOptions(), auto=False),
    )  # fmt: skip
    links.rtt_ms.update({"http://lan.test": 0.8, "http://wan.test": 42.0})
    assert not links.direct_pays("http://lan.test")
    assert links.direct_pays("http://wan.test")
    assert links.direct_pays("http://unmeasured.test")  # until probed: as before
    links.direct_min_rtt_ms = 0.0
    assert links.direct_pays("http://lan.test")

"""Bounded requests (issue #35), in-process on one whole-model node: prompts, generations
(prompts x n), stop strings and JSON schemas beyond their bounds are refused with a 400
naming the bound; planning runs off the event loop within a time limit; one generation's
error ends every generation of its request and frees their sessions; the wait queue takes
turns by the credential a client proved, not by the ``user`` it wrote. The bounds are the
operator's knobs (--max-prompts, --max-choices, --max-stop-chars, --max-schema-chars,
--prepare-timeout)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from meshnet_common.layers import LayerRange
from meshnet_common.openai_protocol import MAX_CHOICES, MAX_PROMPTS, MAX_STOP_CHARS
from meshnet_common.precision import Precision
from meshnet_common.protocol import (
    GRAMMAR_MAX_BYTES,
    H_CLIENT_ADDRESS,
    H_CLIENT_TENANT,
    H_SWARM_TOKEN,
)
from meshnet_node.cli import build_parser
from meshnet_node.head.queue import RequestQueue
from meshnet_node.head.routes import client_of
from meshnet_node.head.serving import PREPARE_THREADS
from meshnet_node.runtime import NodeRuntime, build_runtime, create_app
from meshnet_node.settings import NodeSettings

MODEL_ID = "meshnet-tiny/llama"
BASE = {"model": MODEL_ID, "max_tokens": 2, "temperature": 0}


@contextmanager
def _head(tiny_snapshot, **knobs) -> Iterator[tuple[NodeRuntime, TestClient]]:
    """A head holding the whole model: 2 sessions at most, 1 request may wait for room."""
    settings = NodeSettings(
        model_id=MODEL_ID, model_path=tiny_snapshot("llama"), layers=LayerRange(0, 6),
        quantization=Precision.FLOAT32, max_sessions=2, max_queued_requests=1, **knobs,
    )  # fmt: skip

    async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
        return ()

    runtime = build_runtime(settings, route_provider=no_route)
    with TestClient(create_app(runtime)) as client:
        yield runtime, client


@pytest.fixture
def node(tiny_snapshot) -> Iterator[tuple[NodeRuntime, TestClient]]:
    with _head(tiny_snapshot) as head:
        yield head


def refused(resp, param: str, *words: str) -> dict:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def test_prompts_generations_and_stops_beyond_their_bounds_are_refused(node):
    runtime, client = node
    url = "/v1/completions"
    many = client.post(url, json={**BASE, "prompt": ["a"] * (MAX_PROMPTS + 1)})
    assert refused(many, "prompt", str(MAX_PROMPTS))["code"] == "too_many_prompts"
    ids = client.post(url, json={**BASE, "prompt": [[1, 2]] * (MAX_PROMPTS + 1)})
    refused(ids, "prompt", str(MAX_PROMPTS))
    choices = client.post(url, json={**BASE, "prompt": ["a"] * 20, "n": 8})
    assert refused(choices, "prompt", str(MAX_CHOICES))["code"] == "too_many_generations"
    stop = client.post(url, json={**BASE, "prompt": "a", "stop": ["x" * (MAX_STOP_CHARS + 1)]})
    refused(stop, "stop", str(MAX_STOP_CHARS))
    five = client.post(url, json={**BASE, "prompt": "a", "stop": ["a", "b", "c", "d", "e"]})
    refused(five, "stop", "4")
    # at the bounds: served
    ok = client.post(url, json={**BASE, "prompt": ["a"], "n": 2,
                                "stop": ["x" * MAX_STOP_CHARS]})  # fmt: skip
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    assert len(runtime.service.stage.sessions) == 0


def test_a_json_schema_beyond_its_bound_is_refused_before_any_session(node):
    runtime, client = node
    props = {f"field_{i:05d}": {"type": "string"} for i in range(GRAMMAR_MAX_BYTES // 20)}
    schema = {"type": "object", "properties": props}
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    resp = client.post("/v1/completions", json={**BASE, "prompt": "a", "response_format": fmt})
    error = refused(resp, "response_format", str(GRAMMAR_MAX_BYTES))
    assert error["code"] == "schema_too_large"
    function = {"name": "big", "parameters": schema}
    chat = client.post("/v1/chat/completions", json={
        **BASE, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": function}], "tool_choice": "required",
    })  # fmt: skip
    assert refused(chat, "tools", str(GRAMMAR_MAX_BYTES))["code"] == "schema_too_large"
    small = {
        "type": "json_schema",
        "json_schema": {
            "name": "s",
            "schema": {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
            },
        },
    }
    ok = client.post("/v1/completions", json={**BASE, "prompt": "a", "max_tokens": 8,
                                              "response_format": small})  # fmt: skip
    assert ok.status_code == 200, ok.text
    assert len(runtime.service.stage.sessions) == 0


def test_planning_runs_off_the_event_loop_and_is_bounded_in_time(node):
    runtime, client = node
    serving = runtime.openai
    threads: list[str] = []
    plan = serving._prompts

    def recording(request):
        threads.append(threading.current_thread().name)
        return plan(request)

    serving._prompts = recording
    ok = client.post("/v1/completions", json={**BASE, "prompt": ["a", "b"]})
    assert ok.status_code == 200 and threads and threads[0].startswith("prepare")

    serving.preparing.timeout_s = 0.0  # no planning can finish in no time
    late = client.post("/v1/completions", json={**BASE, "prompt": ["a", "b"]})
    assert refused(late, "prompt", "0 s")["code"] == "request_too_complex"
    fmt = {"type": "json_object"}
    late = client.post("/v1/completions", json={**BASE, "prompt": "a", "response_format": fmt})
    refused(late, "response_format", "0 s")
    assert len(runtime.service.stage.sessions) == 0


def test_a_preparation_past_its_limit_holds_its_thread_until_it_ends(node):
    """Issue 52: a thread cannot be stopped, so one past --prepare-timeout (answered 400)
    keeps its slot until its work really ends; with every slot so held, a new request is a
    retryable 503 at once instead of queueing behind them, and its work never starts."""
    runtime, client = node
    serving = runtime.openai
    release, planned = threading.Event(), []
    plan = serving._prompts

    def runaway(request):
        planned.append(request.prompt)
        if request.prompt == "stuck":
            release.wait(120)  # a render that would not end (bounded only for the test)
        return plan(request)

    serving._prompts = runaway
    serving.preparing.timeout_s = 0.3
    try:
        for _ in range(PREPARE_THREADS):
            late = client.post("/v1/completions", json={**BASE, "prompt": "stuck"})
            assert refused(late, "prompt")["code"] == "request_too_complex"
        assert serving.preparing.held == PREPARE_THREADS  # answered, still running
        busy = client.post("/v1/completions", json={**BASE, "prompt": "a"})
        assert busy.status_code == 503, busy.text
        assert busy.json()["error"]["code"] == "preparation_busy"
        assert planned == ["stuck"] * PREPARE_THREADS  # the refused request never started
    finally:
        release.set()
    for _ in range(2000):  # the runaways end: their slots free
        if serving.preparing.held == 0:
            break
        time.sleep(0.005)
    assert serving.preparing.held == 0
    ok = client.post("/v1/completions", json={**BASE, "prompt": "a"})
    assert ok.status_code == 200, ok.text


def test_a_runaway_preparation_is_stopped_at_its_limit(node):
    """Work past --prepare-timeout that keeps calling into Python (as a Jinja render does)
    is stopped there: its thread ends and frees its slot without any help."""
    runtime, client = node
    serving = runtime.openai
    calls, plan = [0], serving._prompts

    def runaway(request):
        if request.prompt != "loop":
            return plan(request)
        while True:  # a render that would never end
            calls[0] += 1
            len(str(calls[0]))

    serving._prompts = runaway
    serving.preparing.timeout_s = 0.3
    late = client.post("/v1/completions", json={**BASE, "prompt": "loop"})
    assert refused(late, "prompt")["code"] == "request_too_complex"
    for _ in range(2000):  # stopped at its next call: the slot frees
        if serving.preparing.held == 0:
            break
        time.sleep(0.005)
    assert serving.preparing.held == 0
    stopped_at = calls[0]
    serving.preparing.timeout_s = 10.0
    assert client.post("/v1/completions", json={**BASE, "prompt": "a"}).status_code == 200
    assert calls[0] == stopped_at  # it never ran on


def test_the_bounds_are_the_flags_the_operator_gave(tiny_snapshot):
    flags = ["--max-prompts", "2", "--max-choices", "3", "--max-stop-chars", "4",
             "--max-schema-chars", "40", "--prepare-timeout", "0.2"]  # fmt: skip
    knobs = NodeSettings.from_args(build_parser().parse_args(flags)).model_dump(
        include={"max_prompts", "max_choices", "max_stop_chars", "max_schema_chars",
                 "prepare_timeout_s"}
    )  # fmt: skip
    assert knobs["max_prompts"] == 2 and knobs["prepare_timeout_s"] == 0.2
    with _head(tiny_snapshot, **knobs) as (runtime, client):
        url = "/v1/completions"
        three = client.post(url, json={**BASE, "prompt": ["a", "b", "c"]})
        assert refused(three, "prompt", "3 prompts", "at most 2")["code"] == "too_many_prompts"
        ids = client.post(url, json={**BASE, "prompt": [[1], [2], [3]]})
        refused(ids, "prompt", "at most 2")
        two = client.post(url, json={**BASE, "prompt": ["a", "b"], "stop": ["xxxx"]})
        assert two.status_code == 200 and len(two.json()["choices"]) == 2, two.text
        four = client.post(url, json={**BASE, "prompt": ["a", "b"], "n": 2})
        error = refused(four, "prompt", "2 prompts x n=2", "3 generations")
        assert error["code"] == "too_many_generations"
        chat = client.post("/v1/chat/completions", json={
            **BASE, "messages": [{"role": "user", "content": "hi"}], "n": 4,
        })  # fmt: skip
        assert refused(chat, "n", "n=4", "3 generations")["code"] == "too_many_generations"
        three_ok = client.post(url, json={**BASE, "prompt": "a", "n": 3})
        assert three_ok.status_code == 200 and len(three_ok.json()["choices"]) == 3
        stop = client.post(url, json={**BASE, "prompt": "a", "stop": ["xxxxx"]})
        refused(stop, "stop", "at most 4 characters")
        schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        big = client.post(url, json={**BASE, "prompt": "a", "response_format": fmt})
        assert refused(big, "response_format", "at most 40")["code"] == "schema_too_large"

        serving = runtime.openai
        plan = serving._prompts

        def slow(request):
            time.sleep(1.0)
            return plan(request)

        serving._prompts = slow
        late = client.post(url, json={**BASE, "prompt": "a"})
        assert refused(late, "prompt", "over 0.2 s")["code"] == "request_too_complex"
        assert len(runtime.service.stage.sessions) == 0


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-prompts", "0"), ("--max-choices", "-1"), ("--max-stop-chars", "0"),
     ("--prepare-timeout", "0"), ("--max-schema-chars", "1"), ("--max-schema-chars", "40000")],
)  # fmt: skip
def test_a_bound_must_be_positive_and_a_schema_fit_a_hop_header(flag: str, value: str):
    with pytest.raises(ValueError, match=f"^{flag} "):
        NodeSettings.from_args(build_parser().parse_args([flag, value]))


def test_one_refused_generation_ends_every_generation_of_its_request(node):
    runtime, client = node
    body = {**BASE, "prompt": ["Once upon a time"] * 12, "max_tokens": 200,
            "ignore_eos": True}  # fmt: skip
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "queue_full" and "retry-after" in resp.headers
    # Nothing of the request runs on: no session held, no generation running, none waiting.
    assert len(runtime.service.stage.sessions) == 0
    assert runtime.openai.queue.waiting == 0
    stream = client.post("/v1/completions", json={**body, "stream": True})
    assert stream.status_code == 200 and '"queue_full"' in stream.text
    assert stream.text.rstrip().endswith("data: [DONE]")
    assert len(runtime.service.stage.sessions) == 0 and runtime.openai.queue.waiting == 0
    after = client.post("/v1/completions", json={**BASE, "prompt": "Hi"})
    assert after.status_code == 200, after.text


def _request(authorization: str | None, host: str = "10.0.0.1", **more: str):
    headers = {"authorization": authorization} if authorization else {}
    return SimpleNamespace(headers={**headers, **more}, client=SimpleNamespace(host=host))


def test_the_client_address_the_tracker_names_is_believed_beside_the_swarm_token_only():
    body = SimpleNamespace(user=None)
    proxied = _request(None, "10.0.0.2", **{H_CLIENT_ADDRESS: "192.0.2.7",
                                             H_SWARM_TOKEN: "swarm-secret"})  # fmt: skip
    assert client_of(proxied, body, keyed=False, swarm_token="swarm-secret")[0] == (
        "addr:192.0.2.7"
    )
    # A client naming an address itself, without the token (or in a swarm without one),
    # is its own connection's address.
    forged = _request(None, "10.0.0.3", **{H_CLIENT_ADDRESS: "192.0.2.7"})
    assert client_of(forged, body, keyed=False, swarm_token="swarm-secret")[0] == "addr:10.0.0.3"
    wrong = _request(None, "10.0.0.3", **{H_CLIENT_ADDRESS: "192.0.2.7", H_SWARM_TOKEN: "x"})
    assert client_of(wrong, body, keyed=False, swarm_token="swarm-secret")[0] == "addr:10.0.0.3"
    assert client_of(proxied, body, keyed=False, swarm_token=None)[0] == "addr:10.0.0.2"


def test_the_tenant_the_tracker_names_takes_turns_as_its_key():
    """The tracker no longer passes a client's key on; the tenant it names (beside the swarm
    token) is the client the wait queue takes turns by, and only there."""
    body, tenant = SimpleNamespace(user=None), "ab" * 16
    proxied = _request(None, "10.0.0.2", **{H_CLIENT_TENANT: tenant, H_CLIENT_ADDRESS: "192.0.2.7",
                                             H_SWARM_TOKEN: "swarm-secret"})  # fmt: skip
    for keyed in (True, False):
        assert client_of(proxied, body, keyed=keyed, swarm_token="swarm-secret")[0] == (
            "key:" + tenant
        )
    forged = _request(None, "10.0.0.3", **{H_CLIENT_TENANT: tenant})
    assert client_of(forged, body, keyed=False, swarm_token="swarm-secret")[0] == "addr:10.0.0.3"


def test_the_queue_keys_on_the_proven_credential_not_on_the_user_field():
    body = SimpleNamespace(user="mallory-1")
    keyed, user = client_of(_request("Bearer sk-secret"), body, keyed=True)
    assert keyed.startswith("key:") and "sk-secret" not in keyed and user == "mallory-1"
    assert client_of(_request("Bearer sk-secret", "10.9.9.9"), body, keyed=True)[0] == keyed
    # Without API keys a bearer proves nothing: the caller's address is the client.
    assert client_of(_request("Bearer anything"), body, keyed=False) == ("addr:10.0.0.1",
                                                                           "mallory-1")  # fmt: skip
    assert client_of(_request(None), SimpleNamespace(user=None), keyed=False)[0] == (
        "addr:10.0.0.1"
    )


def test_many_user_names_do_not_buy_more_turns():
    async def run() -> list[str]:
        queue = RequestQueue(max_waiting=10, timeout_s=5, poll_s=60)
        order: list[str] = []

        async def request(client: str, user: str, name: str) -> None:
            await queue.wait(client, queue.clock() + 5, user=user)
            order.append(name)

        asks = [("a", f"u{i}", f"a{i}") for i in range(4)] + [("b", "", "b1"), ("b", "", "b2")]
        tasks = [asyncio.ensure_future(request(*ask)) for ask in asks]
        await asyncio.sleep(0)
        assert queue.waiting == 6
        for _ in range(6):
            queue.wake()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert queue.waiting == 0
        return order

    # the clients alternate; a's users take turns within a's share
    assert asyncio.run(run()) == ["a0", "b1", "a1", "b2", "a2", "a3"]

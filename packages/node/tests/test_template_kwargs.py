"""A client never runs Jinja of its own (issue 52; vLLM's CVE-2025-61620):
``chat_template_kwargs`` may name only variables the model's chat template reads, never one
the renderer sets (``chat_template``, ``tokenize``, the special tokens...). Anything else is a
400 naming the key, on the chat route and on /tokenize alike, and the head keeps serving."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.tiny.snapshots import CHAT_TEMPLATE
from meshnet_node.head.preparing.templates import allowed_kwargs, template_variables
from meshnet_node.runtime import build_runtime, create_app
from meshnet_node.settings import NodeSettings

MODEL_ID = "meshnet-tiny/llama"
MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
# the tiny model's template, reading one variable a client may set
THINKING = CHAT_TEMPLATE + "{% if enable_thinking %}{{ '<think>' }}{% endif %}"


@pytest.fixture(scope="module")
def head(tiny_snapshot):
    settings = NodeSettings(model_id=MODEL_ID, model_path=tiny_snapshot("llama"),
                            layers=LayerRange(0, 6), quantization=Precision.FLOAT32)  # fmt: skip

    async def no_route(_model_id, _exclude=frozenset()):
        return ()

    runtime = build_runtime(settings, route_provider=no_route)
    with TestClient(create_app(runtime)) as client:
        yield runtime, client


def _refused(resp, key: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "chat_template_kwargs" and repr(key) in error["message"], error


def _tokens(client, **kwargs) -> list[int]:
    resp = client.post("/tokenize", json={"messages": MESSAGES, **kwargs})
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


BOMB = "{% for i in range(10**5) %}{% for j in range(10**5) %}x{% endfor %}{% endfor %}"


@pytest.mark.parametrize("kwargs", [
    {"chat_template": "{{ 'x' * 1000000000 }}"},
    {"chat_template": BOMB},
    {"tokenize": False},
    {"bos_token": "<evil>"},
    {"messages": []},
    {"not_in_the_template": 1},
], ids=["template", "bomb", "tokenize", "special token", "messages", "unread"])  # fmt: skip
def test_a_kwarg_the_template_does_not_read_is_a_400_naming_it(head, kwargs):
    _runtime, client = head
    (key,) = kwargs
    _refused(
        client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": kwargs}), key
    )
    _refused(client.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": kwargs}),
             key)  # fmt: skip
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_kwarg_the_template_reads_is_passed_to_it(head):
    runtime, client = head
    tokenizer = runtime.openai.tokenizer
    before = tokenizer.chat_template
    tokenizer.chat_template = THINKING
    try:
        plain = _tokens(client)
        thinking = _tokens(client, chat_template_kwargs={"enable_thinking": True})
        assert thinking != plain and _tokens(client, chat_template_kwargs={}) == plain
        ok = client.post("/v1/chat/completions",
                         json={**CHAT, "chat_template_kwargs": {"enable_thinking": True}})  # fmt: skip
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] == len(thinking)
    finally:
        tokenizer.chat_template = before


def test_the_allowed_variables_are_those_the_template_reads_and_does_not_set():
    template = ("{% set greeting = 'hi' %}{% generation %}{{ greeting }}{% endgeneration %}"
                "{% for m in messages %}{% if loop.first %}{% break %}{% endif %}{% endfor %}"
                "{{ bos_token }}{{ custom_tools }}")  # fmt: skip
    assert template_variables(template) == {"messages", "bos_token", "custom_tools"}
    assert template_variables("{% if %}") == frozenset()  # unparsable: nothing allowed
    reads = template + "{{ range(3) | list }}{{ documents }}{{ chat_template }}{{ tokenize }}"
    tokenizer = SimpleNamespace(chat_template=reads, special_tokens_map={"bos_token": "<s>"})
    assert allowed_kwargs(tokenizer) == {"custom_tools", "documents"}


def test_a_runaway_render_of_the_models_own_template_is_stopped(head):
    """Even the model's own template, left to run past --prepare-timeout, is stopped: the
    render ends at its next Python call and its thread frees its slot."""
    runtime, client = head
    tokenizer, pool = runtime.openai.tokenizer, runtime.openai.preparing
    before, limit = tokenizer.chat_template, pool.timeout_s
    tokenizer.chat_template, pool.timeout_s = BOMB, 0.5
    try:
        late = client.post("/v1/chat/completions", json=CHAT)
        assert late.status_code == 400 and late.json()["error"]["code"] == "request_too_complex"
        for _ in range(2000):
            if pool.held == 0:
                break
            time.sleep(0.005)
        assert pool.held == 0
    finally:
        tokenizer.chat_template, pool.timeout_s = before, limit
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200

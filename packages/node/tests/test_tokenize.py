"""A head's vLLM tokenizer endpoints (/tokenize, /detokenize) against the model's own
tokenizer, /version, /ready without a tracker, and CORS on a node's app.

One in-process node holds all of tiny llama (head and tail); the tokenizer endpoints answer
as vLLM's do, in the shapes lm-evaluation-harness's remote tokenizer sends and reads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnet_common.config.cli import package_version
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import NodeState
from meshnet_node.runtime import NodeRuntime, build_runtime, create_app
from meshnet_node.settings import NodeSettings

MODEL_ID = "meshnet-tiny/llama"
ERROR_KEYS = {"message", "type", "param", "code"}
UI = "http://ui.test:3000"
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
]


def settings_for(snapshot: Path, start: int = 0, end: int = 6, **overrides) -> NodeSettings:
    return NodeSettings(
        model_id=MODEL_ID, model_path=snapshot, layers=LayerRange(start, end),
        quantization=Precision.FLOAT32, **overrides,
    )  # fmt: skip


async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
    return ()


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def snapshot(tiny_snapshot) -> Path:
    return tiny_snapshot("llama")


@pytest.fixture(scope="module")
def head(snapshot) -> Iterator[TestClient]:
    """All of tiny llama in one node, with no tracker; pages of UI may call it."""
    runtime = build_runtime(settings_for(snapshot, allowed_origins=(UI,)), route_provider=no_route)
    with TestClient(create_app(runtime)) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(head):
    return head.app.state.runtime.openai.tokenizer


# -- /tokenize and /detokenize ---------------------------------------------------------------


def test_a_text_round_trips_through_tokenize_and_detokenize(head, tokenizer):
    prompt = "The capital of France is Paris.\nÉtoile, naïve café!"
    resp = head.post("/tokenize", json={"model": MODEL_ID, "prompt": prompt})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    ids = tokenizer(prompt, add_special_tokens=True).input_ids
    max_model_len = head.get("/v1/models").json()["data"][0]["max_model_len"]
    assert body == {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                    "token_strs": None}  # fmt: skip
    back = head.post("/detokenize", json={"model": MODEL_ID, "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": tokenizer.decode(ids)}
    assert back.json()["prompt"] == prompt


def test_token_strs_are_the_tokenizers_own_pieces(head, tokenizer):
    resp = head.post("/tokenize", json={"prompt": "The capital", "return_token_strs": True})
    body = resp.json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["token_strs"] == ["The", "Ġcapital"]


def test_lm_eval_remote_tokenizer_shapes(head, tokenizer):
    """lm-evaluation-harness's remote tokenizer: no model, no special tokens."""
    resp = head.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
    assert resp.status_code == 200, resp.text
    assert resp.json()["tokens"] == tokenizer("test", add_special_tokens=False).input_ids
    back = head.post("/detokenize", json={"tokens": resp.json()["tokens"]})
    assert back.json() == {"prompt": "test"}


def test_a_chat_is_tokenized_as_chat_completions_prompts_it(head, tokenizer):
    resp = head.post("/tokenize", json={"model": MODEL_ID, "messages": CHAT})
    assert resp.status_code == 200, resp.text
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)  # fmt: skip
    assert resp.json()["tokens"] == list(ids) and resp.json()["count"] == len(ids)
    # the very prompt a chat completion runs on
    chat = head.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": CHAT,
                                                   "max_tokens": 1})  # fmt: skip
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    text = head.post("/detokenize", json={"tokens": resp.json()["tokens"]}).json()["prompt"]
    assert text == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    # the template's flags
    plain = head.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})
    assert plain.json()["tokens"] == tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=False, tokenize=True, return_dict=False
    )
    assert plain.json()["count"] < len(ids)
    special = head.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True})
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert special.json()["tokens"] == tokenizer(rendered, add_special_tokens=True).input_ids
    partial = [*CHAT, {"role": "assistant", "content": "The capital is"}]
    resp = head.post("/tokenize", json={"messages": partial, "add_generation_prompt": False,
                                        "continue_final_message": True})  # fmt: skip
    assert resp.status_code == 200, resp.text
    text = head.post("/detokenize", json={"tokens": resp.json()["tokens"]}).json()["prompt"]
    assert text.endswith("The capital is")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "hi", "temperature": 0}, "temperature"),  # a field of no use
        ("/tokenize", {"prompt": "hi", "messages": CHAT}, "prompt"),  # both forms at once
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": []}, "messages"),
        (
            "/tokenize",
            {"messages": CHAT, "continue_final_message": True},
            "continue_final_message",
        ),  # fmt: skip
        ("/tokenize", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, None),
        ("/detokenize", {"tokens": [1, 512]}, "tokens"),  # the vocabulary is 512
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [1, "2"]}, "tokens.1"),
        ("/detokenize", {"tokens": [True]}, "tokens.0"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_requests_are_400_naming_the_field(head, path, body, param):
    assert_error(head.post(path, json=body), 400, param)


def test_another_model_or_body_is_refused_in_the_error_shape(head):
    error = assert_error(head.post("/tokenize", json={"model": "other", "prompt": "hi"}), 404)
    assert error["code"] == "model_not_found"
    error = assert_error(head.post("/detokenize", json={"model": "other", "tokens": [1]}), 404)
    assert error["code"] == "model_not_found"
    assert_error(head.post("/tokenize", content=b"not json"), 400)
    lone = head.post("/tokenize", content=b'{"prompt": "\\ud800"}')  # a lone surrogate
    assert_error(lone, 400, "prompt")
    assert_error(head.post("/tokenize", content=b"[1]"), 400)
    assert_error(head.post("/tokenize", content=b"{}", headers={"content-type": "text/plain"}),
                 415)  # fmt: skip
    assert_error(head.get("/tokenize"), 405)


def test_tokenizing_runs_off_the_event_loop_within_the_prepare_timeout(head):
    serving = head.app.state.runtime.openai
    before = serving.preparing.timeout_s
    serving.preparing.timeout_s = 1e-6  # no tokenizer answers that fast
    try:
        resp = head.post("/tokenize", json={"prompt": "word " * 20000})
    finally:
        serving.preparing.timeout_s = before
    assert assert_error(resp, 400, "prompt")["code"] == "request_too_complex"


def test_a_node_without_the_first_layers_has_no_tokenizer(snapshot):
    runtime = build_runtime(settings_for(snapshot, 3, 6), route_provider=no_route)
    with TestClient(create_app(runtime)) as tail:
        assert_error(tail.post("/tokenize", json={"prompt": "hi"}), 404)
        assert_error(tail.post("/detokenize", json={"tokens": [1]}), 404)
        assert tail.get("/ready").json() == {"ready": True}  # it serves its layers


# -- /version, /ready, CORS -------------------------------------------------------------------


def test_version_is_the_installed_one(head):
    assert head.get("/version").json() == {"version": package_version("meshnet-node")}


def test_a_node_with_no_tracker_is_ready_once_it_listens_and_not_while_it_drains(head):
    assert head.get("/health").status_code == 200
    assert head.get("/ready").json() == {"ready": True}
    runtime: NodeRuntime = head.app.state.runtime
    runtime.state = NodeState.LEAVING
    try:
        error = assert_error(head.get("/ready"), 503)
        assert error["code"] == "not_ready" and "leaving" in error["message"]
        assert head.get("/health").status_code == 200  # alive all the same
    finally:
        runtime.state = NodeState.SERVING


def test_cors_preflight_of_an_allowed_origin_only(head):
    asks = {"access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"}  # fmt: skip
    resp = head.options("/v1/chat/completions", headers={"origin": UI, **asks})
    assert resp.status_code == 200, resp.text
    assert resp.headers["access-control-allow-origin"] == UI
    assert "POST" in resp.headers["access-control-allow-methods"]
    assert "authorization" in resp.headers["access-control-allow-headers"].lower()
    other = head.options("/v1/chat/completions", headers={"origin": "http://evil.test", **asks})
    assert other.status_code >= 400
    assert not [h for h in other.headers if h.startswith("access-control-")]
    # the answers themselves: readable by the allowed origin's pages only
    resp = head.post("/tokenize", json={"prompt": "hi"}, headers={"origin": UI})
    assert resp.headers["access-control-allow-origin"] == UI
    assert "x-request-id" in resp.headers["access-control-expose-headers"].lower()
    resp = head.post("/tokenize", json={"prompt": "hi"}, headers={"origin": "http://evil.test"})
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),  # fmt: skip
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"]),
        "content": st.text(max_size=30) | JSON,
    },  # fmt: skip
)
BODIES = {
    "/tokenize": st.fixed_dictionaries(
        {"prompt": st.text(max_size=60) | JSON},
        optional={"add_special_tokens": JSON, "return_token_strs": JSON, "model": JSON},
    )
    | st.fixed_dictionaries(
        {"messages": st.lists(MESSAGE, max_size=3) | JSON},
        optional={
            "add_generation_prompt": st.booleans(),
            "continue_final_message": st.booleans(),
            "chat_template_kwargs": JSON,
            "tools": JSON,
        },
    ),  # fmt: skip
    "/detokenize": st.fixed_dictionaries(
        {"tokens": st.lists(st.integers(-5, 600), max_size=20) | JSON}, optional={"model": JSON}
    ),
}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_fuzzed_bodies_get_an_answer_or_a_4xx_in_the_error_shape(head, path):
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=BODIES[path])
    def check(body):
        resp = head.post(path, json=body)
        if resp.status_code == 200:
            assert set(resp.json()) in ({"prompt"}, {"count", "max_model_len", "tokens",
                                                     "token_strs"})  # fmt: skip
        else:
            assert 400 <= resp.status_code < 500, resp.text
            assert set(resp.json()["error"]) == ERROR_KEYS

    check()

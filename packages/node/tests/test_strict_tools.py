"""Forced tool calls (``tool_choice`` "required" or a named function) are constrained by
strict argument schemas: no property a schema does not list, free values nested only so
deep. Checked on the schemas, on llguidance's grammar with a real tokenizer, and end to end
with SmolLM2-135M-Instruct, which otherwise echoes the schema into the arguments until
max_tokens (issue 39)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from fastapi.testclient import TestClient

from meshnet_common.layers import LayerRange
from meshnet_common.openai_protocol import ChatCompletionRequest
from meshnet_common.precision import Precision
from meshnet_node.engine.constraints import json_grammar
from meshnet_node.head import tools
from meshnet_node.toolcalls.strict import NO_ARGUMENTS, strict_arguments, strict_calls

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather",
           "description": "Current weather in a city", "parameters": CITY}}  # fmt: skip
NESTED = {
    "type": "object",
    "properties": {
        "where": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array"},
        "meta": {"type": "object"},
        "extra": {},
        "open": {"type": "object", "properties": {"a": {"type": "integer"}},
                 "additionalProperties": True},
        "point": {"$ref": "#/$defs/Point"},
    },
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}},
}  # fmt: skip


def test_object_schemas_take_only_their_properties():
    strict = strict_arguments(NESTED)
    props = strict["properties"]
    assert strict["additionalProperties"] is False
    assert props["where"]["additionalProperties"] is False
    assert strict["$defs"]["Point"]["additionalProperties"] is False
    free = {"$ref": "#/$defs/meshnet_free_1"}
    assert props["tags"]["items"] == free and props["meta"]["additionalProperties"] == free
    assert props["extra"] == {"$ref": "#/$defs/meshnet_free_2"}
    assert props["open"]["additionalProperties"] == {"$ref": "#/$defs/meshnet_free_2"}
    assert NESTED["properties"]["where"] == {
        "type": "object",
        "properties": {"city": {"type": "string"}},
    }  # fmt: skip  (the request's schema is left as it was)
    explicit = {**CITY, "additionalProperties": {"type": "integer"}}
    assert strict_arguments(explicit)["additionalProperties"] == {"type": "integer"}
    assert strict_arguments(None) == strict_arguments({}) == NO_ARGUMENTS


def test_parts_of_one_object_stay_open():
    """Closing each of several schemas that together describe one object would forbid the
    properties of the others."""
    both = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "string"}}},
            {"type": "object", "properties": {"b": {"type": "string"}}},
        ]
    }
    assert all("additionalProperties" not in s for s in strict_arguments(both)["allOf"])
    beside = {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "anyOf": [{"properties": {"b": {"type": "string"}}}, {"required": ["a"]}],
    }
    strict = strict_arguments(beside)
    assert "additionalProperties" not in strict
    assert all("additionalProperties" not in s for s in strict["anyOf"])
    union = {"anyOf": [CITY, {"type": "object", "properties": {"zip": {"type": "string"}}}]}
    assert all(s["additionalProperties"] is False for s in strict_arguments(union)["anyOf"])


@pytest.fixture(scope="module")
def matcher(smollm2_snapshot):
    """Whether a text is accepted whole by the grammar of a schema (SmolLM2's tokens)."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_snapshot)
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(schema: dict, text: str) -> bool:
        grammar = json_grammar("json_schema", schema, param="tools").grammar
        m = llguidance.LLMatcher(lltokenizer, grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(m.consume_token(i) for i in ids) and m.is_accepting()

    return accepts


def test_the_grammar_forbids_unlisted_properties_and_deep_values(matcher):
    # what SmolLM2 wrote under the schema as given (issue 39)
    echo = '{"city":"Paris","type":"string","properties":{"temperature":{"type":"number"}}}'
    assert matcher(CITY, echo)  # JSON Schema allows it...
    assert not matcher(strict_arguments(CITY), echo)  # ...the strict copy does not
    assert matcher(strict_arguments(CITY), '{"city":"Paris"}')
    strict = strict_arguments(NESTED)
    assert matcher(strict, '{"where":{"city":"Paris"},"tags":[1,"a",[2]],"meta":{"k":{"j":1}},'
                           '"extra":{"a":[1]},"point":{"x":1.5}}')  # fmt: skip
    assert not matcher(strict, '{"meta":{"k":{"j":{"i":1}}}}')  # nested past the bound
    assert not matcher(strict, '{"tags":[[[1]]]}')
    assert not matcher(strict, '{"point":{"x":1,"y":2}}')  # through a $ref too
    calls = strict_calls([("get_weather", CITY), ("locate", NESTED)], many=True)
    assert matcher(calls, '[{"name":"get_weather","arguments":{"city":"Paris"}},'
                          '{"name":"locate","arguments":{"point":{"x":2}}}]')  # fmt: skip
    assert not matcher(calls, '[{"name":"get_weather","arguments":{"city":"Paris","x":1}}]')
    assert not matcher(calls, '[{"name":"locate","arguments":{"point":{"x":2,"z":1}}}]')


def test_the_request_schema_is_strict_for_both_forced_choices():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    named = {"type": "function", "function": {"name": "get_weather"}}
    schema = tools.call_schema(ChatCompletionRequest(**body, tool_choice=named))
    assert schema == {**CITY, "additionalProperties": False}
    required = tools.call_schema(ChatCompletionRequest(**body, tool_choice="required"))
    assert required["items"]["properties"]["arguments"]["additionalProperties"] is False
    assert tools.call_schema(ChatCompletionRequest(**body, tool_choice="auto")) is None


# -- end to end with SmolLM2 --------------------------------------------------------------

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol(smollm2_snapshot: Path) -> Iterator[TestClient]:
    """SmolLM2 whole on one in-process node (its template cannot show tools: the functions
    go in a system message, the grammar forces the call)."""
    from meshnet_node.runtime import build_runtime, create_app
    from meshnet_node.settings import NodeSettings

    async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
        return ()

    settings = NodeSettings(model_id=SMOL, model_path=smollm2_snapshot, layers=LayerRange(0, 30),
                            quantization=Precision.FLOAT32)  # fmt: skip
    with TestClient(create_app(build_runtime(settings, route_provider=no_route))) as http:
        yield http


def _events(resp) -> list[dict]:
    lines = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)  # fmt: skip
def test_smollm2_answers_the_weather_question_with_a_valid_call(smol, choice):
    body = {"model": SMOL, "messages": QUESTION, "tools": [WEATHER], "tool_choice": choice,
            "max_tokens": 60, "temperature": 0}  # fmt: skip
    reply = smol.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    out = reply.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls", out
    assert out["message"]["content"] is None
    calls = out["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), {
            **CITY, "additionalProperties": False})  # fmt: skip
    events = _events(smol.post("/v1/chat/completions", json={**body, "stream": True}))
    streamed: dict[int, list[str]] = {}
    for event in events:
        for call in event["choices"][0]["delta"].get("tool_calls", []):
            if "id" in call:
                streamed[call["index"]] = [call["function"]["name"], ""]
            streamed[call["index"]][1] += call["function"]["arguments"]
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_smollm2_makes_one_call_without_parallel_tool_calls(smol):
    body = {"model": SMOL, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 60, "temperature": 0}  # fmt: skip
    out = smol.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert out["finish_reason"] == "tool_calls"
    (call,) = out["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

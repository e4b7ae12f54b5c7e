"""Tool calls in the models' own formats (``tool_choice: "auto"``): each parser on literal
model outputs, whole and streamed in arbitrary pieces; the format chosen from the chat
template; special-token markers put back; ``parallel_tool_calls: false``; the loop guard of
``required``; and reasoning beside tool calls in streamed and whole replies."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest

from meshnet_common.metrics import Metrics
from meshnet_common.openai_protocol import ChatCompletionRequest
from meshnet_node.head import tools
from meshnet_node.head.generation import GeneratedToken
from meshnet_node.head.responses import Choice, ResponseShapes
from meshnet_node.toolcalls.common import Call
from meshnet_node.toolcalls.formats import ToolFormat, choose, format_for, new_parser

ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}  # fmt: skip
PARIS = ("get_weather", '{"city":"Paris"}')
UTC = ("get_time", '{"zone":"UTC"}')

# (format, literal model output, content, calls)
OUTPUTS = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
     "\n</tool_call>", "Let me check.", [PARIS, UTC]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
     None, [PARIS]),  # the reply ended before </tool_call>
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [PARIS, UTC]),
    ("llama3_json", 'I will look.<|python_tag|>{"name": "get_time", "arguments": {"zone": '
     '"UTC"}}', "I will look.", [UTC]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [PARIS, UTC]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": "{\\"zone\\": '
     '\\"UTC\\"}"}]', "Sure.", [UTC]),  # arguments as a JSON string
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
     '{"zone": "UTC"}', None, [PARIS, UTC]),
    ("mistral", '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "UTC"}', None, [UTC]),
    ("openai", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city":"Paris"}', None, [PARIS]),  # <|call|> ends generation: not in the text
    ("openai", "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>"
     'assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": '
     '"Paris"}<|call|>', "<|channel|>analysis<|message|>The user wants the weather.<|end|>",
     [PARIS]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
     'function<｜tool▁sep｜>get_time\n```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>", None, [PARIS, UTC]),
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
     '{"zone": "UTC"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Checking.", [UTC]),  # V3.1
]  # fmt: skip
# replies without a (valid) call: all content, as written
NO_CALLS = [
    ("hermes", "Just text <tool"),
    ("hermes", "<tool_call>{not json}</tool_call> done"),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", "Paris is sunny {today}."),
    ("mistral", "[TOOL_CALLS] oops, no call"),
    ("mistral", "No tools needed [TOOL"),
    ("openai", "<|channel|>final<|message|>It is sunny.<|return|>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>broken<｜tool▁call▁end｜>"),
]


def _parse(fmt: str, text: str, cuts) -> tuple[str | None, list[tuple[str, str]]]:
    """The content and calls of ``text`` fed to a parser in pieces ending at ``cuts``."""
    parser = new_parser(fmt)
    pieces, start = [], 0
    for end in [*cuts, len(text)]:
        pieces += parser.feed(text[start:end])
        start = end
    pieces += parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str)).strip()
    return content or None, [(p.name, p.arguments) for p in pieces if isinstance(p, Call)]


def _cuts(text: str, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    every = [list(range(step, len(text), step)) for step in (1, 2, 3, 5, 8, 13)]
    some = [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, k))) for k in (2, 5, 20)]
    return [[], *every, *some]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), OUTPUTS)
def test_each_format_parses_whole_and_streamed_replies(fmt, text, content, calls):
    for cuts in _cuts(text, seed=len(text)):
        assert _parse(fmt, text, cuts) == (content, calls), cuts


@pytest.mark.parametrize(("fmt", "text"), NO_CALLS)
def test_replies_without_a_call_are_content(fmt, text):
    request = ChatCompletionRequest(model="m", messages=ASK, tools=[WEATHER], tool_choice="auto")
    for cuts in _cuts(text, seed=1):
        assert _parse(fmt, text, cuts)[1] == []
    assert tools.parse(request, text, fmt) == (text, [])
    stream = tools.ToolStream(request, fmt)
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    assert "".join(d["content"] for d in deltas) == text


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), OUTPUTS)
def test_streamed_deltas_add_up_to_the_whole_reply(fmt, text, content, calls):
    request = ChatCompletionRequest(model="m", messages=ASK, tools=[WEATHER, TIME],
                                    tool_choice="auto")  # fmt: skip
    whole_content, whole_calls = tools.parse(request, text, fmt)
    assert whole_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == calls
    stream = tools.ToolStream(request, fmt)
    deltas = []
    for i in range(0, len(text), 4):
        deltas += stream.feed(text[i : i + 4])
    deltas += stream.finish()
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in streamed] == list(range(len(calls)))  # one delta per call
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in streamed)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == calls
    assert "".join(d.get("content", "") for d in deltas).strip() == (content or "")


# The markers of each family as its chat template writes earlier calls (abridged).
TEMPLATES = {
    "hermes": "{%- for tool_call in message.tool_calls %}{{- '<tool_call>\\n{\"name\": \"' }}"
              "{{- tool_call.name }}{{- '\"}\\n</tool_call>' }}{%- endfor %}{{ tools }}",
    "llama3_json": "{{- '<|python_tag|>' + tool_call.name + '.call(' }}{{ tools }}<|eot_id|>",
    "llama3.2": "{{- 'Respond in the format {\"name\": function name, \"parameters\": "
                "dictionary of argument name and its value}.' }}{{ tools }}<|eot_id|>",
    "mistral": "{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}{{ tools }}",
    "openai": "{{- '<|start|>assistant to=functions.' + tool_call.name + '<|channel|>"
              "commentary json<|message|>' }}namespace functions {{ tools }}",
    "deepseek_v3": "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
                   "'<｜tool▁sep｜>' + tool['function']['name'] }}",
    "smollm2": "{% for message in messages %}<|im_start|>{{ message.content }}{% endfor %}",
}  # fmt: skip


def test_the_format_is_chosen_from_the_chat_template():
    chosen = {name: choose(template) for name, template in TEMPLATES.items()}
    assert chosen == {
        "hermes": "hermes", "llama3_json": "llama3_json", "llama3.2": "llama3_json",
        "mistral": "mistral", "openai": "openai", "deepseek_v3": "deepseek_v3",
        "smollm2": "hermes",
    }  # fmt: skip
    assert choose({"default": "x", "tool_use": TEMPLATES["mistral"]}) == "mistral"
    assert choose(None) == "hermes"


class FakeTokenizer:
    """A chat template and a vocabulary: what the format's choice reads."""

    def __init__(self, template: str, vocab: dict[str, int]) -> None:
        self.chat_template = template
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def decode(self, ids) -> str:
        names = {i: t for t, i in self.vocab.items()}
        return "".join(names.get(i, f"<{i}>") for i in ids)


def test_special_token_markers_dropped_by_decoding_are_put_back():
    tokenizer = FakeTokenizer(TEMPLATES["mistral"], {"[TOOL_CALLS]": 5, "[ARGS]": 32, "a": 7})
    fmt = format_for(tokenizer)
    assert fmt == ToolFormat("mistral", {5: "[TOOL_CALLS]", 32: "[ARGS]"})
    assert fmt.text(5, "") == "[TOOL_CALLS]"  # skipped as a special token: put back
    assert fmt.text(5, "[TOOL_CALLS]") == "[TOOL_CALLS]"  # kept (skip_special_tokens false)
    assert fmt.text(7, "a") == "a" and fmt.text(None, "") == ""
    # the ids of a Mistral v11 reply, decoded with special tokens skipped
    texts = [(5, ""), (8, "get"), (9, "_weather"), (32, ""), (10, '{"city": "Paris"}')]
    text = "".join(fmt.text(i, t) for i, t in texts)
    request = ChatCompletionRequest(model="m", messages=ASK, tools=[WEATHER], tool_choice="auto")
    content, calls = tools.parse(request, text, fmt.name)
    assert content is None and calls[0]["function"]["arguments"] == '{"city":"Paris"}'


def test_tool_call_parser_overrides_the_template():
    """``--tool-call-parser`` (vLLM's names) wins over the chat template's markers."""
    from meshnet_node.settings import NodeSettings

    vocab = {"[TOOL_CALLS]": 5, "[ARGS]": 32}
    shapes = ResponseShapes(FakeTokenizer(TEMPLATES["smollm2"], vocab), Metrics(),
                            tool_call_parser="mistral")  # fmt: skip
    assert shapes.tool_format == ToolFormat("mistral", {5: "[TOOL_CALLS]", 32: "[ARGS]"})
    assert _shapes(TEMPLATES["smollm2"], vocab).tool_format.name == "hermes"  # the template's
    assert NodeSettings.exactly(tool_call_parser="openai").tool_call_parser == "openai"
    with pytest.raises(ValueError, match="tool_call_parser"):
        NodeSettings.exactly(tool_call_parser="pythonic")


def test_one_call_only_without_parallel_tool_calls():
    """``auto``: the answer is cut after its first call (vLLM keeps the first too)."""
    text = OUTPUTS[0][1] + " and more text"
    body = {"model": "m", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "auto"}
    many = ChatCompletionRequest(**body)
    one = ChatCompletionRequest(**body, parallel_tool_calls=False)
    assert len(tools.parse(many, text)[1]) == 2
    reply = tools.parse_reply(one, text)
    assert reply.content == "Let me check." and reply.complete
    assert [c["function"]["name"] for c in reply.calls] == ["get_weather"]
    stream = tools.ToolStream(one)
    deltas = []
    for ch in text:
        deltas += stream.feed(ch)
    deltas += stream.finish()
    assert stream.cut
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == [
        "get_weather"
    ]
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me check."
    # required: the grammar holds it to one call
    schema = tools.call_schema(ChatCompletionRequest(**{**body, "tool_choice": "required"},
                                                     parallel_tool_calls=False))  # fmt: skip
    assert schema["maxItems"] == 1


REPEATING = (
    '[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_time","arguments":'
    '{"zone":"UTC"}},{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_we'
)


def test_required_calls_end_at_a_verbatim_repeat():
    """A small greedy model writes the same call until max_tokens: the list ends at the
    first repeat (whole and streamed), and a list cut short keeps its complete calls."""
    calls, complete = tools.required_calls(REPEATING)
    assert [(c.name, c.arguments) for c in calls] == [PARIS, UTC] and complete
    calls, complete = tools.required_calls(REPEATING[:60])
    assert [(c.name, c.arguments) for c in calls] == [PARIS] and not complete
    assert tools.required_calls('[{"name":"get_time","arguments":{"zone":"CET"}}]')[1]
    request = ChatCompletionRequest(model="m", messages=ASK, tools=[WEATHER, TIME],
                                    tool_choice="required")  # fmt: skip
    for step in (1, 3, 7, 50):
        stream = tools.ToolStream(request)
        deltas = []
        for i in range(0, len(REPEATING), step):
            deltas += stream.feed(REPEATING[i : i + step])
        assert stream.cut
        events = [c for d in deltas for c in d["tool_calls"]]
        starts = [(c["index"], c["function"]["name"]) for c in events if "id" in c]
        assert starts == [(0, "get_weather"), (1, "get_time")]
        args = ["".join(c["function"]["arguments"] for c in events if c["index"] == i)
                for i in (0, 1)]  # fmt: skip
        assert args == [PARIS[1], UTC[1]]
    # a call that begins like an earlier one but differs is sent once it differs
    differs = '[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_weather",' \
        '"arguments":{"city":"Parma"}}]'  # fmt: skip
    stream = tools.ToolStream(request)
    deltas = [d for ch in differs for d in stream.feed(ch)]
    assert not stream.cut and sum("id" in c for d in deltas for c in d["tool_calls"]) == 2


# -- through the response shapes --------------------------------------------------------------


def _shapes(template: str, vocab=None, reasoning_parser=None) -> ResponseShapes:
    return ResponseShapes(FakeTokenizer(template, vocab or {}), Metrics(),
                          reasoning_parser=reasoning_parser)  # fmt: skip


def _tokens(texts: list[str], finish: str = "stop") -> list[GeneratedToken]:
    out = [GeneratedToken(100 + i, t) for i, t in enumerate(texts)]
    out[-1].finish_reason = finish
    return out


def _stream(shapes, request, tokens) -> tuple[list[dict], dict]:
    """The stream's chunks, and how its token source ended (closed early or not)."""
    source = {"sent": 0, "closed": False}

    async def produce():
        try:
            for tok in tokens:
                source["sent"] += 1
                yield 0, tok
        finally:
            source["closed"] = True

    async def collect():
        job = SimpleNamespace(prompt_ids=[1, 2, 3])
        return [e async for e in shapes.chat_stream(request, [job], produce())]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[6:]) for e in events[:-1]], source


def test_reasoning_and_tool_calls_stream_apart():
    """deepseek_r1 reasoning first (as ``reasoning`` and ``reasoning_content``), then the
    content through the tool-call parser."""
    shapes = _shapes(TEMPLATES["hermes"], reasoning_parser="deepseek_r1")
    texts = ["I should", " call it.</th", "ink>On it.<tool_", 'call>{"name": "get_weather", ',
             '"arguments": {"city": "Paris"}}</tool_call>']  # fmt: skip
    request = ChatCompletionRequest(model="m", messages=ASK, tools=[WEATHER], tool_choice="auto")
    chunks, _ = _stream(shapes, request, _tokens(texts))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert (
        reasoning
        == "".join(d.get("reasoning_content", "") for d in deltas)
        == ("I should call it.")
    )
    assert "".join(d.get("content", "") for d in deltas) == "On it."
    (call,) = [c for d in deltas for c in d.get("tool_calls", [])]
    assert (call["function"]["name"], call["function"]["arguments"]) == PARIS
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = shapes.chat_response(request, [Choice(0, (1, 2, 3), _tokens(texts))])
    message = whole["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "I should call it."
    assert message["content"] == "On it." and len(message["tool_calls"]) == 1
    assert whole["choices"][0]["finish_reason"] == "tool_calls"


def test_a_reply_cut_at_its_one_call_ends_the_stream_and_its_generation():
    shapes = _shapes(TEMPLATES["mistral"], {"[TOOL_CALLS]": 5})
    tokens = [GeneratedToken(5, ""), GeneratedToken(9, 'get_time{"zone": "UTC"}'),
              GeneratedToken(5, ""), GeneratedToken(9, 'get_weather{"city": "Paris"}'),
              *[GeneratedToken(9, " more") for _ in range(20)]]  # fmt: skip
    tokens[-1].finish_reason = "length"
    request = ChatCompletionRequest(model="m", messages=ASK, tools=[WEATHER, TIME],
                                    tool_choice="auto", parallel_tool_calls=False)  # fmt: skip
    chunks, source = _stream(shapes, request, tokens)
    calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [UTC]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert source["closed"] and source["sent"] < len(tokens)  # generation stopped early
    whole = shapes.chat_response(request, [Choice(0, (1,), tokens)])["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_time"]


def test_forced_calls_skip_the_reasoning_parser():
    """The grammar makes a forced call JSON from its first token: there is no reasoning to
    split (deepseek_r1 would otherwise take the whole call for reasoning)."""
    shapes = _shapes(TEMPLATES["hermes"], reasoning_parser="deepseek_r1")
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = ChatCompletionRequest(model="m", messages=ASK, tools=[WEATHER], tool_choice=named)
    texts = ['{"city":', '"Paris"}']
    message = shapes.chat_response(request, [Choice(0, (1,), _tokens(texts))])["choices"][0]
    assert message["message"]["tool_calls"][0]["function"]["arguments"] == PARIS[1]
    assert message["message"]["reasoning"] is None
    chunks, _ = _stream(shapes, request, _tokens(texts))
    args = [c["function"]["arguments"] for ch in chunks
            for c in ch["choices"][0]["delta"].get("tool_calls", [])]  # fmt: skip
    assert "".join(args) == PARIS[1]

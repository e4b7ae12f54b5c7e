"""A streamed tool call costs work in proportion to its text (issue 52): a reply steered
into one long call used to be rescanned whole at every token (quadratic, on the event loop:
in Python for the JSON formats, by ``str.find`` for the marker ones). The cost is counted,
never timed: the Python lines the parsers run (``sys.settrace``) stay bounded per token, and
the text a parser searches again at the next token (its ``buffer``) stays short, however
long the call grows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import meshnet_node.toolcalls
from meshnet_node.toolcalls.common import Call, JsonScan
from meshnet_node.toolcalls.formats import new_parser

PARSERS_DIR = str(Path(meshnet_node.toolcalls.__file__).parent)
TOKEN = 'ab\\"{['  # 6 characters a token: text, an escaped quote, brackets inside a string
# (format, what opens the call, what closes it)
LONG_CALLS = {
    "llama3_json": ('{"name": "f", "parameters": {"text": "', '"}}'),
    "llama3_json tagged": ('<|python_tag|>{"name": "f", "parameters": {"text": "', '"}}'),
    "mistral list": ('[TOOL_CALLS][{"name": "f", "arguments": {"text": "', '"}}]'),
    "mistral v11": ('[TOOL_CALLS]f[ARGS]{"text": "', '"}'),
    "hermes": ('<tool_call>{"name": "f", "arguments": {"text": "', '"}}</tool_call>'),
    "openai": ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"text": "',
               '"}<|call|>'),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"text\": \"",
                    '"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
}  # fmt: skip
SEARCHED_AGAIN = 64  # characters a parser may search again at each token (markers' starts)
LINES_PER_TOKEN = 60  # generous: a feed runs a few dozen lines; a rescan runs 5 a character


def _lines_run(fmt: str, opening: str, closing: str, tokens: int) -> tuple[int, int, list]:
    """Lines the parser modules run to parse the call streamed ``tokens`` pieces long (the
    count stops once over budget, so a quadratic parser fails fast), the longest text it
    kept to search again, and what it made."""
    budget = LINES_PER_TOKEN * (tokens + 2)
    count = 0

    def local(frame, event, _arg):
        nonlocal count
        if event == "line":
            count += 1
        return local if count <= budget else None

    def tracer(frame, _event, _arg):
        inside = frame.f_code.co_filename.startswith(PARSERS_DIR)
        return local if inside and count <= budget else None

    parser = new_parser(fmt.split()[0])
    pieces: list = []
    kept = 0
    sys.settrace(tracer)
    try:
        pieces += parser.feed(opening)
        for _ in range(tokens):
            pieces += parser.feed(TOKEN)
            kept = max(kept, len(parser.buffer))
        pieces += parser.feed(closing)
        pieces += parser.finish()
    finally:
        sys.settrace(None)
    return count, kept, pieces


@pytest.mark.parametrize("name", sorted(LONG_CALLS))
def test_a_long_streamed_call_costs_work_linear_in_its_length(name):
    opening, closing = LONG_CALLS[name]
    counts = {}
    for tokens in (500, 8000):
        counts[tokens], kept, pieces = _lines_run(name, opening, closing, tokens)
        assert pieces == [Call("f", '{"text":"' + 'ab\\"{[' * tokens + '"}')]
        assert counts[tokens] <= LINES_PER_TOKEN * (tokens + 2), (tokens, counts[tokens])
        assert kept <= SEARCHED_AGAIN, (tokens, kept)
    assert counts[8000] <= 20 * counts[500]  # 16 times the tokens, about 16 times the work


def test_the_scan_keeps_its_state_between_pieces():
    text = '{"a": "}\\\\", "b": ["\\"]", {"c": 1}]} tail'
    for cut in range(1, len(text)):
        scan = JsonScan()
        first = scan.feed(text[:cut])
        end = first if first is not None else cut + scan.feed(text[cut:])
        assert text[:end] == text[: text.index(" tail")], cut

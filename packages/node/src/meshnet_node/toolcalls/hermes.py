"""Hermes tool calls (Qwen2.5 / Qwen3, Hermes, most open models): each call a
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block; the text around the
blocks is content."""

from __future__ import annotations

from meshnet_node.toolcalls.common import Piece, call_from_json, until_marker

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser:
    """Content until a ``<tool_call>`` opens; each block becomes a call when it closes (one
    that does not parse is content). A block the reply ends in is a call if its JSON is
    complete (some models stop before ``</tool_call>``), else content."""

    markers = (OPEN, CLOSE)

    def __init__(self) -> None:
        self.buffer = ""

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while True:
            content, self.buffer = until_marker(self.buffer, (OPEN,))
            if content:
                out.append(content)
            if not self.buffer.startswith(OPEN):
                return out  # no block, or the end could still open one
            end = self.buffer.find(CLOSE)
            if end == -1:
                return out  # the block is still open
            call = call_from_json(self.buffer[len(OPEN) : end])
            out.append(call if call is not None else self.buffer[: end + len(CLOSE)])
            self.buffer = self.buffer[end + len(CLOSE) :]

    def finish(self) -> list[Piece]:
        left, self.buffer = self.buffer, ""
        if left.startswith(OPEN) and (call := call_from_json(left[len(OPEN) :])) is not None:
            return [call]
        return [left] if left else []

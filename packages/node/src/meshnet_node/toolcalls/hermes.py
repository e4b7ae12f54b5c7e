"""Hermes tool calls (Qwen2.5 / Qwen3, Hermes, most open models): each call a
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block; the text around the
blocks is content."""

from __future__ import annotations

from meshnet_node.toolcalls.common import OpenBlock, Piece, call_from_json, until_marker

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser:
    """Content until a ``<tool_call>`` opens; each block becomes a call when it closes (one
    that does not parse is content). A block the reply ends in is a call if its JSON is
    complete (some models stop before ``</tool_call>``), else content."""

    markers = (OPEN, CLOSE)

    def __init__(self) -> None:
        self.buffer = ""
        self.open: OpenBlock | None = None  # a block waiting for its </tool_call>

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self.open is not None:
            if not self.open.feed(text):
                return out  # only the new text was searched
            self.buffer, self.open, text = self.open.text(), None, ""
        self.buffer += text
        while True:
            content, self.buffer = until_marker(self.buffer, (OPEN,))
            if content:
                out.append(content)
            if not self.buffer.startswith(OPEN):
                return out  # no block, or the end could still open one
            end = self.buffer.find(CLOSE)
            if end == -1:  # the block is still open
                self.open, self.buffer = OpenBlock(self.buffer, (CLOSE,)), ""
                return out
            call = call_from_json(self.buffer[len(OPEN) : end])
            out.append(call if call is not None else self.buffer[: end + len(CLOSE)])
            self.buffer = self.buffer[end + len(CLOSE) :]

    def finish(self) -> list[Piece]:
        left = self.open.text() if self.open is not None else self.buffer
        self.buffer, self.open = "", None
        if left.startswith(OPEN) and (call := call_from_json(left[len(OPEN) :])) is not None:
            return [call]
        return [left] if left else []

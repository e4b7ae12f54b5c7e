"""Llama 3.x JSON tool calls (vLLM's ``llama3_json``): the reply is the call(s) as JSON,
``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), possibly after ``<|python_tag|>``,
several separated by ``;``."""

from __future__ import annotations

from meshnet_node.toolcalls.common import (
    Piece,
    call_from_json,
    could_become,
    json_end,
    until_marker,
)

TAG = "<|python_tag|>"
SEPARATORS = " \t\r\n;"


class LlamaJsonParser:
    """A reply that opens with ``{`` (or ``<|python_tag|>``) holds calls: each JSON object
    becomes a call when it closes; an object that is no call, or text after the calls, is
    content from there on. Any other reply is content, until a ``<|python_tag|>``."""

    markers = (TAG,)

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "start"  # start -> calls | content

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if not head or could_become(head, (TAG,)):
                    return out  # nothing yet, or perhaps the tag
                if head.startswith(("{", TAG)):
                    self.buffer, self.state = head, "calls"
                else:
                    self.state = "content"
            if self.state == "content":
                content, self.buffer = until_marker(self.buffer, (TAG,))
                if content:
                    out.append(content)
                if not self.buffer.startswith(TAG):
                    return out
                self.state = "calls"
            if self._calls(out):
                return out

    def _calls(self, out: list[Piece]) -> bool:
        """Calls out of the buffer; True to wait for more text, False once the rest is
        content (the state says so)."""
        while True:
            head = self.buffer.lstrip(SEPARATORS)
            while head.startswith(TAG):
                head = head[len(TAG) :].lstrip(SEPARATORS)
            self.buffer = head
            if not head or could_become(head, (TAG,)):
                return True
            if not head.startswith("{"):
                self.state = "content"
                return False
            end = json_end(head)
            if end is None:
                return True  # the object is still open
            call = call_from_json(head[:end])
            self.buffer = head[end:]
            if call is None:
                out.append(head[:end])
                self.state = "content"
                return False
            out.append(call)

    def finish(self) -> list[Piece]:
        left, self.buffer = self.buffer, ""
        return [left] if left else []

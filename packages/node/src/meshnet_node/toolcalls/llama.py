"""Llama 3.x JSON tool calls (vLLM's ``llama3_json``): the reply is the call(s) as JSON,
``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), possibly after ``<|python_tag|>``,
several separated by ``;``."""

from __future__ import annotations

from meshnet_node.toolcalls.common import (
    JsonScan,
    Piece,
    call_from_json,
    could_become,
    until_marker,
)

TAG = "<|python_tag|>"
SEPARATORS = " \t\r\n;"


class LlamaJsonParser:
    """A reply that opens with ``{`` (or ``<|python_tag|>``) holds calls: each JSON object
    becomes a call when it closes; an object that is no call, or text after the calls, is
    content from there on. Any other reply is content, until a ``<|python_tag|>``.

    An object being written is kept as its pieces, with a ``JsonScan`` that looks only at
    each new piece: a long call costs O(its length) in all, not O(length²) (issue 52)."""

    markers = (TAG,)

    def __init__(self) -> None:
        self.buffer = ""  # text not placed yet: never an open object, so short
        self.state = "start"  # start -> calls | content
        self.scan: JsonScan | None = None  # the open object's scan, and its text so far
        self.parts: list[str] = []

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self.scan is not None:  # inside an object: only the new text is looked at
            end = self.scan.feed(text)
            if end is None:
                self.parts.append(text)
                return out
            self.parts.append(text[:end])
            closed, self.parts, self.scan = "".join(self.parts), [], None
            self._closed(closed, out)
            text = text[end:]
        self.buffer += text
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
            scan = JsonScan()
            end = scan.feed(head)
            if end is None:  # the object is still open: kept aside, scanned as it grows
                self.scan, self.parts, self.buffer = scan, [head], ""
                return True
            self.buffer = head[end:]
            if not self._closed(head[:end], out):
                return False

    def _closed(self, obj: str, out: list[Piece]) -> bool:
        """A complete object: a call (True), or content from here on (False)."""
        call = call_from_json(obj)
        if call is None:
            out.append(obj)
            self.state = "content"
            return False
        out.append(call)
        return True

    def finish(self) -> list[Piece]:
        left = "".join(self.parts) + self.buffer
        self.buffer, self.parts, self.scan = "", [], None
        return [left] if left else []

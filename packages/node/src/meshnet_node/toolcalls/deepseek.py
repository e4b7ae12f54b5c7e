"""DeepSeek V3 / R1 tool calls (vLLM's ``deepseek_v3``, ``deepseek_v31``):
``<｜tool▁calls▁begin｜>`` then per call
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
(V3.1 and later: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``), then
``<｜tool▁calls▁end｜>``."""

from __future__ import annotations

import re

from meshnet_node.toolcalls.common import (
    Call,
    OpenBlock,
    Piece,
    arguments_text,
    could_become,
    until_marker,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCED = re.compile(rf"\s*(?:function)?\s*{SEP}\s*([^\s`]+)\s*```(?:json)?\s*(.*?)\s*```\s*", re.S)
BARE = re.compile(rf"\s*([^\s<]+)\s*{SEP}\s*(.*?)\s*", re.S)


def _call(block: str) -> Call | None:
    """The call one ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` block holds."""
    match = FENCED.fullmatch(block) or BARE.fullmatch(block)
    if match is None:
        return None
    arguments = arguments_text(match.group(2))
    return None if arguments is None else Call(match.group(1), arguments)


class DeepSeekParser:
    """Content until the calls begin; each call when its block closes (one that does not
    parse is content); after ``<｜tool▁calls▁end｜>``, content again."""

    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "content"  # content <-> calls
        self.opened = ""  # the calls' opening marker, content if no call follows
        self.open: OpenBlock | None = None  # a call waiting for its end marker

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self.open is not None:
            if not self.open.feed(text):
                return out  # only the new text was searched
            self.buffer, self.open, text = self.open.text(), None, ""
        self.buffer += text
        while True:
            if self.state == "content":
                content, self.buffer = until_marker(self.buffer, (CALLS_BEGIN, CALL_BEGIN))
                if content:
                    out.append(content)
                if self.buffer.startswith(CALLS_BEGIN):
                    self.buffer, self.opened = self.buffer[len(CALLS_BEGIN) :], CALLS_BEGIN
                elif not self.buffer.startswith(CALL_BEGIN):
                    return out
                self.state = "calls"
            if not self._calls(out):
                return out

    def _calls(self, out: list[Piece]) -> bool:
        """Calls out of the buffer; False to wait for more text, True once the rest is
        content (the state says so)."""
        while True:
            body = self.buffer.lstrip()
            if body.startswith(CALLS_END):
                if self.opened:  # no call between the markers: all content
                    self._content(out, CALLS_END)
                self.buffer, self.state = body[len(CALLS_END) :], "content"
                return True
            if body.startswith(CALL_BEGIN):
                end = body.find(CALL_END)
                if end == -1:  # the call is still open
                    self.open, self.buffer = OpenBlock(self.buffer, (CALL_END,)), ""
                    return False
                call = _call(body[len(CALL_BEGIN) : end])
                if call is None:
                    self._content(out, body[: end + len(CALL_END)])
                else:
                    out.append(call)
                    self.opened = ""
                self.buffer = body[end + len(CALL_END) :]
                continue
            if not body or could_become(body, (CALLS_END, CALL_BEGIN)):
                return False
            self._content(out, "")
            self.buffer, self.state = body, "content"  # text without the calls' end
            return True

    def _content(self, out: list[Piece], text: str) -> None:
        """Text of the calls' part that is no call: content, after an opening marker no
        call followed (the marker with it)."""
        text, self.opened = self.opened + text, ""
        if text:
            out.append(text)

    def finish(self) -> list[Piece]:
        if self.open is not None:
            self.buffer, self.open = self.open.text(), None
        left, self.buffer = self.buffer.lstrip() if self.state == "calls" else self.buffer, ""
        if left.startswith(CALL_BEGIN):  # the reply ended inside a call
            call = _call(left[len(CALL_BEGIN) :].removesuffix(CALLS_END))
            if call is not None:
                return [call]
        out: list[Piece] = []
        self._content(out, left)
        return out

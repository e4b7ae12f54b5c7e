"""gpt-oss harmony tool calls (vLLM's ``openai``): a message addressed to a function,
``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
(the recipient may also stand before ``<|channel|>``; the reply's first message has no
``<|start|>assistant``, the prompt ends with it). ``<|call|>`` ends generation, so a call may
also end the reply. Every other message stays in the content as it is written (the text of
harmony replies keeps its channels, docs/api.md)."""

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

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
HEADERS = (START, CHANNEL)
CALL_ENDS = (CALL, END, RETURN, START)  # what ends a call's message
RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")
MAX_HEADER = 512  # a header longer than this is no header: content


class HarmonyParser:
    """Content until a message header (``<|start|>``, ``<|channel|>``, or ``to=`` opening
    the reply) is complete at ``<|message|>``; a header addressed to ``functions.NAME``
    makes its message a call, which ends at ``<|call|>`` (or ``<|end|>``, or the reply's
    end); any other header and its message are content."""

    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, END)

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "start"  # start -> content | header | call
        self.name = ""
        self.open: OpenBlock | None = None  # a call's message waiting for its end

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self.open is not None:
            if not self.open.feed(text):
                return out  # only the new text was searched
            self.buffer, self.open, text = self.open.text(), None, ""
        self.buffer += text
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if not head or could_become(head, (*HEADERS, "to=")):
                    return out
                self.state = "header" if head.startswith((*HEADERS, "to=")) else "content"
            if self.state == "content":
                content, self.buffer = until_marker(self.buffer, HEADERS)
                if content:
                    out.append(content)
                if not self.buffer.startswith(HEADERS):
                    return out
                self.state = "header"
            if self.state == "header" and not self._header(out):
                return out
            if self.state == "call" and not self._call(out, final=False):
                return out

    def _header(self, out: list[Piece]) -> bool:
        """Reads a complete header; False while it is still being written."""
        at = self.buffer.find(MESSAGE)
        if at == -1:
            if len(self.buffer) <= MAX_HEADER:
                return False
            out.append(self.buffer)  # no header after all
            self.buffer, self.state = "", "content"
            return True
        header, rest = self.buffer[: at + len(MESSAGE)], self.buffer[at + len(MESSAGE) :]
        match = RECIPIENT.search(header)
        if match is None:
            out.append(header)
            self.state = "content"
        else:
            self.name, self.state = match.group(1), "call"
        self.buffer = rest
        return True

    def _call(self, out: list[Piece], *, final: bool) -> bool:
        """The call's message, once it ends; False while it is still being written."""
        ends = [(i, m) for m in CALL_ENDS if (i := self.buffer.find(m)) != -1]
        if not ends and not final:  # still open
            self.open, self.buffer = OpenBlock(self.buffer, CALL_ENDS), ""
            return False
        at, marker = min(ends) if ends else (len(self.buffer), "")
        body = self.buffer[:at].strip()
        arguments = arguments_text(body)
        out.append(Call(self.name, arguments if arguments is not None else body))
        skip = 0 if marker in ("", START) else len(marker)
        self.buffer, self.state = self.buffer[at + skip :], "content"
        return True

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.open is not None:
            self.buffer, self.open = self.open.text(), None
        if self.state == "call":
            self._call(out, final=True)
        if self.buffer:
            out.append(self.buffer)
        self.buffer = ""
        return out

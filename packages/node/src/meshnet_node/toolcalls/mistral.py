"""Mistral tool calls (vLLM's ``mistral``): ``[TOOL_CALLS]`` then either a JSON list of
calls, ``[{"name": ..., "arguments": {...}}, ...]`` (tokenizers before v11: Mistral 7B v0.3,
Mixtral), or one call as ``NAME[ARGS]{...}`` (v11 on: Mistral Small 3.x, Magistral,
Devstral; ``[CALL_ID]id`` may come before ``[ARGS]``), ``[TOOL_CALLS]`` again before each
further call."""

from __future__ import annotations

import json
import re

from meshnet_node.toolcalls.common import (
    Call,
    JsonScan,
    Piece,
    arguments_text,
    call_of,
    could_become,
    until_marker,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# the call's head before its arguments: the name, an optional call id, an optional [ARGS]
# (absent when the special token was dropped from the text)
HEAD = re.compile(r"([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_\-]*\s*)?(?:\[ARGS\]\s*)?")
HEAD_CHARS = re.compile(r"[A-Za-z0-9_.\-\[\]\s]*")  # what a head still being written holds
MAX_HEAD = 160


class MistralParser:
    """Content until ``[TOOL_CALLS]``; then calls, each when its JSON closes. What does not
    parse is content from there on (the marker with it)."""

    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "content"  # content <-> calls
        # a call whose JSON is still open: its scan looks only at each new piece, and the
        # buffer is kept as pieces until it closes (O(new text) a token, issue 52)
        self.open: JsonScan | None = None
        self.parts: list[str] = []

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self.open is not None:
            self.parts.append(text)
            if self.open.feed(text) is None:
                return out
            self._gather()
            text = ""
        self.buffer += text
        while True:
            if self.state == "content":
                content, self.buffer = until_marker(self.buffer, (TOOL_CALLS,))
                if content:
                    out.append(content)
                if not self.buffer.startswith(TOOL_CALLS):
                    return out
                self.state = "calls"
            if self._calls(out, final=False):
                return out

    def _calls(self, out: list[Piece], *, final: bool) -> bool:
        """Calls out of the buffer (which starts at a ``[TOOL_CALLS]``, or after a call);
        True to wait for more text, False once the rest is content."""
        while True:
            body = self.buffer.lstrip()
            if body.startswith(TOOL_CALLS):
                body = body[len(TOOL_CALLS) :].lstrip()
            elif body and not could_become(body, (TOOL_CALLS,)):
                self.state = "content"  # text after the calls
                self.buffer = body
                return False
            if not body or could_become(body, (TOOL_CALLS,)):
                return not final
            calls, used, scan = self._parse(body)
            if calls is None:
                if used is None and not final:
                    if scan is not None:  # the JSON is open: scanned on as it comes
                        self.open, self.parts, self.buffer = scan, [self.buffer], ""
                    return True  # not complete yet
                out.append(self.buffer)  # not a call: content, the marker with it
                self.buffer, self.state = "", "content"
                return False
            out.extend(calls)
            self.buffer = body[used:]

    @staticmethod
    def _parse(body: str) -> tuple[list[Call] | None, int | None, JsonScan | None]:
        """(calls, length used, None) of the text after a ``[TOOL_CALLS]``; (None, None,
        scan) while it could still become calls (``scan``: of its open JSON, if begun),
        (None, 0, None) when it cannot."""
        if body[0] in "[{":  # a JSON list of calls (or one call object)
            scan = JsonScan()
            end = scan.feed(body)
            if end is None:
                return None, None, scan
            try:
                value = json.loads(body[:end])
            except ValueError:
                return None, 0, None
            items = value if isinstance(value, list) else [value]
            calls = [call_of(item) for item in items]
            if not calls or any(c is None for c in calls):
                return None, 0, None
            return calls, end, None
        brace = body.find("{")
        if brace == -1:
            waiting = len(body) < MAX_HEAD and HEAD_CHARS.fullmatch(body)
            return None, None if waiting else 0, None
        head = HEAD.fullmatch(body[:brace])
        if head is None:
            return None, 0, None
        scan = JsonScan()
        end = scan.feed(body, brace)
        if end is None:
            return None, None, scan
        arguments = arguments_text(body[brace:end])
        if arguments is None:
            return None, 0, None
        return [Call(head.group(1), arguments)], end, None

    def _gather(self) -> None:
        """The open call's pieces back into the buffer (it closed, or the reply ended)."""
        self.buffer, self.parts, self.open = "".join(self.parts), [], None

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.open is not None:
            self._gather()
        if self.state == "calls":
            self._calls(out, final=True)
        if self.buffer:
            out.append(self.buffer)
        self.buffer = ""
        return out

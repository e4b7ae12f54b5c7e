"""What every tool-call parser shares: the pieces a reply splits into (content text and
complete calls), a scan for where a JSON value ends, and holding back text that may still
become a marker.

A parser is fed the reply's text as it comes (``feed``) and told when it ends (``finish``);
both return the pieces that became certain, in order. Whole replies are parsed by the same
code (one ``feed`` then ``finish``), so a streamed reply always adds up to the whole one."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Call:
    """One complete tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


Piece = str | Call  # content text, or a call


class ToolParser(Protocol):
    """A model's tool-call format, parsed incrementally."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


def compact(value) -> str:
    """JSON as the grammar writes it (no spaces): streamed and whole replies agree."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def arguments_text(arguments) -> str | None:
    """Arguments as compact JSON text: an object as it is, a string holding JSON (some models
    write them so) decoded first; None for anything else."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return compact(arguments) if isinstance(arguments, dict) else None


def call_of(obj) -> Call | None:
    """The call a decoded ``{"name": ..., "arguments"|"parameters": {...}}`` object makes
    (None: it is no call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    given = obj.get("arguments", obj.get("parameters", {}))
    arguments = arguments_text(given)
    return None if arguments is None else Call(obj["name"], arguments)


def call_from_json(text: str) -> Call | None:
    try:
        return call_of(json.loads(text))
    except ValueError:
        return None


class JsonScan:
    """Where a JSON object or array ends, found as its text comes: the bracket depth and
    the string and escape state are kept between feeds, so each character is looked at
    once however many pieces it comes in (a stream's parser does O(new text) per token,
    issue 52). Runs of plain characters are skipped by a regex, in C."""

    _OUTSIDE = re.compile(r'["{}\[\]]')  # what changes the state outside a string
    _INSIDE = re.compile(r'["\\]')  # ... and inside one

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False

    def feed(self, text: str, start: int = 0) -> int | None:
        """The index in ``text`` just after the closing bracket of the value that opened at
        the first fed character; None while it is still open (``text`` is all consumed)."""
        at, size = start, len(text)
        while at < size:
            if self.escaped:  # the character after a backslash in a string
                self.escaped, at = False, at + 1
                continue
            found = (self._INSIDE if self.in_string else self._OUTSIDE).search(text, at)
            if found is None:
                return None
            ch, at = found.group(), found.end()
            if self.in_string:
                if ch == "\\":
                    self.escaped = True
                else:  # its closing quote
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return at
        return None


class OpenBlock:
    """The text of a block still open (a call whose end marker has not come), kept as its
    pieces: each new piece is searched once for ``markers``, with only the few characters
    before it that could begin one, so a long block costs O(its length) in all (issue 52).
    ``feed`` says when a marker has come; the parser then reads ``text()`` once."""

    def __init__(self, text: str, markers: tuple[str, ...]) -> None:
        self.markers = markers
        self.keep = max(len(m) for m in markers) - 1  # what may begin a marker
        self.parts = [text]
        self.tail = text[len(text) - self.keep :] if self.keep else ""

    def feed(self, text: str) -> bool:
        """Takes ``text``; True once a marker has come (in it, or across its start)."""
        self.parts.append(text)
        window = self.tail + text
        if any(m in window for m in self.markers):
            return True
        self.tail = window[len(window) - self.keep :] if self.keep else ""
        return False

    def text(self) -> str:
        return "".join(self.parts)


def json_end(text: str, start: int = 0) -> int | None:
    """Where the JSON object or array opening at ``text[start]`` ends (the index after its
    closing bracket), strings and escapes respected; None while it is still open."""
    return JsonScan().feed(text, start)


def held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that could still begin one of ``markers``."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def until_marker(text: str, markers: tuple[str, ...]) -> tuple[str, str]:
    """(content, rest): the text before the first of ``markers``, and the rest, which starts
    with that marker, or is the end of ``text`` that could still become one (held back)."""
    found = [i for i in (text.find(m) for m in markers) if i != -1]
    if found:
        cut = min(found)
        return text[:cut], text[cut:]
    keep = held(text, markers)
    return text[: len(text) - keep], text[len(text) - keep :]


def could_become(text: str, markers: tuple[str, ...]) -> bool:
    """Whether ``text`` is a proper beginning of one of ``markers``."""
    return any(len(text) < len(m) and m.startswith(text) for m in markers)

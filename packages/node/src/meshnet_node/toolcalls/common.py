"""What every tool-call parser shares: the pieces a reply splits into (content text and
complete calls), a scan for where a JSON value ends, and holding back text that may still
become a marker.

A parser is fed the reply's text as it comes (``feed``) and told when it ends (``finish``);
both return the pieces that became certain, in order. Whole replies are parsed by the same
code (one ``feed`` then ``finish``), so a streamed reply always adds up to the whole one."""

from __future__ import annotations

import json
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


def json_end(text: str, start: int = 0) -> int | None:
    """Where the JSON object or array opening at ``text[start]`` ends (the index after its
    closing bracket), strings and escapes respected; None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


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

"""Reasoning parsers (``--reasoning-parser``): the ``<think>...</think>`` text of reasoning
models returned as ``reasoning_content``, apart from ``content``, streaming included.

``deepseek_r1``: the reply is reasoning until ``</think>`` (the template may already have
opened the block in the prompt; a leading ``<think>`` is dropped). ``qwen3``: reasoning only
when the reply opens with ``<think>``; otherwise (e.g. ``enable_thinking: false``) it is all
content. As vLLM's parsers of the same names."""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _held(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Feeds text deltas, returns (reasoning delta, content delta) as they become certain."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.parser = parser
        self.phase = "start"  # start -> reasoning -> content
        self.pending = ""

    def feed(self, delta: str, *, final: bool = False) -> tuple[str, str]:
        text, self.pending = self.pending + delta, ""
        reasoning, content = "", ""
        if self.phase == "start":
            stripped = text.lstrip()
            if stripped.startswith(START):
                text, self.phase = stripped[len(START) :], "reasoning"
            elif not final and START.startswith(stripped):  # could still become "<think>"
                self.pending = text
                return "", ""
            else:
                self.phase = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self.phase == "reasoning":
            cut = text.find(END)
            if cut == -1:
                keep = 0 if final else _held(text, END)
                self.pending = text[len(text) - keep :] if keep else ""
                return text[: len(text) - keep], ""
            reasoning, text, self.phase = text[:cut], text[cut + len(END) :], "content"
        return reasoning, content + text

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole reply at once: (reasoning or None, content)."""
        reasoning, content = self.feed(text, final=True)
        return (reasoning or None), content

"""Token ids to text, incrementally: deltas for a stream, partial UTF-8 held back, stop strings
cut across token boundaries.

Each token costs work bounded by the last few tokens, not by the length of the output: fast
tokenizers decode through ``tokenizers``' ``DecodeStream``; others (and a fast one whose
``decode`` post-processes, or if the stream fails) decode a window of the ids since the
last piece of text given out plus that piece's ids as context (the prefix-offset technique
of TGI and vLLM). Either way the concatenated pieces equal
``tokenizer.decode(all_ids, skip_special_tokens=True)``, less an unfinished character at
the end.

Reasoning parsers (``--reasoning-parser``): the ``<think>...</think>`` text of reasoning
models returned as ``reasoning_content``, apart from ``content``, streaming included.

``deepseek_r1``: the reply is reasoning until ``</think>`` (the template may already have
opened the block in the prompt; a leading ``<think>`` is dropped). ``qwen3``: reasoning only
when the reply opens with ``<think>``; otherwise (e.g. ``enable_thinking: false``) it is all
content. As vLLM's parsers of the same names.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what an incomplete (or invalid) UTF-8 sequence decodes to


class IncrementalDecoder:
    """Decodes one token at a time; ``step`` returns the new text, or None while the text
    so far ends in an unfinished character (or the token adds no text)."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "_tokenizer", None)
        # transformers' clean-up of tokenization spaces is not part of the tokenizers
        # pipeline DecodeStream runs: with it on, decode windows through the tokenizer.
        streamable = isinstance(backend, Tokenizer) and not getattr(
            tokenizer, "clean_up_tokenization_spaces", False
        )
        self._backend = backend if streamable else None
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if streamable else None
        self.context: list[int] = []  # ids of the last piece given out (decoding context)
        self.unread: list[int] = []  # ids since then, whose text is not given out yet

    @property
    def streaming(self) -> bool:
        """Whether ``DecodeStream`` does the work (else windows through ``decode``)."""
        return self._stream is not None

    def step(self, token_id: int) -> str | None:
        self.unread.append(token_id)
        piece = self._stream_step(token_id) if self._stream is not None else self._window_step()
        if piece is not None:
            self.context, self.unread = self.unread, []
        return piece

    def peek(self) -> str:
        """The text the unread ids decode to now (an unfinished character as U+FFFD)."""
        if not self.unread:
            return ""
        prefix = self._decode(self.context)
        return self._decode(self.context + self.unread)[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _stream_step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as exc:  # e.g. a decoder whose output is not prefix-stable
            logger.warning("incremental decoding failed (%s); decoding windows instead", exc)
            self._stream = None
            return self._window_step()

    def _window_step(self) -> str | None:
        prefix = self._decode(self.context)
        text = self._decode(self.context + self.unread)
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT):
            return None
        return text[len(prefix) :]


# Chat formats whose structure is carried by special tokens: a client needs them in the text
# (gpt-oss's harmony: <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final).
STRUCTURAL_SPECIAL_TOKENS = ("<|channel|>", "<|message|>")


def skips_special_tokens(tokenizer) -> bool:
    """The model's default for ``skip_special_tokens``: False when its chat format is made of
    special tokens (harmony), True otherwise. ``<think>`` blocks (Qwen3, DeepSeek-R1) are not
    special tokens in those tokenizers, so they stay in the text either way."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else {}
    return not all(token in vocab for token in STRUCTURAL_SPECIAL_TOKENS)


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins some stop string (0: none)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class TextAssembler:
    """Turns token ids into text deltas, holding back partial UTF-8 and possible stop prefixes.

    A delta never contains an unfinished character, nor an end that could still become a
    stop string (that end is released once it cannot). When a stop string appears, the
    text before it is returned and the stop itself never is.
    """

    def __init__(self, tokenizer, stop: Sequence[str], *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stopped = False
        self._pieces: list[str] = []  # text given out
        self._pending = ""  # decoded text held back: it could begin a stop string

    @property
    def text(self) -> str:
        """The text so far (given out and held back), cut at a stop string once hit."""
        return "".join(self._pieces) + self._pending

    def add(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (text delta safe to emit, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        piece = self.decoder.step(token_id)
        if piece is None:
            if self.stop:  # a stop string may already stand before an unfinished character
                partial = self.decoder.peek().rstrip(REPLACEMENT)
                if partial and (before := self._stop_in(self._pending + partial)) is not None:
                    return self._stopped(before), True
            return "", False
        text = self._pending + piece
        if (before := self._stop_in(text)) is not None:
            return self._stopped(before), True
        keep = _stop_prefix_len(text, self.stop)
        self._pending = text[len(text) - keep :] if keep else ""
        return self._give(text[: len(text) - keep]), False

    def finish(self) -> str:
        """The held-back text (an unfinished character at the end is dropped)."""
        delta, self._pending = self._pending, ""
        return self._give(delta)

    def _stop_in(self, text: str) -> str | None:
        """The text before the first listed stop string found in ``text`` (None: none is).

        Only the held-back text and the new piece are searched: a stop string cannot start
        in text already given out, since any end that could begin one is held back.
        """
        for stop in self.stop:
            cut = text.find(stop)
            if cut != -1:
                return text[:cut]
        return None

    def _stopped(self, before: str) -> str:
        self.stopped = True
        self._pending = ""
        return self._give(before)

    def _give(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta


# -- reasoning parsers ------------------------------------------------------------------

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

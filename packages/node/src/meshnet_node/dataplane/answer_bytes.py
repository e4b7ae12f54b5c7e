"""A step's answer as bytes: what a tail answers and the hops relay back (docs/adr/0040).

The answer to a step travels back up the chain as the tail wrote it; only the head reads it
(and a hop that verified drafts counts the tokens the tail kept). Big-endian::

    magic "MSA1" | flags (u8: token, stale, more, prompt log-probabilities)
    token: id (u32) | log-probability (f64) | alternatives (u16 n, then n x (u32, f64))
    more: count (u16), then each token as above
    prompt log-probabilities: count (u32), then each as (f64, alternatives)

A log-probability of -inf (or NaN) travels as ``LOGPROB_FLOOR``, as it did in JSON. A
client that is not a node, which sent its step as HTTP headers, gets the JSON of
``StepResult`` instead (``to_json``).
"""

from __future__ import annotations

import struct

from meshnet_common.protocol import StepResult
from meshnet_node.dataplane.steps import wire_logprob

MAGIC = b"MSA1"
CONTENT_TYPE = "application/x-meshnet-answer"
_TOKEN, _STALE, _MORE, _PROMPT = (1 << i for i in range(4))
_HEAD = struct.Struct("!4sB")
_ENTRY = struct.Struct("!Id")  # a token id (or an alternative) and its log-probability
_COUNT = struct.Struct("!H")
_PROMPT_COUNT = struct.Struct("!I")
_LOGPROB = struct.Struct("!d")
_LONE = struct.Struct("!4sBIdH")  # a token alone: head, entry, no alternatives (most answers)


def _alternatives(tops) -> bytes:
    out = [_COUNT.pack(len(tops))]
    out.extend(_ENTRY.pack(int(i), wire_logprob(lp)) for i, lp in tops)
    return b"".join(out)


def _token(token_id, logprob, tops) -> bytes:
    return _ENTRY.pack(int(token_id), wire_logprob(logprob)) + _alternatives(tops)


def encode(token=None, more=None, *, stale: bool = False) -> bytes:
    """A tail's answer: its sampled ``token`` (a ``SampledToken``; None: it sampled none),
    ``more`` tokens after it (a step that verified drafts: said even when empty), or a
    ``stale`` guess."""
    lone = token is not None and more is None and not stale
    if lone and not token.top_logprobs and token.prompt_logprobs is None:
        # a token alone, in one call: a tail writes this after every pass
        return _LONE.pack(MAGIC, _TOKEN, int(token.token_id), wire_logprob(token.logprob), 0)
    prompt = None if token is None else token.prompt_logprobs
    flags = ((_TOKEN if token is not None else 0) | (_STALE if stale else 0)
             | (_MORE if more is not None else 0) | (_PROMPT if prompt is not None else 0))  # fmt: skip
    parts = [_HEAD.pack(MAGIC, flags)]
    if token is not None:
        parts.append(_token(token.token_id, token.logprob, token.top_logprobs))
    if more is not None:
        parts.append(_COUNT.pack(len(more)))
        parts.extend(_token(t.token_id, t.logprob, t.top_logprobs) for t in more)
    if prompt is not None:
        parts.append(_PROMPT_COUNT.pack(len(prompt)))
        parts.extend(_LOGPROB.pack(wire_logprob(lp)) + _alternatives(top) for lp, top in prompt)
    return b"".join(parts)


EMPTY = encode()
STALE = encode(stale=True)


class _Reader:
    __slots__ = ("body", "at")

    def __init__(self, body: bytes, at: int) -> None:
        self.body, self.at = body, at

    def take(self, shape: struct.Struct) -> tuple:
        values = shape.unpack_from(self.body, self.at)  # struct.error past the end
        self.at += shape.size
        return values

    def alternatives(self) -> list[tuple[int, float]]:
        (n,) = self.take(_COUNT)
        return [self.take(_ENTRY) for _ in range(n)]

    def token(self) -> tuple[int, float, list[tuple[int, float]]]:
        token_id, logprob = self.take(_ENTRY)
        return token_id, logprob, self.alternatives()


def decode(body: bytes) -> StepResult:
    """The ``StepResult`` in an answer's bytes (``ValueError`` where they are not one)."""
    try:
        magic, flags = _HEAD.unpack_from(body, 0)
        if magic != MAGIC or flags >> 4:
            raise ValueError("not a step answer")
        read = _Reader(body, _HEAD.size)
        fields: dict = {"top_logprobs": [], "compute_ms": []}
        if flags & _TOKEN:
            fields["token_id"], fields["logprob"], fields["top_logprobs"] = read.token()
        if flags & _STALE:
            fields["stale"] = True
        if flags & _MORE:
            (n,) = read.take(_COUNT)
            fields["more"] = [read.token() for _ in range(n)]
        if flags & _PROMPT:
            (n,) = read.take(_PROMPT_COUNT)
            fields["prompt_logprobs"] = [(read.take(_LOGPROB)[0], read.alternatives())
                                         for _ in range(n)]  # fmt: skip
    except struct.error as exc:
        raise ValueError(f"a step answer ends early: {exc}") from exc
    if read.at != len(body):
        raise ValueError("a step answer has bytes after its end")
    return StepResult.model_construct(**fields)


def token_of(body: bytes) -> int | None:
    """The token an answer's bytes name, read without the rest (None: none, or not an
    answer); ``decode`` reads and checks the whole."""
    if len(body) < _HEAD.size + _ENTRY.size or body[:4] != MAGIC or not body[4] & _TOKEN:
        return None
    return _ENTRY.unpack_from(body, _HEAD.size)[0]


def kept(body: bytes) -> int:
    """How many tokens after the first an answer holds (drafts the tail kept, then its own)."""
    result = decode(body)
    return len(result.more or ())


def to_json(body: bytes) -> bytes:
    """An answer as ``StepResult``'s JSON (without compute times): for a client that is
    not a node. A token's answer names only the fields it has; one without (a step that
    sampled nothing, a stale guess) names every field."""
    result = decode(body)
    sampled = result.token_id is not None
    return result.model_dump_json(exclude={"compute_ms"}, exclude_none=sampled).encode()

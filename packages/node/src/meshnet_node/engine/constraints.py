"""Structured output on the tail: an llguidance matcher per session masks the tokens that
would break its grammar (a JSON schema, or any JSON object). ADR-0017.

The matcher advances on the session's history as the steps bring it (the ids header), not on
what this tail sampled: a failover replay into a fresh session rebuilds the same state."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from meshnet_common.errors import InvalidRequest
from meshnet_common.protocol import GRAMMAR_MAX_BYTES, GrammarSpec

NEG_INF = float("-inf")


# What one grammar may cost (issue #35): its JSON schema's text travels in the open header
# (GRAMMAR_MAX_BYTES), and llguidance's own fuel and size limits bound the work of compiling
# it (at the head, then per session on the tail) whatever its shape.
GRAMMAR_MAX_SYMBOLS = 100_000  # llguidance's default: 500_000


def parser_limits():
    """llguidance's limits for every grammar compiled here."""
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=GRAMMAR_MAX_SYMBOLS)


def json_grammar(
    kind: str,
    schema: dict | None,
    *,
    param: str = "response_format",
    max_chars: int = GRAMMAR_MAX_BYTES,
) -> GrammarSpec:
    """The grammar of an OpenAI ``response_format`` (or a forced tool call: ``param``
    "tools"); InvalidRequest for a schema or grammar beyond ``max_chars`` (the head's
    --max-schema-chars, at most GRAMMAR_MAX_BYTES) or one llguidance cannot compile within
    its limits (checked before any session opens)."""
    import json

    import llguidance

    text = json.dumps({"type": "object"} if kind == "json_object" else schema)
    max_chars = min(max_chars, GRAMMAR_MAX_BYTES)  # what a hop header carries
    if len(text) > max_chars:
        raise _too_large(f"the JSON schema has {len(text)} characters", param, max_chars)
    # Compact JSON (", " and ": " separators, no free whitespace): a model cannot pad the
    # answer with endless newlines, which small or unsure models otherwise do.
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        text, defaults={"whitespace_flexible": False}
    )
    if len(grammar) > max_chars:
        raise _too_large(f"its grammar has {len(grammar)} characters", param, max_chars)
    problem = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if problem:
        raise InvalidRequest(f"unusable JSON schema: {problem}", param=param)
    return GrammarSpec(kind=kind, grammar=grammar)


def _too_large(what: str, param: str, max_chars: int) -> InvalidRequest:
    return InvalidRequest(
        f"{what}; a JSON schema is at most {max_chars} characters", param=param,
        code="schema_too_large",
    )  # fmt: skip


class Constraint:
    """One session's matcher: ``mask`` turns the logits of tokens the grammar forbids next to
    -inf; ``advance`` consumes the generated tokens once they are known."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # tokens the grammar knows (the tokenizer's)
        self.consumed = 0  # generated tokens fed to the matcher

    def advance(self, generated: list[int]) -> None:
        for token in generated[self.consumed :]:
            if token < 0:
                break  # not arrived yet
            if not self.matcher.consume_token(token):
                raise InvalidRequest(
                    f"token {token} breaks the grammar: {self.matcher.get_error()}",
                    param="response_format",
                )
            self.consumed += 1

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        import llguidance.torch as llg_torch

        bitmask = llg_torch.allocate_token_bitmask(1, self.vocab_size)
        llg_torch.fill_next_token_bitmask(self.matcher, bitmask, 0)
        allowed = _unpack(bitmask[0], self.vocab_size)  # (vocab_size,) bool
        if scores.numel() > self.vocab_size:  # padded embedding rows: never valid text
            allowed = torch.cat([allowed, allowed.new_zeros(scores.numel() - self.vocab_size)])
        return scores.masked_fill(~allowed[: scores.numel()], NEG_INF)


def _unpack(words: torch.Tensor, n: int) -> torch.Tensor:
    """llguidance's bitmask (int32 words, bit i of word w = token 32w + i) as booleans."""
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:n].bool()


class ConstraintFactory:
    """Builds matchers for one stage; the tokenizer's llguidance view is made once, when the
    first constrained session opens (it takes ~0.5 s for a 50k vocabulary)."""

    def __init__(self, snapshot: Path) -> None:
        self.snapshot = Path(snapshot)
        self._tokenizer = None
        self._lock = threading.Lock()

    def _lltokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.snapshot)
                self._tokenizer = llguidance.hf.from_tokenizer(tokenizer)
            return self._tokenizer

    def __call__(self, spec: GrammarSpec) -> Constraint:
        import llguidance

        tokenizer = self._lltokenizer()
        matcher = llguidance.LLMatcher(tokenizer, spec.grammar, limits=parser_limits())
        if matcher.is_error():
            raise InvalidRequest(f"grammar: {matcher.get_error()}", param="response_format")
        return Constraint(matcher, tokenizer.vocab_size)

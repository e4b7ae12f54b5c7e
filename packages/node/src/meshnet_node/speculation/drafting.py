"""Speculative decoding from the head (docs/adr/0019): draft tokens proposed by looking the
text's last words up earlier in the same text (n-gram prompt lookup, no extra model), and
how many to propose, chosen from the measured acceptance and step times.

The chain verifies a step's drafts in one traversal: every hop runs the ``k + 1`` positions
in one pass, the tail samples each position and keeps the drafts up to the first one it
would not have produced, plus its own token there. A traversal then yields between 1 and
``k + 1`` tokens, and over slow links the traversal is what costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from meshnet_common.protocol import SamplingSpec

MAX_DRAFT = 8  # tokens proposed per step at most
PROBE_EVERY = 16  # steps between probes of a length the model says does not pay


class SpeculationSettings(NamedTuple):
    mode: str = "off"  # greedy | all | off (see ``speculates``)
    max_draft: int = MAX_DRAFT
    max_running: int = 2  # generations on the head beyond which no step drafts
    # over a chain: decode steps of a generation in flight (guess steps, ADR-0019); 0 or
    # 1: none, drafts verified in one pass instead
    guess_depth: int = 8  # --guess-steps


def speculates(sampling: SamplingSpec, mode: str) -> bool:
    """Whether drafts may be verified for this request: ``mode`` ``greedy`` (default) for
    temperature 0 only, ``all`` for sampled requests too (the acceptance rule keeps their
    distribution), ``off``. Penalties and grammars count the history token by token, which
    a multi-token verification would have to replay: those requests decode one at a time."""
    if mode == "off" or sampling.penalized or sampling.grammar is not None:
        return False
    return mode == "all" or sampling.temperature < 1e-5


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the text's
    last ``n`` tokens (longest ``n`` first). The index grows with the text, so a proposal
    costs the same at any length."""

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.text: list[int] = []
        # n-gram -> where its latest occurrence ends, and where the one before it ends
        self._last: dict[tuple[int, ...], int] = {}
        self._before: dict[tuple[int, ...], int] = {}

    def extend(self, tokens) -> None:
        text = self.text
        for token in tokens:
            text.append(int(token))
            end = len(text)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                gram = tuple(text[end - n : end])
                previous = self._last.get(gram)
                if previous is not None:
                    self._before[gram] = previous
                self._last[gram] = end

    def sync(self, context: list[int]) -> None:
        """Bring the index up to ``context`` (which only ever grows by appending)."""
        if context[: len(self.text)] != self.text:  # not an extension: index it anew
            self.text, self._last, self._before = [], {}, {}
        self.extend(context[len(self.text) :])

    def propose(self, k: int) -> list[int]:
        text = self.text
        for n in range(min(self.max_n, len(text)), self.min_n - 1, -1):
            gram = tuple(text[len(text) - n :])
            if self._last.get(gram) != len(text):
                continue
            start = self._before.get(gram)
            if start is not None:
                # Where the earlier occurrence runs into the text's end (a repeating
                # pattern), the proposal goes on copying itself: each proposed token is
                # text as far as the tokens after it are concerned.
                out = text[start : start + k]
                while len(out) < k:
                    out.append(out[len(out) - (len(text) - start)])
                return out
        return []


@dataclass
class _Mean:
    """An exponentially weighted mean (None until the first sample)."""

    weight: float
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = (
            sample if self.value is None else self.value + self.weight * (sample - self.value)
        )


class DraftPolicy:
    """How many drafts a step should carry, from what this head measured.

    A step with ``k`` drafts costs about ``link + compute(0) + k * c`` and yields
    ``(1 - a^(k+1)) / (1 - a)`` tokens when each draft is accepted with probability ``a``.
    ``link`` is a step's wall time outside the hops' compute (links, messages: the same
    whatever ``k``), learned from every step; ``compute(0)`` from steps without drafts; ``c``
    (each draft's compute on every hop) from the compute of steps with them. Kept apart, a
    link that becomes slower (or faster) moves ``link`` within a few steps, drafting or not,
    instead of reading as drafts that cost more. The policy picks the ``k`` with the most
    tokens per second; 0 (no drafting) when nothing pays, probing again now and then in
    case the link or the text changed. Times are the head's (shared by its generations);
    acceptance is each generation's own, starting from the head's recent mean."""

    def __init__(self, max_draft: int = MAX_DRAFT) -> None:
        self.max_draft = max_draft
        self.link_s = _Mean(0.3)  # a step's wall time outside compute
        self.plain_s = _Mean(0.2)  # the compute of a step without drafts (every hop)
        self.per_draft_s = _Mean(0.2)  # what each draft adds to a step's compute
        self.acceptance = _Mean(0.1, 0.6)  # the head's recent acceptance (a prior)

    def observe(self, drafts: int, wall_s: float, compute_s: float | None = None) -> None:
        """A step's wall time and the compute in it (every hop's, and drafting's); without
        a compute figure the whole wall counts as compute."""
        compute_s = wall_s if compute_s is None else min(compute_s, wall_s)
        self.link_s.add(wall_s - compute_s)
        if drafts == 0:
            self.plain_s.add(compute_s)
        elif self.plain_s.value is not None:
            self.per_draft_s.add(max(0.0, compute_s - self.plain_s.value) / drafts)

    def choose(self, acceptance: float, steps: int) -> int:
        """Drafts for the next step of a generation whose drafts were accepted at rate
        ``acceptance``; ``steps`` counts its steps (for probing)."""
        if self.plain_s.value is None:  # measure a plain step first
            return 0
        if self.per_draft_s.value is None:
            return min(4, self.max_draft)  # then one with drafts
        plain = self.plain_s.value + (self.link_s.value or 0.0)
        best, best_rate = 0, 1.0 / max(plain, 1e-6)
        for k in range(1, self.max_draft + 1):
            rate = expected_tokens(acceptance, k) / (plain + k * self.per_draft_s.value)
            if rate > best_rate * 1.02:  # a margin: noise alone should not switch it on
                best, best_rate = k, rate
        if best == 0 and steps % PROBE_EVERY == PROBE_EVERY - 1:
            return 2  # look again: the text or the link may have changed
        return best


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step with ``k`` drafts yields when each is accepted with ``acceptance``."""
    a = min(max(acceptance, 0.0), 1.0)
    return k + 1.0 if math.isclose(a, 1.0) else (1.0 - a ** (k + 1)) / (1.0 - a)


class Speculation:
    """One generation's drafting: its drafter (n-gram lookup, or a draft model's session)
    over its text, and its own acceptance rate."""

    def __init__(self, policy: DraftPolicy, model_session=None) -> None:
        self.policy = policy
        self.drafter = NgramDrafter()
        self.model_session = model_session  # a DraftSession (meshnet_node.speculation.draft_model)
        self.acceptance = _Mean(0.3, policy.acceptance.value)
        self.steps = 0
        self.drafted = 0
        self.accepted = 0

    def length(self, room: int) -> int:
        """How many drafts the next step should carry; at most ``room`` (what max_tokens
        and the context window still allow)."""
        self.steps += 1
        return max(0, min(self.policy.choose(self.acceptance.value or 0.0, self.steps), room))

    def propose(self, context: list[int], k: int) -> list[int]:
        """``k`` drafts after ``context`` (history and the step's input token). A draft
        model computes: call it off the event loop."""
        if k <= 0:
            return []
        if self.model_session is not None:
            return self.model_session.propose(context, k)
        self.drafter.sync(context)
        return self.drafter.propose(k)

    def settle(
        self, drafted: int, accepted: int, wall_s: float, compute_s: float | None = None
    ) -> None:
        self.policy.observe(drafted, wall_s, compute_s)
        if drafted:
            # Drafts are judged up to the first rejected one: the accepted ones and that one.
            judged = accepted + (accepted < drafted)
            rate = accepted / judged
            self.acceptance.add(rate)
            self.policy.acceptance.add(rate)
            self.drafted += drafted
            self.accepted += accepted

"""Token sampling on the tail: logit bias, penalties, greedy or temperature with min-p,
top-k and top-p, seeded per session. The order follows vLLM's sampler: bias, then the
repetition / frequency / presence penalties, then temperature, min-p, top-k, top-p; the
reported log-probabilities are the model's own (before any of it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshnet_common.protocol import SamplingSpec

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM does)
UNKNOWN = -1  # a history slot whose step has not arrived yet


@dataclass
class SampledToken:
    """The chosen token, its log-probability and the top alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    # the first token of a session that scores its prompt: each prompt token's entry
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class _Counts:
    """What the penalties need from the history, kept up to date token by token: the ids
    seen anywhere (repetition) and how often each id was generated (presence, frequency)."""

    def __init__(self, vocab: int, prompt_tokens: int) -> None:
        self.vocab = vocab
        self.prompt_tokens = prompt_tokens
        self.folded = 0  # history entries counted so far
        self._seen: set[int] = set()
        self.seen_ids: list[int] = []
        self.output = torch.zeros(vocab)  # generated count per id
        self._generated: set[int] = set()
        self.output_ids: list[int] = []
        self._tensors: dict[str, tuple[int, torch.Tensor]] = {}  # id lists as tensors

    def ids(self, name: str) -> torch.Tensor:
        """``seen_ids`` or ``output_ids`` as a tensor, rebuilt only when the list grew."""
        values = getattr(self, name)
        cached = self._tensors.get(name)
        if cached is None or cached[0] != len(values):
            cached = self._tensors[name] = (len(values), torch.tensor(values, dtype=torch.int64))
        return cached[1]

    def fold(self, history: list[int]) -> None:
        end = self.folded
        while end < len(history) and history[end] != UNKNOWN:
            end += 1
        for position in range(self.folded, end):
            token = history[position]
            if not 0 <= token < self.vocab:
                continue
            if token not in self._seen:
                self._seen.add(token)
                self.seen_ids.append(token)
            if position >= self.prompt_tokens:
                if token not in self._generated:
                    self._generated.add(token)
                    self.output_ids.append(token)
                self.output[token] += 1
        self.folded = end


class PromptScores:
    """The prompt's own log-probabilities (``echo`` with ``logprobs``), gathered chunk by
    chunk as the prompt's prefill passes the tail: entry ``i`` scores prompt token ``i + 1``
    under the distribution after tokens ``0..i``. A chunk's last row waits for the next
    chunk, which brings the token it scores."""

    def __init__(self, params: SamplingSpec) -> None:
        self.top = params.prompt_logprobs or 0
        self.prompt_tokens = params.prompt_tokens
        self.entries: list[tuple[float, list[tuple[int, float]]]] = []
        self.delivered = False
        self._pending: tuple[int, torch.Tensor] | None = None  # (position, log-softmax row)

    def rows(self, position: int, num_tokens: int) -> range:
        """The positions of a step at ``position`` whose distributions score the prompt."""
        return range(position, min(position + num_tokens, self.prompt_tokens - 1))

    def add(self, position: int, logprobs: torch.Tensor, history: list[int]) -> None:
        """``logprobs``: (T, V) log-softmax rows for positions ``position..position+T-1``."""
        if position != len(self.entries) + (self._pending is not None):
            return  # a replayed or repeated chunk: this session scored it already
        self.settle(history)
        count = logprobs.shape[0]
        targets = history[position + 1 : position + 1 + count]
        known = 0
        while known < len(targets) and targets[known] >= 0:
            known += 1
        if known < count - 1:
            raise ValueError(f"prompt ids missing for the rows to score at {position}")
        if known:
            self._score(logprobs[:known], targets[:known])
        if known < count:  # the next chunk brings the token this row scores
            self._pending = (position + count - 1, logprobs[count - 1].clone())

    def settle(self, history: list[int]) -> None:
        """Score the row that waited for the next chunk, once that chunk's ids are here."""
        if self._pending is None:
            return
        position, row = self._pending
        if position + 1 < len(history) and history[position + 1] >= 0:
            self._pending = None
            self._score(row.unsqueeze(0), history[position + 1 : position + 2])

    def _score(self, rows: torch.Tensor, targets: list[int]) -> None:
        index = torch.tensor(targets, dtype=torch.int64).unsqueeze(1)
        chosen = rows.gather(1, index).reshape(-1).tolist()
        if self.top:
            values, ids = torch.topk(rows, self.top, dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(),
                                                                 strict=True)]  # fmt: skip
        else:
            tops = [[] for _ in targets]
        self.entries.extend(zip(chosen, tops, strict=True))


class Sampler:
    """Samples from last-position logits; one per session so a seed reproduces a sequence.

    ``history`` holds the session's token ids by position (prompt, then generated), filled
    by ``observe`` from each step's ids: the penalties count them, so a failover replay
    (a fresh session fed the whole history again) samples exactly as before. The counts are
    folded in as tokens arrive, and the penalties touch only the ids seen: a token costs
    the same at the end of a long generation as at its start."""

    def __init__(self, params: SamplingSpec, constraint=None) -> None:
        self.params = params
        self.constraint = constraint  # structured output (engine.constraints.Constraint)
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed % 2**64)  # torch takes unsigned 64-bit
        else:
            self.generator.seed()
        self.history: list[int] = []
        self.prompt = PromptScores(params) if params.prompt_logprobs is not None else None
        self._counts: _Counts | None = None
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self._bias = torch.tensor(ids, dtype=torch.int64), torch.tensor(values)

    @property
    def wants_history(self) -> bool:
        return self.params.needs_history

    def observe(self, position: int, ids) -> None:
        end = position + len(ids)
        if len(self.history) < end:
            self.history.extend([UNKNOWN] * (end - len(self.history)))
        counts = self._counts
        if counts is not None and position < counts.folded:  # rewritten: count again
            self._counts = None
        self.history[position:end] = [int(i) for i in ids]

    def __call__(self, logits: torch.Tensor) -> SampledToken:
        """``logits``: (V,) float32 scores of the next token."""
        return self._sample(logits, None)

    def verify(self, rows: torch.Tensor, drafts) -> list[SampledToken]:
        """Speculative decoding: ``rows`` (k + 1, V) are the scores after a step's input
        token and after each of its ``k`` drafts. Row ``i`` decides position ``i``: a draft
        is kept while it is what the row yields, and the first row that yields another
        token ends the list with that token (all kept: row ``k`` adds one more).

        Greedy, a draft is kept when it is the row's best token. Sampled, the standard
        speculative-sampling rule for a draft proposed with certainty: kept with the
        probability the row gives it, else a token drawn from the row without it. Either
        way each token has exactly the distribution one-at-a-time decoding gives it."""
        out = []
        for i in range(len(rows)):  # rows may be computed as they are read
            draft = int(drafts[i]) if i < len(drafts) else None
            token = self._sample(rows[i], draft)
            out.append(token)
            if token.token_id != draft:
                break
        return out

    def _sample(self, logits: torch.Tensor, draft: int | None) -> SampledToken:
        logits = logits.float().reshape(-1)  # (V,)
        logprobs = torch.log_softmax(logits, dim=-1)  # (V,) reported: the model's own
        params = self.params
        scores = self._processed(logits)
        if self.constraint is not None:
            self.constraint.advance(self.history[params.prompt_tokens :])
            scores = self.constraint.mask(scores)
        if params.temperature < GREEDY_BELOW:  # tiny temperatures overflow float32 scores
            # max's index: argmax's (the first of equal maxima), ~30 us against ~80 here
            token = int(scores.max(dim=0).indices)
        else:
            scores = scores / params.temperature
            if params.min_p > 0.0:
                probs = torch.softmax(scores, dim=-1)
                scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
            if params.top_k and params.top_k < scores.numel():
                kth = torch.topk(scores, params.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            if params.top_p < 1.0:
                sorted_scores, order = torch.sort(scores, descending=True)
                cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
                # Drop tokens once the mass *before* them already reaches top_p (keeps >= 1).
                drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
                drop[0] = False  # the most likely token always stays
                scores = scores.scatter(0, order[drop], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if draft is not None and 0 <= draft < probs.numel():
                keep = float(torch.rand((), generator=self.generator)) < float(probs[draft])
                if keep or float(probs[draft]) >= 1.0:
                    token = draft
                else:  # the residual max(0, p - q) of a certain draft: p without it
                    token = int(
                        torch.multinomial(
                            probs.index_fill(0, torch.tensor([draft]), 0.0),
                            1,
                            generator=self.generator,
                        )
                    )
            else:
                token = int(torch.multinomial(probs, 1, generator=self.generator))
        top: list[tuple[int, float]] = []
        if params.logprobs:
            values, ids = torch.topk(logprobs, params.logprobs)
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
        prompt = self.prompt
        scored = None
        if prompt is not None and not prompt.delivered:
            prompt.settle(self.history)
            scored, prompt.delivered = prompt.entries, True
        return SampledToken(token, float(logprobs[token]), top, scored)

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits after the logit bias and the penalties (a copy when anything applies)."""
        params = self.params
        if self._bias is not None:
            ids, values = self._bias
            keep = ids < logits.numel()
            logits = logits.index_add(0, ids[keep], values[keep])
        if not params.penalized:
            return logits
        counts = self._counts
        if counts is None or counts.vocab != logits.numel():
            counts = self._counts = _Counts(logits.numel(), params.prompt_tokens)
        counts.fold(self.history)
        logits = logits.clone()
        if params.repetition_penalty != 1.0 and counts.seen_ids:
            seen = counts.ids("seen_ids")  # prompt and output tokens, as vLLM
            picked = logits[seen]
            rp = params.repetition_penalty
            logits[seen] = torch.where(picked > 0, picked / rp, picked * rp)
        if counts.output_ids and (params.frequency_penalty or params.presence_penalty):
            out = counts.ids("output_ids")
            logits[out] -= params.frequency_penalty * counts.output[out] + params.presence_penalty
        return logits


class DeferredRows:
    """The logits of a verification pass's rows, computed as verification reads them: the
    first row (the step's own token) alone, then, once its draft is kept, all the others
    in one call. Verification stops at the first draft it rejects, and where a product
    costs the same per row whatever the number of rows (bfloat16 on CPUs without bf16
    instructions: ~10 ms a row for SmolLM2's lm_head), the rows after it are never paid
    for. Each row is the one a one-token step gives: a linear gives each row the same
    bits whatever the number of rows (ADR-0019)."""

    def __init__(self, logits_of, states: torch.Tensor) -> None:
        self._logits_of = logits_of  # (n, 1, H) -> (n, 1, V)
        self._states = states  # (rows, 1, H), after the final norm
        self._rows: list[torch.Tensor] = []

    def __len__(self) -> int:
        return self._states.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:  # (V,)
        if not 0 <= i < len(self):
            raise IndexError(i)
        while len(self._rows) <= i:
            done = len(self._rows)
            got = self._logits_of(self._states[done : done + 1 if done == 0 else len(self)])
            self._rows.extend(got[j].reshape(-1) for j in range(got.shape[0]))
        return self._rows[i]

    def computed(self) -> torch.Tensor:
        """The rows read so far, (n, V)."""
        return torch.stack(self._rows)

"""Token sampling on the tail: greedy, temperature, top-k, top-p, seeded per session."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshnet_common.protocol import SamplingSpec

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM does)


@dataclass
class SampledToken:
    """The chosen token, its log-probability and the top alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


class Sampler:
    """Samples from last-position logits; one per session so a seed reproduces a sequence."""

    def __init__(self, params: SamplingSpec) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed % 2**64)  # torch takes unsigned 64-bit
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> SampledToken:
        """``logits``: (V,) float32 scores of the next token."""
        logits = logits.float().reshape(-1)  # (V,)
        logprobs = torch.log_softmax(logits, dim=-1)  # (V,)
        params = self.params
        if params.temperature < GREEDY_BELOW:  # tiny temperatures overflow float32 scores
            token = int(torch.argmax(logits))
        else:
            scores = logits / params.temperature
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
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        top: list[tuple[int, float]] = []
        if params.logprobs:
            values, ids = torch.topk(logprobs, params.logprobs)
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
        return SampledToken(token, float(logprobs[token]), top)

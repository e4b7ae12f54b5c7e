"""Pieces of the OpenAI response shapes shared by both endpoints: usage (in streams too)
and meshnet's timing extension."""

from __future__ import annotations

from meshnet_common.openai_protocol import usage


class StreamUsage:
    """The ``usage`` field of stream chunks: with ``include_usage``, null on every chunk and
    the totals on a last chunk of its own; with ``continuous_usage_stats`` (vLLM), the running
    totals on every chunk; without stream options, absent."""

    def __init__(self, request, jobs, counts: list[int]) -> None:
        options = request.stream_options
        self.final = bool(options and options.include_usage)
        self.continuous = bool(options and options.continuous_usage_stats)
        self.prompt = sum(len(p) for p in {tuple(j.prompt_ids) for j in jobs})
        self.counts = counts

    def __call__(self, last: bool) -> dict:
        if last or self.continuous:
            return {"usage": usage(self.prompt, sum(self.counts))}
        return {"usage": None} if self.final else {}


def timing_field(choices: list) -> dict:
    """meshnet's extension field: where the first choice's decode time went (see README)."""
    timing = choices[0].timing if choices else None
    return {"meshnet_timing": timing} if timing else {}


def choices_usage(choices: list) -> dict:
    # Like OpenAI, a prompt sampled n times counts once.
    prompt = sum(len(ids) for ids in {c.prompt_ids for c in choices})
    return usage(prompt, sum(len(c.tokens) for c in choices))

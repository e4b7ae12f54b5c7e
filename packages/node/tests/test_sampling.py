"""Tail sampling: greedy, seeded reproducibility, top-k/top-p, parameter validation, and the
penalties, logit bias and min-p checked against their formulas written out."""

from __future__ import annotations

import pytest
import torch

from meshnet_common.errors import InvalidRequest
from meshnet_common.protocol import SamplingSpec
from meshnet_node.engine.sampling import Sampler

LOGITS = torch.tensor([0.1, 2.0, 1.9, -1.0, 0.5])


def test_greedy_picks_argmax_and_reports_logprobs():
    token = Sampler(SamplingSpec(logprobs=2))(LOGITS)
    assert token.token_id == 1
    assert token.logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[1]))
    assert [t for t, _ in token.top_logprobs] == [1, 2]


def test_seed_reproduces_a_sequence():
    params = SamplingSpec(temperature=1.0, seed=42)
    a, b = Sampler(params), Sampler(params)
    assert [a(LOGITS).token_id for _ in range(20)] == [b(LOGITS).token_id for _ in range(20)]


def test_top_k_one_is_greedy_and_top_p_keeps_the_head():
    assert {
        Sampler(SamplingSpec(temperature=1.0, top_k=1))(LOGITS).token_id for _ in range(20)
    } == {1}
    picks = {
        Sampler(SamplingSpec(temperature=1.0, top_p=0.5, seed=s))(LOGITS).token_id
        for s in range(50)
    }
    assert picks <= {1, 2}


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
     ("top_k", -1), ("logprobs", 50)],
)  # fmt: skip
def test_invalid_parameters_are_refused(field, value):
    with pytest.raises(InvalidRequest) as info:
        SamplingSpec(**{field: value})
    assert info.value.param == field


# -- penalties, logit bias, min-p over the history the steps bring (vLLM's definitions) --

V = 64


def brute(logits, history, prompt, *, rep=1.0, presence=0.0, frequency=0.0):
    out = logits.clone()
    for token in set(history):
        if rep != 1.0:
            out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token in set(history[prompt:]):
        count = history[prompt:].count(token)
        out[token] -= frequency * count + presence
    return out


@pytest.mark.parametrize(("rep", "presence", "frequency"),
                         [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 0.4), (0.8, 1.5, -0.5)])  # fmt: skip
def test_penalties_follow_the_formulas_as_the_history_grows(rep, presence, frequency):
    gen = torch.Generator().manual_seed(1)
    spec = SamplingSpec(repetition_penalty=rep, presence_penalty=presence,
                        frequency_penalty=frequency, prompt_tokens=10)  # fmt: skip
    sampler = Sampler(spec)
    history = torch.randint(0, V, (10,), generator=gen).tolist()
    sampler.observe(0, history)
    for _ in range(15):
        logits = torch.randn(V, generator=gen)
        want = int(torch.argmax(brute(logits, history, 10, rep=rep, presence=presence,
                                      frequency=frequency)))  # fmt: skip
        token = sampler(logits).token_id
        assert token == want
        sampler.observe(len(history), [token])  # the next step brings it as its input
        history.append(token)


def test_steps_may_arrive_out_of_order_and_be_rewritten():
    spec = SamplingSpec(presence_penalty=2.0, prompt_tokens=0)
    sampler = Sampler(spec)
    sampler.observe(3, [5, 6])  # a later chunk first
    sampler.observe(0, [1, 2, 3])
    logits = torch.zeros(V)
    logits[[1, 2, 3, 5, 6, 9]] = 1.0
    assert sampler(logits).token_id == 9  # every observed id is penalised
    sampler.observe(0, [9, 2, 3])  # a position written again: counted again from scratch
    assert sampler(logits).token_id == 1


def test_logit_bias_min_p_top_k_and_seeds():
    logits = torch.linspace(0, 5, V)
    biased = Sampler(SamplingSpec(logit_bias=((3, 100.0), (V + 5, 100.0))))
    assert biased(logits).token_id == 3  # ids past the vocabulary are ignored
    assert biased(logits).logprob == pytest.approx(float(torch.log_softmax(logits, -1)[3]))
    only_best = Sampler(SamplingSpec(temperature=1.0, min_p=1.0, seed=3))
    assert {only_best(logits).token_id for _ in range(20)} == {V - 1}
    top2 = Sampler(SamplingSpec(temperature=2.0, top_k=2, seed=3))
    assert {top2(logits).token_id for _ in range(40)} <= {V - 1, V - 2}
    a = Sampler(SamplingSpec(temperature=1.0, seed=7))
    b = Sampler(SamplingSpec(temperature=1.0, seed=7))
    c = Sampler(SamplingSpec(temperature=1.0, seed=8))
    flat = torch.zeros(V)
    draws = [[s(flat).token_id for _ in range(12)] for s in (a, b, c)]
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_no_history_is_kept_without_penalties():
    sampler = Sampler(SamplingSpec())
    assert not sampler.wants_history


def test_prompt_scores_follow_chunks_in_any_arrival_order():
    """Entry i scores prompt token i + 1; a chunk's last row waits for the next chunk's ids,
    which may have arrived before or after it; a replayed chunk is not scored twice."""
    from meshnet_node.engine.sampling import UNKNOWN

    torch.manual_seed(0)
    prompt = [3, 1, 4, 1, 0, 2, 3]
    rows = torch.log_softmax(torch.randn(len(prompt), 5), -1)
    want = [float(rows[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    for order in ([0, 1, 2], [0, 2, 1]):
        sampler = Sampler(SamplingSpec(prompt_logprobs=2, prompt_tokens=len(prompt)))
        scores = sampler.prompt
        chunks = [(0, 3), (3, 6), (6, 7)]
        sampler.observe(0, prompt[0:3])
        if order == [0, 2, 1]:
            sampler.observe(6, prompt[6:7])  # the last chunk's ids came first
            assert sampler.history[3:6] == [UNKNOWN] * 3
        for lo, hi in chunks:
            sampler.observe(lo, prompt[lo:hi])
            span = scores.rows(lo, hi - lo)
            if span:
                scores.add(span.start, rows[span.start : span.stop], sampler.history)
        scores.add(0, rows[0:3], sampler.history)  # a repeat changes nothing
        got = sampler(rows[-1]).prompt_logprobs
        assert [lp for lp, _ in got] == pytest.approx(want)
        assert [ids for ids, _ in got[0][1]] == torch.topk(rows[0], 2).indices.tolist()
        assert sampler(rows[-1]).prompt_logprobs is None  # delivered once

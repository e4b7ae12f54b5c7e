"""Tail sampling: greedy, seeded reproducibility, top-k/top-p, parameter validation."""

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

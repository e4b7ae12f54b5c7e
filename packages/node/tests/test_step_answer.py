"""The tail's hand-formatted step answer is the JSON of the StepResult it stands for."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_common.protocol import StepResult, format_compute, parse_compute
from meshnet_node.dataplane.steps import LOGPROB_FLOOR, _token_json, wire_logprob
from meshnet_node.engine.sampling import SampledToken

logprobs = st.floats(max_value=0.0) | st.sampled_from([math.nan, -math.inf])


@given(
    token_id=st.integers(0, 1 << 20),
    logprob=logprobs,
    tops=st.lists(st.tuples(st.integers(0, 1 << 20), logprobs), max_size=5),
    prompt=st.none() | st.lists(st.tuples(logprobs, st.lists(
        st.tuples(st.integers(0, 1 << 20), logprobs), max_size=3)), max_size=4),
)  # fmt: skip
def test_token_json_equals_the_models_serialization(token_id, logprob, tops, prompt):
    body = _token_json(SampledToken(token_id, logprob, tops, prompt))
    parsed = StepResult.model_validate_json(body)  # what the head does with it
    # -inf and NaN travel as a finite floor (JSON has neither); the rest bit for bit.
    expected = StepResult(
        token_id=token_id,
        logprob=wire_logprob(logprob),
        top_logprobs=[(i, wire_logprob(lp)) for i, lp in tops],
        prompt_logprobs=None if prompt is None else [
            (wire_logprob(lp), [(i, wire_logprob(v)) for i, v in top]) for lp, top in prompt
        ],
    )  # fmt: skip
    assert parsed == expected and parsed.compute_ms == []
    dumped = expected.model_dump_json(exclude={"compute_ms"}, exclude_none=True)
    assert json.loads(body) == json.loads(dumped)  # (prompt scores: only when there are)
    if not math.isfinite(logprob):
        assert parsed.logprob == LOGPROB_FLOOR


def test_compute_header_round_trip_and_bounds():
    header = format_compute(1.5, format_compute(2.25, format_compute(3.0)))
    assert header == "1.500,2.250,3.000"
    assert parse_compute(header) == [1.5, 2.25, 3.0]
    assert parse_compute(None) == [] and parse_compute("") == []
    assert parse_compute("1,x") == [] and parse_compute("nan,1") == [1.0]
    assert parse_compute("-1,2") == [2.0]
    long = ",".join(["1.0"] * 200)
    assert len(parse_compute(long)) == 64
    assert format_compute(9.0, ",".join(["1"] * 63)).count(",") == 63  # 64 entries: fits
    assert format_compute(9.0, ",".join(["1"] * 64)) == "9.000"  # full: own time only


@pytest.mark.parametrize("tops", [[], [(5, -0.5), (7, -1.25)]])
def test_token_json_is_compact_json(tops):
    body = _token_json(SampledToken(3, -0.25, tops))
    assert json.loads(body) == {
        "token_id": 3,
        "logprob": -0.25,
        "top_logprobs": [list(t) for t in tops],
    }


def test_a_step_with_drafts_always_says_what_it_kept():
    first, kept = SampledToken(3, -0.25), SampledToken(4, -0.5, [(4, -0.5)])
    parsed = StepResult.model_validate_json(_token_json(first, [kept]))
    assert parsed.more == [(4, -0.5, [(4, -0.5)])]
    none_kept = StepResult.model_validate_json(_token_json(first, []))
    assert none_kept.more == []  # not None: the tail verified, and kept no draft
    assert StepResult.model_validate_json(_token_json(first)).more is None

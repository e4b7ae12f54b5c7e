"""The tail's step answer bytes (``answer_bytes``) are the StepResult they stand for; a
broken answer is refused; a client that is not a node gets the JSON."""

from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_common.protocol import StepResult, format_compute, parse_compute
from meshnet_node.dataplane import answer_bytes
from meshnet_node.dataplane.steps import LOGPROB_FLOOR, wire_logprob
from meshnet_node.engine.sampling import SampledToken

logprobs = st.floats(max_value=0.0) | st.sampled_from([math.nan, -math.inf])


@given(
    token_id=st.integers(0, 1 << 20),
    logprob=logprobs,
    tops=st.lists(st.tuples(st.integers(0, 1 << 20), logprobs), max_size=5),
    prompt=st.none() | st.lists(st.tuples(logprobs, st.lists(
        st.tuples(st.integers(0, 1 << 20), logprobs), max_size=3)), max_size=4),
)  # fmt: skip
def test_answer_bytes_give_the_step_result(token_id, logprob, tops, prompt):
    body = answer_bytes.encode(SampledToken(token_id, logprob, tops, prompt))
    parsed = answer_bytes.decode(body)  # what the head does with it
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
    assert StepResult.model_validate(parsed.model_dump()) == parsed  # valid as the model
    dumped = expected.model_dump_json(exclude={"compute_ms"}, exclude_none=True)
    assert json.loads(answer_bytes.to_json(body)) == json.loads(dumped)  # a client's form
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
def test_an_answer_is_a_few_bytes(tops):
    body = answer_bytes.encode(SampledToken(3, -0.25, tops))
    assert len(body) == 5 + 12 + 2 + 12 * len(tops)
    assert json.loads(answer_bytes.to_json(body)) == {
        "token_id": 3, "logprob": -0.25, "top_logprobs": [list(t) for t in tops],
    }  # fmt: skip


@pytest.mark.parametrize("logprob", [-0.25, -math.inf, math.nan])
def test_a_token_alone_is_the_same_bytes_as_the_general_layout(logprob):
    """A token with no alternatives, no prompt and nothing after it is written in one call
    (every tail writes one after each pass): the very bytes of head, entry, no
    alternatives."""
    general = b"".join((b"MSA1", bytes([1]), (7).to_bytes(4, "big"),
                        struct.pack("!d", wire_logprob(logprob)), b"\x00\x00"))  # fmt: skip
    assert answer_bytes.encode(SampledToken(7, logprob)) == general
    assert answer_bytes.token_of(general) == 7


def test_a_step_with_drafts_always_says_what_it_kept():
    first, kept = SampledToken(3, -0.25), SampledToken(4, -0.5, [(4, -0.5)])
    parsed = answer_bytes.decode(answer_bytes.encode(first, [kept]))
    assert parsed.more == [(4, -0.5, [(4, -0.5)])]
    assert answer_bytes.kept(answer_bytes.encode(first, [kept, kept])) == 2
    none_kept = answer_bytes.decode(answer_bytes.encode(first, []))
    assert none_kept.more == []  # not None: the tail verified, and kept no draft
    assert answer_bytes.decode(answer_bytes.encode(first)).more is None


def test_empty_and_stale_answers():
    assert answer_bytes.decode(answer_bytes.EMPTY) == StepResult()
    assert answer_bytes.decode(answer_bytes.STALE) == StepResult(stale=True)
    assert json.loads(answer_bytes.to_json(answer_bytes.EMPTY))["token_id"] is None


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"MSA1",
        b"MSA2\x01",
        b"MSA1\x10",
        b"MSA1\x01\x00\x00",
        b"{}",
        answer_bytes.encode(SampledToken(3, -0.25, [(5, -0.5)])) + b"x",
        answer_bytes.encode(SampledToken(3, -0.25, [(5, -0.5)]))[:-1],
    ],  # fmt: skip
)
def test_a_broken_answer_is_refused(body):
    with pytest.raises(ValueError):
        answer_bytes.decode(body)

"""The step message's codecs: ``Step.to_headers`` / ``Step.from_headers`` (HTTP clients) and
``step_bytes`` (what nodes send) are inverse and agree, and a relay's ``dataclasses.replace``
keeps every field it does not change (docs/adr/0011, 0040)."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from meshnet_common import wire
from meshnet_common.errors import InvalidRequest
from meshnet_common.logs import request_id_var
from meshnet_common.protocol import H_OPEN, SamplingSpec
from meshnet_node.dataplane import step_bytes
from meshnet_node.dataplane.frames import Kind, decode_request, encode_request
from meshnet_node.dataplane.steps import OpenSpec, Step

urls = st.sampled_from(["http://a.test:1", "http://b.test:2", "https://c.test"])
openings = st.none() | st.builds(
    OpenSpec,
    temperature=st.sampled_from([0.0, 0.7]),
    seed=st.none() | st.integers(0, 1 << 40),
    logprobs=st.integers(0, 5),
    start_layer=st.none() | st.integers(0, 64),
    audit=st.booleans(),
)


@st.composite
def steps(draw) -> Step:
    opening = draw(openings)
    ids = draw(st.none() | st.lists(st.integers(0, 1 << 20), min_size=1, max_size=4))
    ids = None if ids is None else tuple(ids)
    guess = opening is None and ids is not None and len(ids) == 1 and draw(st.booleans())
    position = draw(st.integers(0, 1 << 20))
    answer_to = draw(st.none() | urls)
    return Step(
        session_id=draw(st.from_regex(r"[A-Za-z0-9_-]{1,16}", fullmatch=True)),
        session_key=draw(st.from_regex(r"[0-9a-f]{1,32}", fullmatch=True)),
        position=position,
        chunk=0 if guess else draw(st.integers(0, 9)),
        route=tuple(draw(st.lists(urls, max_size=3))),
        open_spec=opening,
        sample=True if guess else draw(st.booleans()),
        ids=ids,
        answer_to=answer_to,
        compute_before=None if answer_to is None else draw(st.none() | st.just("1.250,0.500")),
        replay_pass=draw(st.integers(0, 5)),
        guess_from=draw(st.integers(0, position)) if guess else None,
    )


@given(steps())
def test_a_step_survives_its_headers(step):
    assert Step.from_headers(step.to_headers()) == step


def test_the_open_header_is_the_sampling_beside_start_layer_and_audit():
    sampling = SamplingSpec(temperature=0.5, logit_bias=((3, 1.5),))
    opening = OpenSpec.of(sampling, start_layer=4, audit=False)
    raw = json.loads(Step("s", "k", 0, open_spec=opening).to_headers()[H_OPEN])
    assert raw == {**json.loads(sampling.model_dump_json()), "start_layer": 4}  # no audit
    assert opening.sampling == sampling
    assert opening.entering(6) == OpenSpec.of(sampling, start_layer=6)
    audited = OpenSpec.of(sampling, start_layer=4, audit=True)
    assert json.loads(audited.to_header())["audit"] is True


def test_a_relay_changes_only_what_it_names():
    step = Step("s", "k", 7, route=("http://a.test", "http://b.test"), sample=True, ids=(1,),
                answer_to="http://h.test", replay_pass=2)  # fmt: skip
    onward = replace(step, route=step.route[1:], compute_before="1.000")
    changed = {f.name for f in fields(Step) if getattr(step, f.name) != getattr(onward, f.name)}
    assert changed == {"route", "compute_before"}


@pytest.mark.parametrize(
    "raw_open",
    ['{"start_layer": "4"}', '{"audit": 1}', '{"temperature": 0.0, "bogus": 1}', "[1]"],
)
def test_an_open_header_is_strict(raw_open):
    headers = Step("s", "k", 0).to_headers() | {H_OPEN: raw_open}
    with pytest.raises(InvalidRequest):
        Step.from_headers(headers)


# -- the step as bytes: what nodes send each other (docs/adr/0040) ---------------------------


@given(steps(), st.none() | st.from_regex(r"[A-Za-z0-9_-]{1,40}", fullmatch=True))
def test_a_step_survives_its_bytes_and_both_forms_agree(step, request_id):
    body = step_bytes.encode(step, request_id) + b"FRAME"
    decoded, rid, start = step_bytes.decode(body)
    assert decoded == step == Step.from_headers(step.to_headers())
    assert rid == request_id and body[start:] == b"FRAME"


def test_a_node_step_is_its_bytes_then_its_frame_and_no_header():
    step = Step("s-1", "k", 9, route=("http://a.test:1",), sample=True, ids=(42,))
    hidden = torch.randn(1, 1, 8).bfloat16()
    body = step_bytes.encode(step, "req-1") + wire.encode_tensor(hidden)
    got, frame = step_bytes.parse_step({}, body, max_bytes=1 << 20)
    # read without a torch call: its tensor is made where the step computes
    assert got == step and (frame.dtype, frame.shape) == (torch.bfloat16, (1, 1, 8))
    assert torch.equal(frame.tensor(), hidden)
    assert request_id_var.get() == "req-1"
    # a bare frame still takes its step from the HTTP headers (clients that are not nodes)
    got, _ = step_bytes.parse_step(step.to_headers(), wire.encode_tensor(hidden), max_bytes=1 << 20)
    assert got == step
    message = encode_request(Kind.STEP, 3, {}, body)  # on a hop stream: no JSON header at all
    assert decode_request(message) == (Kind.STEP, 3, {}, body)
    assert len(message) == 9 + len(body)


def _broken(cut) -> bytes:
    good = step_bytes.encode(Step("s", "k", 5, route=("http://a.test",), sample=True, ids=(7,)))
    return cut(good)


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        (lambda b: b[:10], "does not start with a step"),
        (lambda b: b"XXXX" + b[4:], "does not start with a step"),
        (lambda b: b[:-3], "runs past the end"),
        (lambda b: b.replace(b"http://a.test", b"ftp://aa.test"), "bad hop URL"),
        (lambda b: b.replace(b"http://a.test", b"http://\xff.test"), "ASCII"),
    ],
    ids=["short", "magic", "truncated", "route", "ascii"],
)
def test_bytes_that_are_not_a_step_are_refused_with_a_400(cut, message):
    with pytest.raises(InvalidRequest, match=message):
        step_bytes.decode(_broken(cut))


def test_the_bytes_obey_the_rules_between_fields():
    guess = Step("s", "k", 5, sample=True, ids=(7,), guess_from=5)
    body = bytearray(step_bytes.encode(guess))
    body[4] &= ~1  # a guess that is not sampled
    with pytest.raises(InvalidRequest, match="guess"):
        step_bytes.decode(bytes(body))


def test_a_field_past_its_width_is_a_400_not_a_crash():
    with pytest.raises(InvalidRequest, match="width"):
        step_bytes.encode(Step("s", "k" * 300, 0))  # a client's session key, relayed
    with pytest.raises(InvalidRequest, match="width"):
        step_bytes.encode(Step("s", "k", 0, ids=(1 << 33,), sample=True))

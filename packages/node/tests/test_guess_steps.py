"""Guess steps (ADR-0019): decode steps sent before the token they carry is known. Every
row a stage computes for one is the row of a one-token step, bit for bit, including after
the hops rewind past wrong guesses; the tail knows which guesses are stale; the step
header is validated."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoConfig

from meshnet_common.errors import InvalidRequest
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import H_GUESS, H_IDS, H_POSITION, H_SAMPLE, H_SESSION
from meshnet_common.tiny import snapshots as tiny
from meshnet_common.wire import encode_tensor
from meshnet_node.dataplane import answer_bytes
from meshnet_node.dataplane.answer_bytes import STALE as STALE_RESULT
from meshnet_node.dataplane.service import NodeService
from meshnet_node.dataplane.step_bytes import parse_step
from meshnet_node.dataplane.steps import Step, stale_guess
from meshnet_node.engine.faults import SlowCompute
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.scheduling.micro_batches import micro_batches
from meshnet_node.settings import NodeSettings
from meshnet_node.speculation.guessing import (
    DEFAULT_DEPTH,
    UNMEASURED_DEPTH,
    GuessFlight,
    guess_depth,
)


def _stages(snapshot) -> list[Stage]:
    n = AutoConfig.from_pretrained(snapshot).num_hidden_layers
    bounds = [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)]
    return [Stage(load_shard(snapshot, LayerRange(*b), Precision.BFLOAT16)) for b in bounds]


def _step(stages, sid, position, tokens, guess_from=None):
    """One step through the chain: each stage's rows, and the tail's output."""
    out = stages[0].step(sid, position, token_ids=torch.tensor([tokens]), guess_from=guess_from)
    rows = [out.hidden]
    for stage in stages[1:]:
        out = stage.step(sid, position, hidden=out.hidden, guess_from=guess_from)
        rows.append(out.hidden if out.hidden is not None else out.logits.reshape(1, -1))
    return rows, out


def _equal(got, want) -> bool:
    return all(torch.equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("family", list(tiny.FAMILIES))
def test_guess_steps_and_their_rewinds_give_the_rows_of_one_token_steps(tiny_snapshot, family):
    """bfloat16, prompt past every sliding window: a right guess computes the one-token
    step's rows; wrong guesses are rewound by the next step that knows the token, and
    every row after that is the one-token step's again, on every stage."""
    stages = _stages(tiny_snapshot(family))
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 200, (150,), generator=gen).tolist()
    for sid in ("plain", "guess"):
        for stage in stages:
            stage.open_session(sid)
        for lo in range(0, len(prompt), 128):
            _, out = _step(stages, sid, lo, prompt[lo : lo + 128])
    start = len(prompt)
    truth, plain = [out.token.token_id], {}
    for position in range(start, start + 7):  # one-token steps: the reference
        plain[position], out = _step(stages, "plain", position, [truth[-1]])
        truth.append(out.token.token_id)
    tail = stages[-1].sessions.get("guess")
    assert tail.expect == (start, truth[0])  # the prompt's step sampled truth[0] there

    def wrong(token: int) -> int:
        return 3 + (token + 1) % 190

    rows, out = _step(stages, "guess", start, [truth[0]])  # known
    assert _equal(rows, plain[start])
    assert tail.expect == (start + 1, truth[1])
    rows, _ = _step(stages, "guess", start + 1, [truth[1]], guess_from=start + 1)  # right
    assert _equal(rows, plain[start + 1])
    _step(stages, "guess", start + 2, [wrong(truth[2])], guess_from=start + 2)  # wrong
    _step(stages, "guess", start + 3, [wrong(truth[3])], guess_from=start + 2)  # after it
    rows, _ = _step(stages, "guess", start + 2, [truth[2]])  # the token: back to start + 2
    assert _equal(rows, plain[start + 2])
    _step(stages, "guess", start + 3, [wrong(truth[3])], guess_from=start + 3)
    rows, _ = _step(stages, "guess", start + 3, [truth[3]])
    assert _equal(rows, plain[start + 3])
    for position in range(start + 4, start + 7):
        rows, out = _step(stages, "guess", position, [truth[position - start]])
        assert _equal(rows, plain[position]), (family, position)
    assert out.token.token_id == truth[-1]


def _request(position: int, ids: list[int], guess_from: int | None) -> Step:
    headers = {H_SESSION: "s1", H_POSITION: str(position), H_SAMPLE: "1",
               H_IDS: ",".join(map(str, ids))}  # fmt: skip
    if guess_from is not None:
        headers[H_GUESS] = str(guess_from)
    body = encode_tensor(torch.zeros(1, len(ids), 8, dtype=torch.bfloat16))
    return parse_step(headers, body, max_bytes=1 << 20)[0]


def test_a_guess_step_is_one_sampled_token_that_goes_back_no_further_than_allowed():
    assert _request(10, [5], 8).guess_from == 8
    assert _request(10, [5], None).guess_from is None
    for position, ids, guess_from in ((10, [5], 11), (10, [5, 6], 10), (10, [5], -1)):
        with pytest.raises(InvalidRequest):
            _request(position, ids, guess_from)


def test_the_tail_answers_stale_a_guess_it_did_not_sample(tiny_snapshot):
    snapshot = tiny_snapshot("llama")
    layers = LayerRange(0, AutoConfig.from_pretrained(snapshot).num_hidden_layers)
    stage = Stage(load_shard(snapshot, layers, Precision.FLOAT32))  # head and tail
    stage.open_session("s1")
    out = stage.step("s1", 0, token_ids=torch.tensor([[5, 6, 7]]))
    sampled = out.token.token_id
    assert not stale_guess(stage, _request(3, [sampled], 3))
    assert stale_guess(stage, _request(3, [sampled + 1], 3))  # a wrong guess
    assert stale_guess(stage, _request(4, [sampled], 3))  # one after a guess not yet sampled


def test_a_tail_judges_a_guess_after_the_steps_before_it_computed(tiny_snapshot):
    """A guess step reaches the tail right behind the step it guesses the answer of, while
    that step still waits for (or runs on) the compute thread: the guess is judged against
    what that step samples, not against what the tail knew when the guess arrived."""
    snapshot = tiny_snapshot("llama")
    layers = LayerRange(3, AutoConfig.from_pretrained(snapshot).num_hidden_layers)
    width = AutoConfig.from_pretrained(snapshot).hidden_size
    rows = torch.randn(1, 5, width, generator=torch.Generator().manual_seed(0))

    def opened() -> Stage:
        stage = Stage(load_shard(snapshot, layers, Precision.FLOAT32))
        stage.open_session("s1", sampling=None, start_layer=3)
        first = stage.step("s1", 0, hidden=rows[:, :3])
        return stage, first.token.token_id

    twin, sampled = opened()  # what the tail samples at 3 and 4, computed apart
    at4 = twin.step("s1", 3, hidden=rows[:, 3:4]).token.token_id
    stage, _ = opened()
    settings = NodeSettings(model_id="meshnet-tiny/llama", model_path=snapshot, layers=layers)

    async def run() -> list[bytes]:
        service = NodeService(stage, settings, model_id=settings.model_id,
                              before_pass=SlowCompute(0.05))  # fmt: skip
        steps = [
            (Step("s1", None, 3, sample=True, ids=(sampled,)), rows[:, 3:4]),
            (Step("s1", None, 4, sample=True, ids=(at4,), guess_from=4), rows[:, 4:5]),
        ]
        answers = await asyncio.gather(*(service.handle_step(r, t) for r, t in steps))
        await service.aclose()
        return [a.body for a in answers]

    answers = asyncio.run(run())
    assert STALE_RESULT not in answers
    assert answer_bytes.decode(answers[0]).token_id == at4


def test_a_flight_confirms_a_right_guess_and_drops_the_rest_on_a_wrong_one():
    import asyncio

    async def scenario():
        loop = asyncio.get_running_loop()
        flight = GuessFlight(depth=4)
        futures = [loop.create_future() for _ in range(3)]
        for i, future in enumerate(futures):
            at = 11 + i
            flight.add(at, 100 + i, future)
            assert flight.rewind_from(at + 1) == 11  # the first guess still unanswered
        assert flight.take(11, 100).position == 11  # the tail sampled the guess
        assert flight.take(12, 999) is None  # it did not: the rest are stale
        await flight.drop()
        assert len(flight) == 0 and futures[1].cancelled() and futures[2].cancelled()
        assert flight.rewind_from(20) == 20
        assert (flight.guessed, flight.confirmed) == (3, 1)

    asyncio.run(scenario())


def test_a_flight_counts_the_tokens_of_each_traversal_waited_for():
    flight = GuessFlight(depth=4)
    # waited, right, right | waited | waited, right: traversals of 3, 1 and 2 tokens
    done = [flight.traversal(fresh) for fresh in (True, False, False, True, True, False)]
    assert done == [0, 0, 0, 3, 1, 0]
    assert flight.finish() == 2 and flight.finish() == 0


def test_steps_in_flight_leave_stages_that_share_the_cores_their_turns():
    """Over fast links, stages on this host's cores get one step each that can compute at
    once; stages elsewhere keep every step asked for, and links that make stages wait get
    as many more as fill the waits, measured (docs/adr/0036)."""
    local = ("http://127.0.0.1:9001", "http://127.0.0.1:9002")
    far = ("http://10.0.0.2:9001", "http://10.0.0.3:9002")

    def depth(route, threads, cpus, rtt_ms=0.3, pass_ms=8.0):
        return guess_depth(4, len(route) + 1, micro_batches(route, threads, cpus), rtt_ms, pass_ms)

    assert depth(local, threads=2, cpus=2) == 1  # three stages take turns on two cores
    assert depth(local, threads=1, cpus=2) == 2
    assert depth(far, threads=2, cpus=2) == 4  # three machines: each stage computes apart
    assert depth(local, threads=1, cpus=8) == 4
    # links that hold each step: the waits are filled with guesses, up to --guess-steps
    assert depth(local, threads=2, cpus=2, rtt_ms=10.0) == 3  # 5 ms each way, 8 ms passes
    assert depth(local, threads=2, cpus=2, rtt_ms=10.0, pass_ms=20.0) == 2
    assert depth(local, threads=2, cpus=2, rtt_ms=50.0) == 4  # 25 ms each way
    assert depth(local, threads=2, cpus=2, rtt_ms=50.0, pass_ms=40.0) == 3  # slow passes
    # not measured yet: a link never timed keeps the steps asked for; no pass time yet
    assert depth(local, threads=2, cpus=2, rtt_ms=None) == 4
    assert depth(local, threads=2, cpus=2, rtt_ms=50.0, pass_ms=None) == 4
    assert depth(local, threads=2, cpus=2, rtt_ms=0.3, pass_ms=None) == 1
    assert depth(local, threads=2, cpus=2, rtt_ms=float("inf")) == 4


def test_the_default_cap_lets_a_measured_link_take_more_guesses_than_an_unmeasured_one():
    """``--guess-steps`` (8 by default) bounds a depth the measured round trip and pass
    time ask for; until both are timed no more than 4 go out (a loopback link not yet
    probed must not put 8 steps on two shared cores)."""
    local = ("http://127.0.0.1:9001", "http://127.0.0.1:9002")  # 3 stages on 2 cores
    concurrent = micro_batches(local, 2, 2)
    assert guess_depth(DEFAULT_DEPTH, 3, concurrent, 50.0, 14.0) == 5  # 25 ms, 14 ms passes
    assert guess_depth(DEFAULT_DEPTH, 3, concurrent, 50.0, 8.0) == DEFAULT_DEPTH == 8
    assert guess_depth(DEFAULT_DEPTH, 3, concurrent, 200.0, 8.0) == 8  # at the cap
    assert guess_depth(DEFAULT_DEPTH, 3, concurrent, 0.3, 8.0) == concurrent  # loopback
    assert guess_depth(DEFAULT_DEPTH, 3, concurrent, None, 8.0) == UNMEASURED_DEPTH == 4
    assert guess_depth(DEFAULT_DEPTH, 3, concurrent, 50.0, None) == 4
    assert guess_depth(3, 3, concurrent, 50.0, None) == 3  # an operator's lower cap holds
    assert guess_depth(3, 3, concurrent, 200.0, 8.0) == 3
    # stages that compute apart: 4 as before over fast links, more over slow ones
    assert guess_depth(DEFAULT_DEPTH, 3, 3, 0.3, 8.0) == 4
    assert guess_depth(DEFAULT_DEPTH, 3, 3, None, None) == 4
    assert guess_depth(DEFAULT_DEPTH, 3, 3, 50.0, 8.0) == 8

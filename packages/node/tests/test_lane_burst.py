"""A head's steps run ahead down its decode lane (docs/adr/0059): over a real socket pair to
a hop that runs the rest of a tiny model, a burst hands the loop, step by step, the tokens of
the same split run one step at a time, sends each step with its own position and input,
stops at its limit, an end token or when told, and a step that fails ends it with the head's
cache where the next step starts; a burst stopped before it began never reads the lane."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import torch
from transformers import AutoConfig

from meshnet_common import wire
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.dataplane import answer_bytes, lanes, step_bytes
from meshnet_node.dataplane.answer_lanes import AnswerLane
from meshnet_node.dataplane.lane_burst import LaneBurst
from meshnet_node.dataplane.lanes import LaneError
from meshnet_node.dataplane.steps import Step
from meshnet_node.engine.ahead import Ahead
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import DecodeItem, Stage
from meshnet_node.speculation.guessing import guess_depth

PROMPT = [5, 17, 42, 99, 7, 3]
CUT = 3


def _stages(snapshot) -> tuple[Stage, Stage]:
    layers = AutoConfig.from_pretrained(snapshot).num_hidden_layers
    head = Stage(load_shard(snapshot, LayerRange(0, CUT), Precision.FLOAT32))
    tail = Stage(load_shard(snapshot, LayerRange(CUT, layers), Precision.FLOAT32))
    return head, tail


def _opened(head: Stage, tail: Stage, sid: str) -> int:
    """A greedy session open on both stages, its prompt run: its first token."""
    head.open_session(sid)
    tail.open_session(sid)
    hidden = head.step(sid, 0, token_ids=torch.tensor([PROMPT])).hidden
    return tail.step(sid, 0, hidden=hidden).token.token_id


def _one_by_one(head: Stage, tail: Stage, sid: str, token: int, steps: int) -> list[int]:
    out = []
    for i in range(steps):
        hidden = head.step(sid, len(PROMPT) + i, token_ids=torch.tensor([[token]])).hidden
        token = tail.step(sid, len(PROMPT) + i, hidden=hidden).token.token_id
        out.append(token)
    return out


class _Transport:
    def __init__(self) -> None:
        self.paused = 0

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        self.paused -= 1

    def close(self) -> None:
        pass


class _Hop(threading.Thread):
    """The rest of the chain on the other end of a lane: runs each step on ``tail`` and
    answers its token, or (at the ``fail``-th step) an error status or a closed lane."""

    def __init__(self, sock: socket.socket, tail: Stage, fail: tuple[int, int | None] | None,
                 answers: socket.socket | None = None):  # fmt: skip
        super().__init__(daemon=True)
        self.sock, self.tail, self.fail = lanes.blocking(sock), tail, fail
        self.answers = answers  # the tail's end of the head's answer lane (ADR-0060)
        self.steps: list[Step] = []
        self.directs: list[tuple[int, lanes.Direct]] = []  # (the lane's number, what it said)

    def run(self) -> None:
        try:
            while True:
                kind, seq, payload = lanes.read_message(self.sock)
                direct = None
                if kind == lanes.LaneKind.DIRECT:
                    direct, start = lanes.parse_direct(payload)
                    payload = payload[start:]
                    self.directs.append((seq, direct))
                step, _, start = step_bytes.decode(payload)
                self.steps.append(step)
                if self.fail is not None and len(self.steps) == self.fail[0]:
                    if self.fail[1] is None and direct is not None:  # the answer lane closes:
                        self.answers.close()  # this step's answer comes up the chain
                        direct = None
                    elif self.fail[1] is None:
                        self.sock.close()
                        return
                    else:
                        lanes.write(self.sock, lanes.answer(seq, self.fail[1], "", b"{}"))
                        continue
                hidden = wire.read_frame(payload[start:]).tensor()
                out = self.tail.step(step.session_id, step.position, hidden=hidden)
                body = answer_bytes.encode(out.token)
                if direct is None:
                    lanes.write(self.sock, lanes.answer(seq, 200, "1.000", body))
                else:
                    lanes.write(self.answers, lanes.answer(direct.seq, 200, direct.compute(1.0),
                                                           body))  # fmt: skip
        except LaneError:
            pass


def _burst(head, tail, sid, token, ahead, go_on=lambda: True, fail=None, forget=False,
           direct=False):  # fmt: skip
    """Run a burst of ``sid``'s step at the end of its prompt; (burst, output, hop, the
    steps taken). ``direct``: with an answer lane, on which the hop answers (ADR-0060)."""

    async def main():
        near, far = socket.socketpair()
        client = lanes.LaneClient(near)
        transport = _Transport()
        client.connection_made(transport)
        answers = answered = None
        if direct:
            mine, answered = socket.socketpair()
            answers = AnswerLane("http://127.0.0.1:9", lanes.blocking(mine))
        hop = _Hop(far, tail, fail, answered)
        hop.start()
        step = Step(sid, "k", len(PROMPT), route=(), sample=True, ids=(token,))
        burst = LaneBurst(client, step, None, wire.encode_tensor, 30.0, answers)
        assert transport.paused == 1  # the loop stopped reading it
        if forget:
            burst.forget()
        item = DecodeItem(sid, len(PROMPT), token_ids=torch.tensor([[token]]),
                          ahead=Ahead(ahead.limit, ahead.ends, down=burst))  # fmt: skip
        gives = []  # the head's turn given back: once each step is written (and at the end)
        task = asyncio.ensure_future(asyncio.to_thread(
            burst.run, head, item, go_on, lambda fn: (fn(), 0.001), lambda: gives.append(1)
        ))  # fmt: skip
        burst.started(task)
        taken = []  # each step's answer, taken in order as the loop takes them
        try:
            while (got := await burst.take(len(PROMPT) + len(taken))) is not None:
                taken.append(got)
            out = await task
            assert len(gives) == burst.steps + 1
        finally:
            await asyncio.sleep(0.01)  # the release the compute thread sent
            assert transport.paused == 0
            if client.closed is None:  # blocking during the burst, the loop's again after it
                assert client.out.gettimeout() == lanes.LANE_TIMEOUT_S
            client.close()
            far.close()
            for lane in (answers, answered):
                if lane is not None:
                    lane.close()
        return burst, out, hop, taken

    return asyncio.run(main())


def _tokens(taken) -> list[int]:
    return [answer_bytes.decode(got.answer().body).token_id for got in taken]


def test_a_burst_gives_the_tokens_of_the_same_split_step_by_step(tiny_snapshot):
    head, tail = _stages(tiny_snapshot("llama"))
    first = _opened(head, tail, "plain")
    want = _one_by_one(head, tail, "plain", first, 6)
    assert _opened(head, tail, "burst") == first
    burst, out, hop, taken = _burst(head, tail, "burst", first, Ahead(5))
    assert _tokens(taken) == want and burst.steps == 6
    assert [got.position for got in taken] == list(range(len(PROMPT), len(PROMPT) + 6))
    assert all(got.head_ms == 1.0 and got.sent > 0 for got in taken)
    # each step said its own position and input: the token before it
    assert [(s.position, s.ids) for s in hop.steps] == [
        (len(PROMPT) + i, (t,)) for i, t in enumerate([first, *want[:-1]])
    ]
    assert out.compute_s == pytest.approx(0.006)  # the head's own passes, not the hop's
    assert out.frame is not None  # the first step's
    assert head.sessions.peek("burst").length == len(PROMPT) + 6


def test_each_answer_reaches_the_loop_once_the_next_step_is_written(tiny_snapshot,
                                                                    monkeypatch):  # fmt: skip
    """The loop's work on a token runs while the chain computes the next step, not beside
    the head's next pass (ADR-0059, amended); the last answer goes at once."""
    head, tail = _stages(tiny_snapshot("llama"))
    first = _opened(head, tail, "s")
    handed = []  # (the answer's position, the head's cache length then)
    hand = LaneBurst._hand

    def handing(self, step):
        handed.append((step.position, head.sessions.peek("s").length))
        hand(self, step)

    monkeypatch.setattr(LaneBurst, "_hand", handing)
    _, _, hop, taken = _burst(head, tail, "s", first, Ahead(5))
    assert len(taken) == 6 and len(hop.steps) == 6
    # as the answer at position p went to the loop, the head had run p + 1 and written it
    assert [length for _, length in handed[:-1]] == [p + 2 for p, _ in handed[:-1]]
    assert handed[-1][1] == handed[-1][0] + 1


def test_a_burst_stops_at_an_end_token_when_told_and_when_stopped(tiny_snapshot):
    head, tail = _stages(tiny_snapshot("llama"))
    first = _opened(head, tail, "plain")
    want = _one_by_one(head, tail, "plain", first, 6)
    _opened(head, tail, "ends")
    _, _, _, taken = _burst(head, tail, "ends", first, Ahead(5, frozenset({want[2]})))
    assert len(taken) == want.index(want[2]) + 1
    _opened(head, tail, "told")
    asked = []
    _, _, _, taken = _burst(head, tail, "told", first, Ahead(5),
                            lambda: asked.append(1) or len(asked) < 3)  # fmt: skip
    assert len(taken) == 3  # yes, yes, no


@pytest.mark.parametrize("failure", [503, 421, None])  # an error; a refusal; a lane closing
def test_a_step_that_fails_ends_the_burst_and_the_heads_cache_before_it(tiny_snapshot, failure):
    head, tail = _stages(tiny_snapshot("llama"))
    first = _opened(head, tail, "s")
    burst, _, _, taken = _burst(head, tail, "s", first, Ahead(5), fail=(3, failure))
    assert len(taken) == 3 and burst.steps == 3
    assert all(got.answer().status == 200 for got in taken[:2])
    if failure is None:
        assert isinstance(taken[2].answer(), LaneError)
    else:
        assert taken[2].answer().status == failure
    # the third step's head pass ran; it is forgotten: the next step sends it again
    assert head.sessions.peek("s").length == len(PROMPT) + 2


def test_the_tail_answers_a_burst_on_the_heads_answer_lane(tiny_snapshot):
    """With an answer lane (ADR-0060) each step goes as ``DIRECT`` (its tag, the answer
    lane's number for it, no hop timed yet) and its answer comes on that lane: the same tokens. A
    failure on the first hop's lane still ends the burst; the answer lane closing does not:
    that step's answer and the next steps' come up the chain, the same tokens."""
    head, tail = _stages(tiny_snapshot("llama"))
    first = _opened(head, tail, "plain")
    want = _one_by_one(head, tail, "plain", first, 6)
    _opened(head, tail, "direct")
    burst, _, hop, taken = _burst(head, tail, "direct", first, Ahead(5), direct=True)
    assert _tokens(taken) == want and all(got.direct for got in taken)
    # numbered by the answer lane itself: bursts through other first hops may share it
    assert [d.seq for _, d in hop.directs] == list(range(1, 7))
    assert burst.answers.number() == 7
    assert {d.tag for _, d in hop.directs} == {burst.answers.tag}
    assert all(d.compute_us == () for _, d in hop.directs)
    _opened(head, tail, "error")
    _, _, _, taken = _burst(head, tail, "error", first, Ahead(5), fail=(3, 503), direct=True)
    assert len(taken) == 3 and all(got.direct for got in taken[:2])
    assert taken[2].answer().status == 503 and not taken[2].direct
    _opened(head, tail, "closed")
    burst, _, hop, taken = _burst(head, tail, "closed", first, Ahead(5), fail=(3, None),
                                  direct=True)  # fmt: skip
    assert _tokens(taken) == want and burst.answers.failed
    assert [got.direct for got in taken] == [True, True] + [False] * 4
    assert len(hop.directs) == 3  # the steps after it went as plain ones


def test_a_first_step_refused_keeps_its_output_for_the_stream(tiny_snapshot):
    head, tail = _stages(tiny_snapshot("llama"))
    first = _opened(head, tail, "s")
    burst, out, _, taken = _burst(head, tail, "s", first, Ahead(5), fail=(1, 421))
    assert [got.answer().status for got in taken] == [421] and burst.steps == 1
    assert out.frame is not None  # sent on by the stream, as it is
    assert head.sessions.peek("s").length == len(PROMPT) + 1


def test_a_burst_stopped_before_it_began_never_reads_the_lane(tiny_snapshot):
    head, tail = _stages(tiny_snapshot("llama"))
    first = _opened(head, tail, "s")
    with pytest.raises(LaneError, match="stopped"):
        _burst(head, tail, "s", first, Ahead(5), forget=True)
    assert head.sessions.peek("s").length == len(PROMPT)


def test_a_chain_with_a_lane_keeps_no_more_steps_in_flight_than_its_links_need():
    # three stages on two cores' worth of threads, loopback links: the lane, one step
    assert guess_depth(8, 3, 2, 0.2, 10.0) == 2
    assert guess_depth(8, 3, 2, 0.2, 10.0, lane=True) == 1
    assert guess_depth(8, 3, 2, 0.2, None, lane=True) == 1
    # a fast stage's pass is short beside even a loopback's round trip: still the lane
    assert guess_depth(8, 3, 2, 0.8, 2.0) == 2
    assert guess_depth(8, 3, 2, 0.8, 2.0, lane=True) == 1
    # slow links still fill the chain with guesses, lane or not
    assert guess_depth(8, 3, 2, 50.0, 10.0, lane=True) == 6
    # stages on machines of their own: as before
    assert guess_depth(8, 3, 3, 0.2, 10.0, lane=True) == guess_depth(8, 3, 3, 0.2, 10.0)

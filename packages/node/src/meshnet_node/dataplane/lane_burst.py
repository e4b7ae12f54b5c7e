"""A head's decode steps run ahead down its decode lane (docs/adr/0059).

On a lane (ADR-0058) a step of a lone session still went back to the head's event loop
between two tokens: the loop read the tail's answer, turned the token into text, submitted
the next step, and the compute thread woke for it, ~0.35 ms of a SmolLM2 step over three
processes in which no core computed this session's token. A *burst* goes on instead: the
head's compute thread runs the step's own layers, writes the step on the lane, reads the
tail's answer there itself, hands it to the loop (which streams the token meanwhile), and
runs the next step with the token it names, until ``Ahead.limit`` further steps, an end
token, another pass or lane that waits, or the loop says stop. Each step is the
single-token step the loop would have sent, with the same ids, so every hop computes and
samples the same bits; the loop takes each step's answer as it would have got it
(``take``), in order.

While a burst is possible the loop stops reading the lane (its transport is paused when
the burst is made, ``LaneClient.hold``) and the compute thread reads it; the loop reads it
again once the burst is over (``release``), or at once if the burst never ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from meshnet_node.dataplane import lane_io, lanes, step_bytes
from meshnet_node.dataplane.answer_lanes import AnswerLane
from meshnet_node.dataplane.lane_known import NextMessage, moved
from meshnet_node.dataplane.lane_wait import ASLEEP, Cadence
from meshnet_node.dataplane.lanes import LaneAnswer, LaneError
from meshnet_node.engine.step_io import DecodeItem, StepOutput

BURST_RTT_S = 0.05  # a lane whose last answer came back sooner may run bursts (AHEAD_S)
LANE_AHEAD_TOKENS = 64  # further steps a burst may run (each streams as it comes)
HAND_AFTER_S = 0.0005  # a step's answer goes to the loop this long after the next is written


class BurstStep(NamedTuple):
    """One step of a burst as the loop takes it: the tail's answer's payload (or the lane's
    failure), the head's compute ms, the step's time from written to answered, its bytes
    sent. The compute thread goes on with the answer's ``status`` and ``token``
    (``lane_io.answer_token``); the loop parses the rest (``answer``)."""

    position: int
    payload: bytes | BaseException
    head_ms: float
    rtt_s: float
    sent: int
    direct: bool = False  # answered on the head's answer lane by the tail (ADR-0060)
    status: int = -1  # -1: the lane failed, or the answer is malformed
    token: int = -1  # -1: the answer names none

    def answer(self) -> LaneAnswer | BaseException:
        """The tail's answer, parsed (on the loop), or the lane's failure."""
        if isinstance(self.payload, BaseException):
            return self.payload
        try:
            return lanes.parse_answer(self.payload)
        except LaneError as exc:
            return exc


class LaneBurst:
    """Steps of one session run ahead down the lane ``client``, from ``step`` (the step the
    lane carries: route, the hops after the first); ``request_id``: its log id;
    ``encode``: the head's output to the first hop's frame; ``timeout_s``: how long an
    answer may take; ``answers``: the head's answer lane to the route's tail, which then
    answers each step there itself (``DIRECT``, ADR-0060); ``cadence``: the lane's answers'
    beat, looked for ahead where it is steady (``lane_wait``). Made on the loop, run once on
    the compute thread (``run``: a pass of the scheduler, ``task`` on the loop), its steps
    taken on the loop (``take``)."""

    def __init__(self, client: lanes.LaneClient, step, request_id: str | None,
                 encode: Callable[[torch.Tensor], bytes], timeout_s: float,
                 answers: AnswerLane | None = None,
                 cadence: Cadence | None = None) -> None:  # fmt: skip
        self.client = client
        self.answers = answers
        self.cadence = cadence  # when answers are due (``lane_wait``); None: asleep till then
        self.step = step
        self.request_id = request_id
        self.encode = encode
        self.timeout_s = timeout_s
        self.steps = 0  # the head's steps run in the burst (0: it did not run as one)
        self.stopped = False  # the loop's word: no further step
        self.task: asyncio.Future | None = None  # the pass that runs it (set on the loop)
        self._loop = asyncio.get_running_loop()
        self._taken: dict[int, BurstStep] = {}  # by position, until the loop takes them
        self._waiter: asyncio.Future | None = None
        self._lock = threading.Lock()
        self._head: bytes | None = None
        self._message: NextMessage | None = None  # each step after the first fills it in
        self._give: Callable[[], None] = lambda: None  # the turn a head pass kept (``run``)
        self._state = "new"  # -> "running" (compute thread) or "forgotten" (loop)
        client.hold()

    # -- on the loop -------------------------------------------------------------------------

    def forget(self) -> None:
        """The burst will not be needed (its session closes, or its pass ran as a plain
        step: the session was no longer alone): one not begun never reads the lane; one
        running stops before its next step."""
        self.stopped = True
        with self._lock:
            if self._state == "new":
                self._state = "forgotten"
                self.client.release()

    def started(self, task: asyncio.Future) -> None:
        """``task``: the pass that runs the burst."""
        self.task = task
        task.add_done_callback(lambda _: self._wake())

    async def take(self, position: int) -> BurstStep | None:
        """The burst's step at ``position``, once answered; None where the burst ended
        before it."""
        while True:
            got = self._taken.pop(position, None)
            if got is not None:
                return got
            if self.task is None or self.task.done():
                return None
            self._waiter = self._loop.create_future()
            await self._waiter

    def _put(self, got: BurstStep) -> None:
        self._taken[got.position] = got
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- on the compute thread ---------------------------------------------------------------

    def run(self, stage, item: DecodeItem, go_on: Callable[[], bool],
            timed: Callable[[Callable[[], object]], tuple[object, float]],
            give: Callable[[], None] = lambda: None) -> StepOutput:  # fmt: skip
        """``item``'s step through the head's layers and down the lane, then more while the
        tail's tokens allow (``item.ahead``), ``go_on()`` and the loop did not stop it; each
        answer handed to the loop as it comes. Returns the first step's output, its
        ``compute_s`` the head's compute of every step. ``timed``: a head pass, timed, in
        one of the host's compute turns, kept until ``give`` (called once the step is
        written: the give is off the chain's critical path)."""
        with self._lock:
            if self._state != "new":
                raise LaneError("the burst was stopped before it began")
            self._state = "running"
        sock = self.client.out
        try:
            # Blocking, its timeout in the kernel, while the loop does not read the lane: a
            # socket with a Python timeout polls before each read and write (ADR-0058). The
            # loop's transport shares the socket's non-blocking flag: set again before the
            # loop reads it (``release``).
            lanes.blocking(sock, self.timeout_s)
            self._give = give
            return self._run(stage, item, go_on, timed)
        finally:
            give()  # idempotent: a pass that raised before its step was written
            with contextlib.suppress(OSError):
                sock.settimeout(lanes.LANE_TIMEOUT_S)  # non-blocking again, as the loop's
            self.client.release_soon()

    def _run(self, stage, item: DecodeItem, go_on, timed) -> StepOutput:
        ahead = item.ahead
        sock = self.client.out
        position, ids, first, token, spent = item.position, item.token_ids, None, None, 0.0
        answered: BurstStep | None = None  # handed to the loop once the next step is off
        try:
            while True:
                out, took = timed(lambda p=position, t=ids: stage.step(
                    item.session_id, p, token_ids=t, owner=item.owner, sample=item.sample))  # fmt: skip
                self.steps += 1
                spent += took
                if first is None:
                    first = out
                before, answered = answered, None
                answered, ids, view = self._exchange(
                    sock, position, token, out, took * 1000, before
                )  # fmt: skip
                ok = answered.status == 200
                # None where malformed: the loop meets it (``HopLinks.burst_step``)
                token = answered.token if ok and answered.token >= 0 else None
                refused = answered.status == lanes.LANE_REFUSED
                if not ok and not (refused and self.steps == 1):
                    # the head's cache ends before the step the chain did not complete (a
                    # first step refused goes on the stream with this output: ``_burst``)
                    stage.sessions.forget_from(item.session_id, position)
                if (
                    token is None or self.steps > ahead.limit or token in ahead.ends
                    or self.stopped or not go_on()
                ):  # fmt: skip
                    break
                position += 1
                view[0] = token  # the next step's input, made while the chain computed
        finally:
            if answered is not None:
                self._hand(answered)
        first.compute_s = spent  # type: ignore[union-attr]
        return first  # type: ignore[return-value]

    def _step_bytes(self, position: int, token: int | None) -> bytes:
        """The bytes of the step at ``position`` with input ``token`` (None: the item's)."""
        if self._head is None:  # the first step's bytes; each later one's are them moved on
            self._head = step_bytes.encode(self.step, self.request_id)
        return self._head if token is None else moved(self._head, position, token)

    def _exchange(self, sock, position: int, token: int | None, out: StepOutput,
                  head_ms: float, answered: BurstStep | None):  # fmt: skip
        """Write the step at ``position`` (input ``token``; None: the item's), the head's
        output ``out``, hand the step ``answered`` before it to the loop, and read this
        one's answer; with the next step's input tensor and a view to write its token in.
        The first step's frame is kept on ``out`` (``frame``: None where a later step's
        message was filled in)."""
        sent = time.perf_counter()
        seq = self.client.next_seq()
        answers = self._answers()
        prefix = direct_seq = None  # the tail answers on the answer lane (ADR-0060)
        if answers is not None:
            direct_seq = answers.number()
            prefix = lanes.direct_prefix(answers.tag, direct_seq)
        ids = view = None
        size, came, status, got_token = 0, False, -1, -1
        try:
            try:
                size = self._write(sock, seq, position, token, out, prefix)
            finally:
                self._give()  # the head's turn, kept from its pass (``run``)
            if answered is not None:  # once this step is on its way and its next hop has
                self._let_next_begin(sock)  # begun it: the loop's work on the step before
                self._hand(answered)  # is then off the critical path and takes no core
                answered = None  # the next hop needs
            # the next step's input tensor, made while the chain computes this one (once the
            # next hop began it: on a core it may share, nothing runs before it but this wait)
            ids = torch.empty((1, 1), dtype=torch.int64)
            view = ids.numpy().reshape(-1)
            got, came, status, got_token = self._answer(sock, seq, direct_seq)
        except (OSError, LaneError) as exc:
            got = exc
        finally:
            if answered is not None:  # the write failed: the step before is the loop's too
                self._hand(answered)
        took = time.perf_counter() - sent
        return BurstStep(position, got, head_ms, took, size, came, status, got_token), ids, view

    def _let_next_begin(self, sock) -> None:
        """Wait (asleep) ``HAND_AFTER_S`` or until an answer comes, whichever is first. Handed
        to the loop at once, the step before woke the loop's thread as the next hop woke,
        and its ~0.2-0.4 ms of Python (the answer parsed, the token streamed) took the core
        that hop was to run on: ~150-200 us more from the head's write to the next hop's
        read, and more in every piece of the head after (measured with
        ``bench/step_trace.py``, ADR-0059 amended 2026-12-07, end of day)."""
        ready = select.poll()
        answers = self._answers()
        with contextlib.suppress(OSError, ValueError):  # a lane closed: the read says so
            ready.register(sock, select.POLLIN)
            if answers is not None:
                ready.register(answers.sock, select.POLLIN)
            ready.poll(HAND_AFTER_S * 1000)

    def _write(self, sock, seq: int, position: int, token: int | None, out: StepOutput,
               prefix: bytes | None) -> int:  # fmt: skip
        """Write the step numbered ``seq`` (``prefix``: its ``DIRECT`` prefix, if any): the
        message of the step before filled in where it fits (``NextMessage``), else made anew
        (and kept for the next steps); its size."""
        message = self._message
        if message is not None and token is not None:
            size = message.send(sock, seq, position, token, out.hidden, prefix, self.timeout_s)
            if size:
                return size
        direct = None if prefix is None else lanes.parse_direct(prefix)[0]
        frame = self.encode(out.hidden)
        if self.steps == 1:
            out.frame = frame
        data = lanes.step_message(seq, self._step_bytes(position, token), frame, direct)
        sock.sendall(data)
        self._message = NextMessage.of(self._head, frame, out.hidden, direct)  # type: ignore[arg-type]
        return len(data)

    def _answer(self, sock, seq: int, direct_seq: int | None) -> tuple[bytes, bool, int, int]:
        """The payload of the answer to the step numbered ``seq`` (on the answer lane:
        ``direct_seq``), whether it came on the answer lane, its status and the token it
        names (``lane_io.read_answer``): on the lane ``sock`` or,
        with an answer lane, on whichever of the two it comes (the tail answers there; the
        first hop, on its lane, a failure or a
        refusal, or an answer the stream carried). An answer lane that closed is left: the
        tail answers up the chain again (it refuses a step naming a lane it lost, and the
        hop that ran it sends it on by the stream)."""
        answers = self._answers() if direct_seq is not None else None
        cadence = self.cadence
        sleep_s, spin_s = ASLEEP if cadence is None else cadence.due()
        started = time.perf_counter()
        while True:
            if answers is not None and sock.fileno() < 0:
                raise LaneError("the lane closed")
            got = lane_io.read_answer(
                sock, None if answers is None else answers.sock, self.timeout_s, seq,
                -1 if direct_seq is None else direct_seq, sleep_s, spin_s,
            )  # fmt: skip
            if got is not None:
                if cadence is not None:
                    cadence.note(time.perf_counter() - started)
                return got
            answers.failed, answers = True, None  # type: ignore[union-attr]

    def _answers(self) -> AnswerLane | None:
        """The answer lane the steps name, while it is open."""
        answers = self.answers
        return None if answers is None or answers.failed else answers

    def _hand(self, step: BurstStep) -> None:
        """On the compute thread: ``step``, answered, to the loop (``take``)."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody takes it
            self._loop.call_soon_threadsafe(self._put, step)

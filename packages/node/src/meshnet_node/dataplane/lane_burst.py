"""A head's decode steps run ahead down its decode lane (docs/adr/0059).

On a lane (ADR-0058) a step of a lone session still went back to the head's event loop
between two tokens: the loop read the tail's answer, turned the token into text, submitted
the next step, and the compute thread woke for it, ~0.35 ms of a ~7 ms SmolLM2 step over
three processes in which no core computed this session's token. Where the head is also the
tail a step runs ahead on the compute thread instead (ADR-0047); ``LaneBurst`` does the same
down a chain: the head's compute thread runs the step's own layers, writes the step on the
lane, reads the tail's answer there itself, and, with the token it names, runs the next
step, until ``Ahead.limit`` further steps, an end token, ``AHEAD_S`` or another pass that
waits. Each step is the single-token step the head would have submitted, with the same
ids, so every hop computes and samples the same bits. The head receives the tokens as it
receives a step that ran ahead.

While a burst is possible the loop stops reading the lane (its transport is paused when
the burst is made, ``LaneClient.hold``) and the compute thread reads it; it is read by the
loop again once the burst is over (``release``), or at once if the burst never ran.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from meshnet_node.dataplane import answer_bytes, lanes, step_bytes
from meshnet_node.dataplane.lane_known import moved
from meshnet_node.dataplane.lanes import LaneAnswer, LaneError, LaneKind
from meshnet_node.engine.step_io import DecodeItem, StepOutput

BURST_RTT_S = 0.05  # a lane whose last answer came back sooner may run bursts (AHEAD_S)


class LaneBurst:
    """One head step that may run ahead down the lane ``client``. ``step``: the step the
    lane carries (route: the hops after the first); ``request_id``: its log id;
    ``encode``: the head's output to the first hop's frame; ``timeout_s``: how long an
    answer may take. Made on the loop, run once on the compute thread (``run``), read on
    the loop (``answers``, ``failure``, ``head_ms``)."""

    def __init__(self, client: lanes.LaneClient, step, request_id: str | None,
                 encode: Callable[[torch.Tensor], bytes], timeout_s: float) -> None:  # fmt: skip
        self.client = client
        self.step = step
        self.request_id = request_id
        self.encode = encode
        self.timeout_s = timeout_s
        self.answers: list[LaneAnswer] = []  # each step's answer, in order (all 200 but
        self.failure: BaseException | LaneAnswer | None = None  # where it stopped on this)
        self.head_ms: list[float] = []  # the head's compute of each step
        self.sent_bytes = 0
        self.rtt_s: list[float] = []  # each step's time from written to answered
        self._lock = threading.Lock()
        self._head: bytes | None = None
        self._state = "new"  # -> "running" (compute thread) or "forgotten" (loop)
        client.hold()

    @property
    def steps(self) -> int:
        """How many steps of the head ran in the burst (0: it did not run as one)."""
        return len(self.head_ms)

    def forget(self) -> None:
        """On the loop: the step's caller left, or its pass ran as a plain step (the
        session was no longer alone). A burst not begun never reads the lane."""
        with self._lock:
            if self._state == "new":
                self._state = "forgotten"
                self.client.release()

    @property
    def ran(self) -> bool:
        return self._state == "running"

    # -- on the compute thread ---------------------------------------------------------------

    def run(self, stage, item: DecodeItem, go_on: Callable[[], bool],
            timed: Callable[[Callable[[], object]], tuple[object, float]]) -> StepOutput:  # fmt: skip
        """``item``'s step through the head's layers and down the lane, then more while the
        tail's tokens allow (``item.ahead``) and ``go_on()``; the first step's output, its
        ``compute_s`` the head's compute of every step. ``timed``: a head pass, timed, in
        the host's compute turn."""
        with self._lock:
            if self._state != "new":
                raise LaneError("the step's caller left")
            self._state = "running"
        try:
            return self._run(stage, item, go_on, timed)
        finally:
            self.client.release_soon()

    def _run(self, stage, item: DecodeItem, go_on, timed) -> StepOutput:
        ahead = item.ahead
        sock = self.client.out
        sock.settimeout(self.timeout_s)
        position, ids, first = item.position, item.token_ids, None
        token = None
        while True:
            out, took = timed(lambda p=position, t=ids: stage.step(
                item.session_id, p, token_ids=t, owner=item.owner, sample=item.sample))  # fmt: skip
            self.head_ms.append(took * 1000)
            frame = self.encode(out.hidden)
            if first is None:
                first = out
                first.frame = frame
            got, ids, view = self._exchange(sock, position, token, frame)
            if got is None:  # the lane failed (``failure``): nothing more
                break
            if got.status != 200:
                self.failure = got
                break
            self.answers.append(got)
            # None where malformed: the loop meets it (``HopLinks.burst_answer``)
            token = answer_bytes.token_of(got.body)
            if (
                token is None or len(self.answers) > ahead.limit or token in ahead.ends
                or not go_on()
            ):  # fmt: skip
                break
            position += 1
            view[0] = token  # the next step's input, made while the chain computed
        if self.failure is not None and self.answers:  # a later step failed: the head's
            stage.sessions.forget_from(item.session_id, position)  # cache ends before it
        first.compute_s = sum(self.head_ms) / 1000
        return first

    def _exchange(self, sock, position: int, token: int | None, frame: bytes):
        """Write the step at ``position`` (input ``token``; None: the item's own) with
        ``frame``, and read its answer; with the next step's input tensor and a view to
        write its token in. Nones where the lane failed."""
        if self._head is None:  # the first step's bytes; each later one's are them moved on
            self._head = step_bytes.encode(self.step, self.request_id)
        head = self._head if token is None else moved(self._head, position, token)
        seq = self.client.next_seq()
        data = lanes.message(LaneKind.STEP, seq, head, frame)
        try:
            sent = time.perf_counter()
            sock.sendall(data)
            self.sent_bytes += len(data)
            # the next step's input tensor, made while the chain computes this one
            ids = torch.empty((1, 1), dtype=torch.int64)
            view = ids.numpy().reshape(-1)
            while True:
                kind, got_seq, payload = lanes.read_message(sock)
                if kind != LaneKind.ANSWER:
                    raise LaneError(f"a {kind.name} message from the hop")
                if got_seq == seq:
                    break  # an answer to an older step is stale: skipped
            self.rtt_s.append(time.perf_counter() - sent)
            return lanes.parse_answer(payload), ids, view
        except (OSError, LaneError) as exc:
            self.failure = exc
            return None, None, None

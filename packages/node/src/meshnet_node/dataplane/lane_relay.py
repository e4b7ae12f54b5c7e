"""A node's decode lanes on its compute thread (docs/adr/0058): ``LaneRelay``, which the
compute thread calls with each readable lane: a step from the hop before is parsed, run and
written on to the next hop's lane (or, at the tail, answered: on the head's answer lane
where the step names one, ADR-0060); an answer from the next hop goes back with this hop's
compute time. The loop's side (the listener, the lanes dialed): ``lane_ends``.

Only a plain decode step of a session open here, unaudited, takes a lane; anything else
(an opening, a prompt chunk, drafts, a guess, a replay, a step of an audited session) is
refused before it runs (``LANE_REFUSED``) and its sender sends it on the hop stream, where
every step can go. A refused step changed nothing here. A step whose pass ran and whose next
hop's lane then failed is answered as a failed hop (502 naming it): the head fails over as
it does when a stream breaks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import socket
import time
from collections import deque
from dataclasses import replace

from meshnet_common import wire
from meshnet_common.errors import HopError, InvalidRequest, MeshnetError, Quarantined
from meshnet_common.protocol import format_compute
from meshnet_node.dataplane import answer_bytes, lane_io, lanes, step_bytes
from meshnet_node.dataplane.lane_known import KnownStep, NextMessage
from meshnet_node.dataplane.lane_wait import ASLEEP, Cadence
from meshnet_node.dataplane.lanes import LANE_REFUSED, LaneError, LaneKind, plain
from meshnet_node.dataplane.steps import Step
from meshnet_node.engine.step_io import DecodeItem, is_decode_input
from meshnet_node.scheduling.policy import DECODE
from meshnet_node.scheduling.scheduler import _decode_call, _timed

logger = logging.getLogger(__name__)

# Steps sent on with the tail answering the head itself, kept for a refusal or an error
# that may still come back up through this hop (the latest this many).
DIRECT_PENDING = 1024


class LaneRefused(MeshnetError):
    status = LANE_REFUSED
    error_type = "invalid_request_error"


def _nothing_waits() -> bool:
    return False


def _error(seq: int, exc: BaseException) -> bytes:
    if isinstance(exc, MeshnetError):
        body = exc.to_openai()
        status = exc.status
    else:
        logger.error("unhandled error on a decode lane", exc_info=exc)
        body = {"error": {"message": f"internal error: {type(exc).__name__}",
                          "type": "internal_error", "param": None, "code": None}}  # fmt: skip
        status = 500
    return lanes.answer(seq, status, "", json.dumps(body).encode())


class LaneRelay:
    """The compute thread's side of a node's lanes. ``service``: the node's ``NodeService``
    (its stage, links, scheduler); ``loop``: where bookkeeping after a step goes."""

    def __init__(self, service, loop: asyncio.AbstractEventLoop) -> None:
        self.service = service
        self.loop = loop
        self.downstream: dict[str, socket.socket] = {}  # next hop URL -> lane (compute thread)
        # (next hop's lane, number) -> (the lane before, its number, own ms, when sent, the
        # step and frame sent on: to send by the stream if the next hop refuses it)
        self._pending: dict[tuple[int, int], tuple] = {}
        self._seq = 0
        self.steps = 0  # steps run from lanes
        # Sessions whose steps the next hop's lane refused (the latest ``lanes.BY_SESSION_MAX``).
        self.by_stream: dict[str, None] = {}
        self._relays: set[asyncio.Task] = set()
        # Tokens through this stage and sampled here from lanes (the compute thread's counts;
        # ``NodeService.tokens_served`` and ``tokens_generated`` add them).
        self.served = self.generated = 0
        # The last step read in full on each lane from the hop before, by socket: its
        # session's next step is read against it (``lane_known``).
        self.known: dict[socket.socket, KnownStep] = {}
        self._ran: tuple[float, bool] | None = None  # the step just run, not yet counted
        self._turns = False  # the next pass's turns (``_turns_now``); False: not decided
        # The tail's end of heads' answer lanes (ADR-0060): by tag, and each lane's tag.
        self.answer_lanes: dict[bytes, socket.socket] = {}
        self._answer_tags: dict[socket.socket, bytes] = {}
        self._direct: deque[tuple[int, int]] = deque(maxlen=DIRECT_PENDING)
        self._holding = None  # the turns a pass kept until its step is written on
        self._cadences: dict[socket.socket, Cadence] = {}  # by lane: when its steps are due

    @property
    def watch(self):
        """The compute thread's sockets, from the first lane on (a node no lane reaches
        keeps waiting on its condition variable alone)."""
        return self.service.scheduler.read_sockets()

    # -- handed in from the loop -------------------------------------------------------------

    def adopt_upstream(self, sock: socket.socket) -> None:
        self.watch.watch(lanes.blocking(sock), self.on_upstream)

    def adopt_downstream(self, hop: str, sock: socket.socket) -> None:
        def reader(s: socket.socket) -> None:
            self.on_downstream(s, hop)

        def added(s: socket.socket) -> None:  # on the compute thread, which alone uses it
            old = self.downstream.get(hop)
            self.downstream[hop] = s
            if old is not None:
                self._lost(old, hop, LaneError("replaced"))

        self.watch.watch(lanes.blocking(sock), reader, added)

    # -- on the compute thread ---------------------------------------------------------------

    def on_upstream(self, sock: socket.socket) -> None:
        """A step (or another message) from the hop before, and the next ones while each
        comes before anything else the compute thread waits for (``lane_io.read_next``)."""
        message = None
        while self._upstream(sock, message) and sock.fileno() >= 0:
            cadence = self._cadence(sock)
            sleep_s, spin_s = ASLEEP if cadence is None else cadence.due()
            started = time.perf_counter()
            try:
                message = lane_io.read_next(sock, self._others, lanes.LANE_TIMEOUT_S,
                                            self.known.get(sock), sleep_s, spin_s)  # fmt: skip
            except LaneError as exc:
                logger.debug("a lane from the hop before closed: %s", exc)
                self.forget_upstream(sock)
                return
            if message is None:  # something else came first: the beat is broken
                if cadence is not None:
                    cadence.forget()
                return
            if cadence is not None:
                cadence.note(time.perf_counter() - started)

    def _cadence(self, sock: socket.socket) -> Cadence | None:
        """When the lane's next step is due (``lane_wait``); None where its reader sleeps
        until it comes."""
        cadence = self._cadences.get(sock)
        if cadence is None and (spin_s := self.service.links.lane_spin_s) > 0:
            cadence = self._cadences[sock] = Cadence(spin_s)
        return cadence

    @functools.cached_property
    def _others(self) -> int:
        """What the compute thread waits for beside a lane: its selector's descriptor."""
        return self.watch.fileno()

    def _upstream(self, sock: socket.socket, message: tuple | None) -> bool:
        """One message from the hop before (``message``: already read, else read here);
        False where the lane was left."""
        came = None  # a DIRECT step's prefix, as it came (its tail answers the head itself)
        known = self.known.get(sock)
        try:
            # read against the session's last step: ``got`` where it matches (``lane_known``)
            kind, seq, payload, start, got = message or lane_io.read(
                sock, lanes.LANE_TIMEOUT_S, known
            )  # fmt: skip
            if kind == LaneKind.DIRECT:  # (ADR-0060; checked as it was read)
                came = payload[:start]
            elif kind == LaneKind.ANSWERS and len(payload) == lanes.DIRECT_TAG_BYTES:
                self.answer_lanes[payload] = sock  # a head's lane: its answers go here
                self._answer_tags[sock] = payload
                return False  # read by the selector from here on (nothing comes on it)
            elif kind != LaneKind.STEP:
                raise LaneError(f"a {kind.name} message from the hop before")
        except LaneError as exc:
            logger.debug("a lane from the hop before closed: %s", exc)
            self.forget_upstream(sock)
            return False
        try:
            if got is None or (
                (reply := self._known_step(sock, seq, got, known, came)) is False
            ):  # fmt: skip
                reply = self._step(sock, seq, payload[start:] if start else payload, came)
        except LaneRefused as exc:
            self.loop.call_soon_threadsafe(self.service.metrics.lane_refused.inc)
            reply = _error(seq, exc)
        except Exception as exc:
            reply = _error(seq, exc)
        try:
            if reply is not None:
                lanes.write(sock, reply)
        except LaneError:
            self.forget_upstream(sock)
            return False
        finally:
            if (holding := self._holding) is not None:  # the pass's turn, once it is off
                self._holding = None
                holding.give()
        # Once the step is on its way: its counts, and the next step's input made ready.
        if (ran := self._ran) is not None:
            self._ran = None
            self._count(len(payload) - start, *ran)
        if (known := self.known.get(sock)) is not None:
            known.prepare()  # the next step's input, while this hop idles
            if known.message is not None and not self.service.links.raw_to(known.hop):
                known.message = None  # the link is measured slow now: frames compressed
        return True

    def forget_upstream(self, sock: socket.socket) -> None:
        self.known.pop(sock, None)
        self._cadences.pop(sock, None)
        if (tag := self._answer_tags.pop(sock, None)) is not None:
            self.answer_lanes.pop(tag, None)
        self.watch.forget(sock)

    def on_downstream(self, sock: socket.socket, hop: str) -> None:
        try:
            kind, seq, payload = lane_io.read_message(sock, lanes.LANE_TIMEOUT_S)
            if kind != LaneKind.ANSWER:
                raise LaneError(f"a {kind.name} message from the next hop")
        except LaneError as exc:
            self._lost(sock, hop, exc)
            return
        waiting = self._pending.pop((sock.fileno(), seq), None)
        if waiting is None:
            return
        up, up_seq, own_ms, sent, onward, frame = waiting
        got = lanes.parse_answer(payload)
        if got.status == LANE_REFUSED:  # it ran here: it goes on from here, by the stream
            if not isinstance(onward, Step):  # a step read against the last (KnownStep)
                known, position, token = onward
                onward = known.onward_step(position, token)
            if isinstance(frame, NextMessage):  # its buffer holds this step until answered
                frame = frame.frame()
            self.by_stream[onward.session_id] = None
            if len(self.by_stream) > lanes.BY_SESSION_MAX:
                del self.by_stream[next(iter(self.by_stream))]
            self.loop.call_soon_threadsafe(self._spawn_relay, up, up_seq, own_ms, hop, onward,
                                           frame)  # fmt: skip
            return
        took = time.perf_counter() - sent
        compute = format_compute(own_ms, got.compute) if got.status == 200 else got.compute
        try:
            lanes.write(up, lanes.answer(up_seq, got.status, compute, got.body))
        except LaneError:
            self.forget_upstream(up)
        self.service.metrics.hop_seconds.labels(hop).observe(took)  # once the answer is off

    def _lost(self, sock: socket.socket, hop: str, exc: Exception) -> None:
        """The lane to ``hop`` failed: its steps in flight are failed hops."""
        fileno = sock.fileno()
        if self.downstream.get(hop) is sock:
            del self.downstream[hop]
        self.watch.forget(sock)
        failure = HopError(f"hop {hop} failed: {exc}", hop=hop)
        for key in [k for k in self._pending if k[0] == fileno]:
            up, up_seq, *_ = self._pending.pop(key)
            with contextlib.suppress(LaneError):
                lanes.write(up, _error(up_seq, failure))

    def _known_step(self, up: socket.socket, seq: int, got: tuple, known: KnownStep,
                    came: bytes | None):  # fmt: skip
        """Run a step read against ``known`` (``got``: its position, id and input; ``came``:
        its ``DIRECT`` prefix, if any), with the checks that can change between two steps;
        False where it must be read in full (the stage, the session, the lanes or the
        head's answer lane not as they were)."""
        service = self.service
        stage, sid = known.stage, known.session_id
        if service.stage_for(sid) is not stage or service.quarantined is not None:
            return False
        session = stage.sessions.peek(sid)
        if session is None or session.record is not None or session.keep is not None:
            return False
        down = None
        if known.hop is not None:
            down = self.downstream.get(known.hop)
            if down is not known.down or sid in self.by_stream:
                return False
        elif came is not None and came[: lanes.DIRECT_TAG_BYTES] not in self.answer_lanes:
            return False
        position, token, hidden = got
        if down is None:  # before it samples: the penalties count
            stage.sessions.observe(sid, position, (token,), owner=known.owner)
        owner, sample = known.owner, known.sample
        out, own_ms = self._pass(
            lambda: stage.step(sid, position, hidden=hidden, owner=owner, sample=sample), sample
        )  # fmt: skip
        if down is None:
            return self._answer(seq, out, own_ms, came)
        number = self._next_seq()
        came = None if came is None or not known.direct_on else came  # sent on as it came
        message = known.message
        if message is not None and self._send_on(
            up, seq, own_ms, known.hop, down, number, None,  # type: ignore[arg-type]
            (known, position, token), message, came is not None,
            (position, token, out.hidden, came, own_ms),
        ):  # fmt: skip
            return None
        onward = None if came is None else lanes.parse_direct(came)[0].on(own_ms)
        frame = self.service.links.encoder(known.hop)(out.hidden)  # type: ignore[arg-type]
        head = known.onward_bytes(position, token)
        data = lanes.step_message(number, head, frame, onward)
        self._send_on(up, seq, own_ms, known.hop, down, number, data,  # type: ignore[arg-type]
                      (known, position, token), frame, onward is not None)  # fmt: skip
        known.message = NextMessage.of(head, frame, out.hidden, onward)  # once it is off
        return None

    def _step(self, up: socket.socket, seq: int, payload: bytes,
              came: bytes | None) -> bytes | None:  # fmt: skip
        """Run one step from a lane; its answer (the tail's, or a refusal or an error), or
        None where it went on to the next hop, whose answer comes back later (or, a
        ``DIRECT`` step that ``came`` with its prefix, the tail's goes to the head
        itself)."""
        self.known.pop(up, None)
        direct = None if came is None else lanes.parse_direct(came)[0]
        service = self.service
        step, request_id, start = step_bytes.decode(payload)
        frame = wire.read_frame(payload[start:], max_bytes=service.settings.max_body_bytes)
        shape = frame.shape
        step.check_tokens(shape[1] if len(shape) >= 2 else math.prod(shape))
        stage = service.stage_for(step.session_id)
        shard = stage.shard
        if not plain(step) or not is_decode_input(shard, frame):
            raise LaneRefused("not a plain decode step")
        if shard.is_tail == bool(step.route):
            raise InvalidRequest("the route must end at the tail", param="route")
        if service.quarantined is not None:
            raise Quarantined(*service.quarantined)
        session = stage.sessions.peek(step.session_id)
        if session is not None and (
            session.record is not None
            or (session.keep is not None and step.position < session.keep.tokens)
        ):  # an audit's inputs, or ids that name prefix-cache blocks: noted on the loop
            raise LaneRefused("this session's step goes on the stream")
        down = None
        if not shard.is_tail:
            down = self.downstream.get(step.route[0])
            if down is None:
                self.loop.call_soon_threadsafe(service.lanes.want, step.route[0])
                raise LaneRefused("no lane to the next hop yet")
        elif direct is not None and direct.tag not in self.answer_lanes:
            raise LaneRefused("no answer lane from the head (closed)")
        if shard.is_tail and step.ids is not None:  # before it samples: the penalties count
            stage.sessions.observe(step.session_id, step.position, step.ids,
                                   owner=step.session_key)  # fmt: skip
        item = DecodeItem(
            step.session_id, step.position, token_ids=frame if shard.is_head else None,
            hidden=None if shard.is_head else frame, owner=step.session_key, sample=step.sample,
        ).made()  # fmt: skip
        out, own_ms = self._pass(_decode_call(stage, [item], _nothing_waits)[0], step.sample)
        if down is None:  # the tail
            self.known[up] = KnownStep.of(payload, start, step, frame, stage, None, None, None)  # type: ignore[assignment]
            return self._answer(seq, out, own_ms, came)
        hop = step.route[0]
        onward = replace(step, route=step.route[1:])
        if step.session_id in self.by_stream:  # the next hop refused its steps before
            tensor = service.links.encoder(hop)(out.hidden)
            self.loop.call_soon_threadsafe(self._spawn_relay, up, seq, own_ms, hop, onward,
                                           tensor)  # fmt: skip
            return None
        head = step_bytes.encode(onward, request_id)
        known = KnownStep.of(payload, start, step, frame, stage, hop, down, head)
        self.known[up] = known  # type: ignore[assignment]
        tensor = service.links.encoder(hop)(out.hidden)
        number = self._next_seq()
        # a next hop of an older version would close its lane on a DIRECT step: it gets a
        # plain one, whose answer comes back here and goes up (ADR-0060)
        direct_on = service.links.lane_direct(hop)
        sent_on = None if direct is None or not direct_on else direct.on(own_ms)
        data = lanes.step_message(number, head, tensor, sent_on)
        self._send_on(up, seq, own_ms, hop, down, number, data, onward, tensor,
                      sent_on is not None)  # fmt: skip
        if known is not None:  # the session's next steps fill in this message (once it is off)
            known.message = NextMessage.of(head, tensor, out.hidden, sent_on)
            known.direct_on = direct_on
        return None

    def _pass(self, call, sample: bool):
        """On the compute thread: a one-step pass (``call``), with the node's torch threads
        and the host's turns; its output and compute ms. It is counted here, not on the loop
        (waking it would take a core and the GIL from the passes of this step's next hops;
        the metrics take their own locks), once the step is on its way (``_count``)."""
        if self._turns is False:
            self._turns = self._turns_now()
        turns = self._turns
        out, compute_s = _timed(call, self.service.scheduler.before_pass, turns, keep=True)
        self._holding = turns  # given back once the step is on its way (``on_upstream``)
        self._ran = (compute_s, sample)  # counted once the step is on its way (``_count``)
        return out, compute_s * 1000

    def _turns_now(self):
        """The host's turns for a one-step pass here: none where such passes are not known
        to be short (ADR-0036)."""
        scheduler = self.service.scheduler
        expected = scheduler.queue.times.expected_s(DECODE, 1)
        short = expected is not None and expected < scheduler.queue.turn_max_s
        return scheduler.turns if short else None

    def _count(self, received: int, compute_s: float, sample: bool) -> None:
        self.service.scheduler.queue.times.note(DECODE, 1, compute_s)
        self._turns = self._turns_now()  # the next pass's, decided while the hop idles
        self.steps += 1
        metrics = self.service.metrics
        metrics.wire_received.inc(received)
        metrics.lane_steps.inc()
        self.served += int(sample)

    def _answer(self, seq: int, out, own_ms: float, came: bytes | None) -> bytes | None:
        """The tail's answer to the step numbered ``seq``; None where it went to the head
        itself, on the answer lane its ``DIRECT`` prefix (``came``) names (ADR-0060)."""
        self.generated += out.token is not None
        body = answer_bytes.EMPTY if out.token is None else answer_bytes.encode(out.token, out.more)
        if came is None:
            return lanes.answer(seq, 200, format_compute(own_ms), body)
        lane = self.answer_lanes.get(came[: lanes.DIRECT_TAG_BYTES])
        try:
            if lane is None:
                raise LaneError("closed")
            lane_io.send_answer(lane, came, 200, own_ms, body)
        except LaneError as exc:  # the head hears it on its lane (which it also reads)
            if lane is not None:
                self.forget_upstream(lane)
            return _error(seq, HopError(f"the answer lane to the head failed: {exc}"))
        return None

    def _next_seq(self) -> int:
        self._seq = self._seq + 1 if self._seq < 0xFFFFFFFF else 1
        return self._seq

    def _send_on(self, up, seq: int, own_ms: float, hop: str, down, number: int,
                 data: bytes | None, onward, frame, direct: bool = False,
                 fill: tuple | None = None) -> bool:  # fmt: skip
        """Write ``data``, the lane message numbered ``number`` of the step ``onward`` (or
        what makes it) and its ``frame`` (or the ``NextMessage`` holding it), on the next
        hop's lane; its answer comes back later (``direct``: only a refusal or an error, the
        tail answering the head itself; the latest ``DIRECT_PENDING`` such are kept).
        ``fill``: no ``data``, the ``NextMessage`` filled in with these (position, id,
        output, the ``DIRECT`` prefix the step came with and this hop's compute:
        ``NextMessage.send_on``) and written in one call; False where it does not fill it
        in (nothing written: the message is made anew)."""
        key = (down.fileno(), number)
        self._pending[key] = (up, seq, own_ms, time.perf_counter(), onward, frame)
        try:
            if data is None:
                size = frame.send_on(down, number, *fill)
                if not size:
                    del self._pending[key]
                    return False
            else:
                lanes.write(down, data)
                size = len(data)
        except LaneError as exc:
            self._lost(down, hop, exc)  # answers this step too: a failed hop
            return True
        if direct:  # kept once it is off: a failed write answered it already
            if len(self._direct) == DIRECT_PENDING:
                self._pending.pop(self._direct[0], None)
            self._direct.append(key)
        self.service.metrics.wire_sent.inc(size - lanes.HEAD_BYTES)  # once it is off
        return True

    # -- a step that ran here and goes on by the stream ---------------------------------------

    def _spawn_relay(self, up, up_seq: int, own_ms: float, hop: str, onward, frame: bytes):
        """On the loop: relay a step this hop ran on by the hop stream (the next hop refused
        it on its lane, as it does a step of a session it audits); its answer goes back on
        the lane it came from, written by the compute thread."""
        task = asyncio.ensure_future(self._relay(up, up_seq, own_ms, hop, onward, frame))
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)

    async def _relay(self, up, up_seq: int, own_ms: float, hop: str, onward, frame: bytes):
        try:
            resp = await self.service.links.relay(hop, None, onward, frame)
        except Exception as exc:  # a failed hop: its error, as a lane answers it
            reply = _error(up_seq, exc)
        else:
            reply = lanes.answer(up_seq, 200, format_compute(own_ms, resp.compute_ms), resp.body)
        self.service.scheduler.call(functools.partial(self._write_up, up, reply))

    def _write_up(self, up: socket.socket, reply: bytes) -> None:
        try:
            lanes.write(up, reply)
        except LaneError:
            self.forget_upstream(up)

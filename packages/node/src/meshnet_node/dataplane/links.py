"""The links from a node to the next hops of its routes: sending a step and waiting for its
answer (through the chain, or straight from the tail: ADR-0020), answering a head directly
from the tail, and timing the links the tracker asks about (ADR-0021). ``NodeService`` holds
one ``HopLinks`` (``service.links``): everything a node says to other nodes goes through it."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable

import torch

from meshnet_common import wire
from meshnet_common.errors import HopError
from meshnet_common.logs import request_id_var
from meshnet_common.metrics import Metrics
from meshnet_common.protocol import (
    H_COMPUTE,
    H_POSITION,
    H_ROUTE,
    H_SESSION_KEY,
    StepResult,
    parse_compute,
)
from meshnet_node.dataplane import answer_bytes, lanes, step_bytes
from meshnet_node.dataplane.answer_lanes import AnswerLanes
from meshnet_node.dataplane.lane_burst import BURST_RTT_S, BurstStep, LaneBurst
from meshnet_node.dataplane.lane_wait import Cadence
from meshnet_node.dataplane.link_speeds import PROBE_BYTES, LinkSpeeds
from meshnet_node.dataplane.steps import Step
from meshnet_node.dataplane.streams import HopResponse, HopTransport, HopUnreachable
from meshnet_node.settings import HopTimeouts

logger = logging.getLogger(__name__)
_STEP_HEADERS: dict[str, str] = {}  # a step's body says it all (``step_bytes``)

LANE_RETRY_S = 30.0  # a hop whose lane could not be dialed: steps on the stream for this long
UNREACHABLE_HEAD_S = 30.0  # a head the tail could not answer directly: through the chain
LINK_PROBE_SESSION = "link-probe"  # never opened: closing it costs the next hop nothing
LINK_PROBE_TIMEOUT_S = 2.0
LINK_SAMPLES = 4  # a link's round trip: the least of this many probes (probe_links)
_PROBE_BODY = bytes(PROBE_BYTES)  # a probe's large message (link_speeds)


def _parsed(hop: str, body: bytes, compute: str | None) -> StepResult:
    try:
        result = answer_bytes.decode(body)
    except ValueError as exc:
        raise HopError(f"hop {hop} answered a malformed step result", hop=hop) from exc
    result.compute_ms = parse_compute(compute)
    return result


def _hop_error(hop: str, status: int, raw: bytes) -> HopError:
    """A hop's answer that is not a 200, as the error the head routes by."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = None
    # 4xx and 503 (a full node) keep their meaning; anything else is a broken hop.
    status = status if 400 <= status < 500 or status == 503 else 502
    message = (body or {}).get("error", {}).get("message") or raw[:200].decode("utf-8", "replace")
    return HopError(f"hop {hop}: {message}", status=status, hop=hop, body=body)


def _lane_expired(client: lanes.LaneClient, waiting: asyncio.Future) -> None:
    """No answer in time on a lane: the step fails as a broken hop, and the lane closes."""
    if not waiting.done():
        waiting.set_exception(lanes.LaneError("TimeoutError: no answer in time"))
        client.close()


def _drained(task: asyncio.Task) -> None:
    """The chain's answer to a step the tail answered directly: only its failure matters
    (the next step meets the broken hop and fails over)."""
    if not task.cancelled() and task.exception() is not None:
        logger.info("the chain's answer to a directly answered step failed: %s",
                    task.exception())  # fmt: skip


class HopLinks:
    """A node's links to other nodes: sending steps on and hearing their answers (through
    the chain or straight from the tail), closing sessions down the chain, and timing the
    links to the next hops the tracker names.

    ``hops``: the transport (hop streams; tests put an in-process one here); ``timeouts``:
    per hop; ``direct_min_rtt_ms``: the link round trip from which direct answers pay;
    ``speeds``: the links' measured speeds, which say whether frames are compressed."""

    def __init__(
        self, hops: HopTransport, *, metrics: Metrics, timeouts: HopTimeouts,
        direct_min_rtt_ms: float, speeds: LinkSpeeds,
    ) -> None:  # fmt: skip
        self.hops = hops
        self.metrics = metrics
        self.speeds = speeds  # each link's measured speed: how its frames are packed
        self.timeouts = timeouts
        self.direct_min_rtt_ms = direct_min_rtt_ms
        # how long a lane's reader may look for a message due without sleeping (set once the
        # node's threads are known: ``lane_wait.spin_window_s``; 0: it sleeps until it comes)
        self.lane_spin_s = 0.0
        self._cadences: dict[str, Cadence] = {}  # by hop: its bursts' answers' beat
        # Direct answers (ADR-0020): steps whose answer this head awaits from the tail, by
        # (session, position); and heads this tail could not reach lately (URL -> when).
        self._answers: dict[tuple[str, int], tuple[asyncio.Future, str]] = {}
        self._unreachable_heads: dict[str, float] = {}
        self._background: set[asyncio.Task] = set()
        # Route choice (docs/adr/0021): the next hops the tracker asked us to time, and the
        # round trip to each (ms: the least of its last probes, ``probe_links``).
        self.probe_urls: tuple[str, ...] = ()
        self.rtt_ms: dict[str, float] = {}
        self.first_ms: dict[str, float] = {}  # one round trip per hop never probed (``slow``)
        self.rtt_samples: dict[str, deque[float]] = {}
        # Decode lanes (docs/adr/0058): this head's lanes to first hops, by URL.
        self.lanes_on = False
        self._lanes: dict[str, lanes.LaneClient] = {}
        self._lane_failed: dict[str, float] = {}  # hop -> when a dial failed
        self._lane_dials: set[str] = set()
        self.answer_lanes = AnswerLanes(self)  # to tails, for bursts (docs/adr/0060)

    async def aclose(self) -> None:
        for client in self._lanes.values():
            client.close()
        self.answer_lanes.close()
        await self.hops.aclose()

    def set_probe_urls(self, urls: tuple[str, ...]) -> None:
        """The next hops whose links to time (the tracker's word, in heartbeat answers)."""
        self.probe_urls = tuple(urls)

    async def send(
        self, hop: str, hidden: torch.Tensor, step: Step, frame: bytes | None = None
    ) -> StepResult:
        """POST one tensor frame to ``hop`` (``frame``: ``hidden`` already encoded by
        ``encoder(hop)``); returns the tail's answer, with the compute time of every hop
        after this one.

        With ``step.answer_to`` (this head's URL), the tail also posts the answer straight
        here: whichever comes first, the direct answer or the chain's, is the step's. The
        chain's answer still comes and still reports a failed hop, so a tail that cannot
        reach the head costs nothing but the time saved."""
        if step.answer_to is None:
            resp = await self.relay(hop, hidden, step, frame)
            return _parsed(hop, resp.body, resp.compute_ms)
        key = (step.session_id, step.position)
        direct = asyncio.get_running_loop().create_future()
        self._answers[key] = (direct, step.session_key)
        chain = asyncio.ensure_future(self.relay(hop, hidden, step, frame))
        try:
            await asyncio.wait((direct, chain), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            chain.cancel()
            raise
        finally:
            self._answers.pop(key, None)
        if direct.done():
            self.metrics.direct_answers.inc()
            chain.add_done_callback(_drained)  # the chain's copy: read, then dropped
            body, compute = direct.result()
            return _parsed(hop, body, compute)
        direct.cancel()
        resp = chain.result()  # a failed hop raises here, as without direct answers
        return _parsed(hop, resp.body, resp.compute_ms)

    def lane_step(
        self, hop: str, step: Step, burst: bool = False
    ) -> lanes.LaneStep | LaneBurst | None:
        """``step`` (the head's, going to ``hop``) on the lane to ``hop``, written by the
        compute thread once the head's pass encoded its output (``LaneStep.encoder``); None
        where it takes the stream (not a plain step, or no lane yet: one is dialed). With
        ``burst``, on a lane that answered its last step within ``BURST_RTT_S``: a step that
        may run ahead down the lane (``LaneBurst``, ADR-0059)."""
        if not self.lanes_on or not lanes.plain(step):
            return None
        client = self._lanes.get(hop)
        if client is None or not client.usable:
            self.want_lane(hop)
            return None
        request_id = request_id_var.get()
        fast = client.rtt_s is not None and client.rtt_s < BURST_RTT_S
        if burst and fast and len(step.ids or ()) == 1:
            # past a middle hop the tail answers on the head's answer lane (ADR-0060)
            direct = step.route and self.lane_direct(hop)
            answers = self.answer_lanes.get(step.route[-1]) if direct else None
            cadence = None
            if self.lane_spin_s > 0:  # the answers' beat, kept across the lane's bursts
                cadence = self._cadences.setdefault(hop, Cadence(self.lane_spin_s))
            return LaneBurst(client, step, request_id, self.encoder(hop),
                             self.timeouts.decode_step, answers, cadence)  # fmt: skip
        return lanes.LaneStep(client, functools.partial(step_bytes.encode, step, request_id))

    def lane_expected(self, hop: str) -> bool:
        """Whether plain steps to ``hop`` may take a decode lane: one is open, or offered."""
        if not self.lanes_on:
            return False
        client = self._lanes.get(hop)
        return (client is not None and client.usable) or self.lane_offer(hop) is not None

    def burst_step(self, hop: str, got: BurstStep) -> StepResult | None:
        """On the loop: the tail's answer to a step of a burst down the lane to ``hop``
        (ADR-0059), the head's compute not yet in; None where the step must be run again
        and sent on the stream (the first hop refused it before it ran)."""
        loop = asyncio.get_running_loop()
        loop.call_soon(self.metrics.wire_sent.inc, got.sent)
        answer = got.answer()
        if isinstance(answer, BaseException):  # the lane failed: a failed hop
            client = self._lanes.get(hop)
            if client is not None:
                client.close()
            raise HopError(f"hop {hop} failed: {answer}", hop=hop) from answer
        loop.call_soon(self._observe_hop, hop, got.rtt_s)
        if got.direct:  # the tail answered on the head's answer lane (ADR-0060)
            loop.call_soon(self.metrics.direct_answers.inc)
        if (client := self._lanes.get(hop)) is not None:
            client.rtt_s = got.rtt_s
        if answer.status == lanes.LANE_REFUSED:
            return None
        if answer.status != 200:
            raise _hop_error(hop, answer.status, answer.body)
        return _parsed(hop, answer.body, answer.compute)

    async def lane_answer(self, hop: str, lane: lanes.LaneStep) -> StepResult | None:
        """The tail's answer to a step written on the lane to ``hop``; None where it must go
        on the stream (not written, or the hops refused it before it ran)."""
        if not lane.written:
            lane.forget()
            if lane.failed is None:
                return None
            lane.client.close()
            raise HopError(f"hop {hop} failed: {lane.failed}", hop=hop) from lane.failed
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.timeouts.decode_step, _lane_expired, lane.client, lane.answer)
        loop.call_soon(self.metrics.wire_sent.inc, lane.size)  # while it waits, as ``relay``
        try:
            got = await lane.answer
        except lanes.LaneError as exc:
            raise HopError(f"hop {hop} failed: {exc}", hop=hop) from exc
        finally:
            timer.cancel()
        lane.client.rtt_s = rtt = time.perf_counter() - lane.sent
        loop.call_soon(self._observe_hop, hop, rtt)
        if got.status == lanes.LANE_REFUSED:
            return None
        if got.status != 200:
            raise _hop_error(hop, got.status, got.body)
        return _parsed(hop, got.body, got.compute)

    def lane_offer(self, hop: str) -> tuple[str, int, str] | None:
        """The lane ``hop`` offers on its open stream: (host, port, secret), or None."""
        offer = getattr(self.hops, "lane_offer", None)
        return None if offer is None else offer(hop)

    def lane_direct(self, hop: str) -> bool:
        """Whether ``hop``'s lane reads ``DIRECT`` steps (ADR-0060: not a node of an older
        version, which would close its lane on one)."""
        direct = getattr(self.hops, "lane_direct", None)
        return direct is not None and direct(hop)

    def want_lane(self, hop: str) -> None:
        """Dial a lane to ``hop`` in the background, if it offers one (and did not fail to
        connect lately)."""
        if hop in self._lane_dials:
            return
        failed = self._lane_failed.get(hop)
        if failed is not None and time.monotonic() - failed < LANE_RETRY_S:
            return
        offer = self.lane_offer(hop)
        if offer is None:
            return
        self._lane_dials.add(hop)
        task = asyncio.ensure_future(self._dial_lane(hop, *offer))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _dial_lane(self, hop: str, host: str, port: int, secret: str) -> None:
        try:
            sock = await lanes.dial(host, port, secret, self.timeouts.connect)
            loop = asyncio.get_running_loop()
            _, client = await loop.create_connection(
                functools.partial(lanes.LaneClient, sock), sock=sock
            )
        except (OSError, TimeoutError) as exc:
            self._lane_failed[hop] = time.monotonic()
            logger.info("no decode lane to %s (%s): its steps go on the stream", hop, exc)
            return
        finally:
            self._lane_dials.discard(hop)
        old = self._lanes.get(hop)
        self._lanes[hop] = client
        if old is not None:
            old.close()

    def deliver(self, session_id: str, key: str | None, position: int, body: bytes,
                compute: str | None) -> bool:  # fmt: skip
        """A tail's direct answer for a step this head awaits (False: none waits for it)."""
        entry = self._answers.get((session_id, position))
        if entry is None or entry[0].done() or key != entry[1]:
            return False
        entry[0].set_result((body, compute))
        return True

    def answer_head(self, req: Step, body: bytes, compute: str) -> None:
        """A tail's answer, posted straight to the head too (``req.answer_to``), beside the
        chain's: in the background, best effort."""
        task = asyncio.ensure_future(self._answer_head(req, body, compute))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _answer_head(self, req: Step, body: bytes, compute: str) -> None:
        """Post a tail's answer to the head (best effort: the chain carries it too)."""
        url = req.answer_to
        failed_at = self._unreachable_heads.get(url)
        if failed_at is not None and time.monotonic() - failed_at < UNREACHABLE_HEAD_S:
            return
        headers = {
            "content-type": answer_bytes.CONTENT_TYPE, H_SESSION_KEY: req.session_key or "",
            H_POSITION: str(req.position), H_COMPUTE: compute,
        }  # fmt: skip
        try:
            resp = await self.hops.request(
                "POST", f"{url}/v1/answers/{req.session_id}", headers=headers, body=body,
                timeout=self.timeouts.decode_step,
            )  # fmt: skip
        except HopUnreachable as exc:
            self._unreachable_heads[url] = time.monotonic()
            logger.warning("cannot answer the head %s directly (%s); answering through the "
                           "chain for %.0f s", url, exc, UNREACHABLE_HEAD_S)  # fmt: skip
            return
        if resp.status >= 500 or resp.status in (401, 403, 405):
            self._unreachable_heads[url] = time.monotonic()
            logger.warning("the head %s refused a direct answer (%d); answering through the "
                           "chain for %.0f s", url, resp.status, UNREACHABLE_HEAD_S)  # fmt: skip

    async def probe_links(self) -> None:
        """Time one small request (the data path's session close, for a session that does
        not exist) to each next hop the tracker named; what it reports in heartbeats.

        A link's round trip is the least of its last ``LINK_SAMPLES`` probes: a probe that
        meets a loop busy computing (either end's: decode steps may run on the loop)
        measures the wait, not the link."""
        urls = self.probe_urls
        for url in list(self.rtt_ms):
            if url not in urls:
                del self.rtt_ms[url]
                self.rtt_samples.pop(url, None)
                self.speeds.forget(url)
        if urls and self.speeds.auto and self.speeds.break_even is None:
            await asyncio.to_thread(self.speeds.measure_break_even)  # once: ~30 ms
        for url in urls:
            reachable, ms = await self._time(url)
            if not reachable:
                self.rtt_ms.pop(url, None)
                self.rtt_samples.pop(url, None)
                self.speeds.forget(url)
            if ms is None:
                continue
            samples = self.rtt_samples.setdefault(url, deque(maxlen=LINK_SAMPLES))
            samples.append(ms)
            self.rtt_ms[url] = min(samples)
            if self.speeds.auto:  # the same probe with PROBE_BYTES more: the link's speed
                _, large = await self._time(url, _PROBE_BODY)
                if large is not None:
                    self.speeds.note(url, ms / 1000, large / 1000)

    async def _time(self, url: str, body: bytes | None = None) -> tuple[bool, float | None]:
        """Whether ``url`` answers a probe (carrying ``body``, which it reads and ignores),
        and its round trip in ms (None when it does not answer)."""
        started = time.perf_counter()
        if not await self.reachable(url, body):
            return False, None
        return True, (time.perf_counter() - started) * 1000

    async def round_trip_ms(self, hop: str) -> float | None:
        """The round trip to ``hop`` in ms: the probes', or before any probe (a route that
        formed since), one timed now (twice: the first also opens the connection). That one
        is kept apart: direct answers are asked for until the probes say a link is fast
        (``direct_pays``). None: not measured (a busy loop); inf: unreachable."""
        rtt = self.rtt_ms.get(hop)
        if rtt is None:
            rtt = self.first_ms.get(hop)
        if rtt is None:
            timed = [await self._time(hop) for _ in range(2)]
            if not any(reachable for reachable, _ in timed):  # not asked again: the step
                rtt = math.inf  # itself fails over
            else:
                rtt = min((ms for _, ms in timed if ms is not None), default=None)
            if rtt is not None:
                self.first_ms[hop] = rtt
        return rtt

    async def slow(self, hop: str) -> bool:
        """Whether the link to ``hop`` is slow (``--direct-min-rtt``): its round trip
        (``round_trip_ms``), or not measured."""
        rtt = await self.round_trip_ms(hop)
        return rtt is None or rtt >= self.direct_min_rtt_ms

    def direct_pays(self, hop: str) -> bool:
        """Whether a direct answer is worth asking for on a chain starting at ``hop``: unless
        the link to it is known to be fast (``--direct-min-rtt``). A direct answer saves the
        links back up the chain, but costs every step one more message (about 0.3 ms of
        both ends' CPU): on a LAN or loopback the chain's answer is as fast (ADR-0020)."""
        rtt = self.rtt_ms.get(hop)
        return rtt is None or rtt >= self.direct_min_rtt_ms

    async def reachable(self, url: str, body: bytes | None = None) -> bool:
        """Whether ``url`` answers on the data path (a session close it does not know: 404)."""
        try:
            await self.hops.request(
                "DELETE", f"{url.rstrip('/')}/v1/sessions/{LINK_PROBE_SESSION}",
                headers={}, body=body, timeout=LINK_PROBE_TIMEOUT_S,
            )  # fmt: skip
        except HopUnreachable:
            return False
        return True

    async def close_remote(self, hop: str, session_id: str, key: str, route) -> None:
        """Free ``session_id`` on ``hop`` and (it relays the close) the hops of ``route``;
        best effort: a hop's idle timeout frees it anyway."""
        headers = {H_SESSION_KEY: key}
        if route:
            headers[H_ROUTE] = ",".join(route)
        try:
            await self.hops.request(
                "DELETE", f"{hop.rstrip('/')}/v1/sessions/{session_id}", headers=headers,
                body=None, timeout=5.0,
            )  # fmt: skip
        except HopUnreachable as exc:
            logger.warning("could not close session %s on %s: %s", session_id, hop, exc)

    def encoder(self, hop: str) -> Callable[[torch.Tensor], bytes]:
        """How a tensor for ``hop`` becomes its frame: raw on a link measured fast, zstd on
        others (ADR-0057). A decode step's output is encoded on the compute thread with it."""
        return functools.partial(wire.encode_tensor, options=self.speeds.options(hop))

    def raw_to(self, hop: str) -> bool:
        """Whether frames for ``hop`` go raw (``encoder``'s choice)."""
        options = self.speeds.options(hop)
        return not options.zstd_level and not options.shuffle

    async def relay(
        self, hop: str, hidden: torch.Tensor, step: Step, frame: bytes | None = None
    ) -> HopResponse:
        """POST one tensor frame to ``hop`` (``frame``: ``hidden`` already encoded by
        ``encoder(hop)``); returns its answer (a 200) unparsed."""
        prefill = frame is None and hidden.shape[1] > 1 and not step.drafts  # frame: decode
        if frame is None:
            options = self.speeds.options(hop)  # raw on a link measured fast (ADR-0057)
            if prefill:  # a prefill chunk: encode off the loop, beside the compute thread
                frame = await asyncio.to_thread(wire.encode_tensor, hidden, options)
            else:
                frame = wire.encode_tensor(hidden, options)
        # The step as bytes before its frame, in one body (docs/adr/0040); the request id
        # rides in it: every hop's log lines of this step carry the same id.
        body = step_bytes.encode(step, request_id_var.get()) + frame
        t = self.timeouts
        timeout = t.prefill_chunk if prefill else t.decode_step
        # Metrics are recorded off the step's critical path: once the frame is on its way
        # (a callback runs while this task waits for the answer), and after the answer
        # has been relayed. Cold library code costs tens of microseconds per call here.
        loop = asyncio.get_running_loop()
        loop.call_soon(self.metrics.wire_sent.inc, len(body))
        started = time.perf_counter()
        try:
            resp = await self.hops.request(
                "POST", f"{hop.rstrip('/')}/v1/forward", headers=_STEP_HEADERS, body=body,
                timeout=timeout,
            )  # fmt: skip
        except HopUnreachable as exc:
            raise HopError(f"hop {hop} failed: {exc}", hop=hop) from exc
        loop.call_soon(self._observe_hop, hop, time.perf_counter() - started)
        if resp.status != 200:
            raise _hop_error(hop, resp.status, resp.body)
        return resp

    def _observe_hop(self, hop: str, seconds: float) -> None:
        self.metrics.hop_seconds.labels(hop).observe(seconds)

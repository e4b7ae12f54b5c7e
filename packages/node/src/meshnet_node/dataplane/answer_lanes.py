"""A head's answer lanes (docs/adr/0060): a lane the head dials to its route's tail, on
which the tail answers the steps of the head's bursts itself (``DIRECT``), so an answer
crosses one link instead of climbing back through every middle hop.

The head opens a hop stream to the tail first (a link probe: the stream's handshake offers
the tail's lane, ADR-0058), dials that lane with its secret and names a random tag
(``ANSWERS``); a burst's steps carry the tag down the chain and the tail writes their
answers here. The compute thread reads the lane (only while a burst runs); the loop dials
and closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import socket
import time
from dataclasses import dataclass, field

from meshnet_node.dataplane import lanes
from meshnet_node.dataplane.lanes import LaneKind

logger = logging.getLogger(__name__)

RETRY_S = 30.0  # a tail whose answer lane could not be dialed is tried again after this


@dataclass(eq=False)
class AnswerLane:
    """One answer lane: the socket (the compute thread's, blocking) and the tag the tail
    knows it by; ``hop``: the tail's URL; ``failed``: set by a burst that met it closed.
    Its steps are numbered by the lane itself (``number``): bursts through different first
    hops may share it, and an answer left over from one is not another's."""

    hop: str
    sock: socket.socket
    tag: bytes = field(default_factory=lambda: secrets.token_bytes(lanes.DIRECT_TAG_BYTES))
    failed: bool = False
    _numbers: itertools.count = field(default_factory=lambda: itertools.count(1))

    def number(self) -> int:
        """The number of a step about to name this lane (the compute thread's)."""
        return next(self._numbers) & 0xFFFFFFFF

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # a burst reading it wakes
        with contextlib.suppress(OSError):
            self.sock.close()


class AnswerLanes:
    """The head's answer lanes, by tail URL (on the loop). ``links``: the head's
    ``HopLinks`` (its streams' lane offers, its probes)."""

    def __init__(self, links) -> None:
        self.links = links
        self._lanes: dict[str, AnswerLane] = {}
        self._dialing: set[str] = set()
        self._failed: dict[str, float] = {}  # tail -> when a dial failed
        self._tasks: set[asyncio.Task] = set()

    def get(self, tail: str) -> AnswerLane | None:
        """The answer lane to ``tail``, if one is open (else one is dialed meanwhile)."""
        lane = self._lanes.get(tail)
        if lane is not None and lane.failed:
            self.drop(lane)
            lane = None
        if lane is None:
            self._want(tail)
        return lane

    def drop(self, lane: AnswerLane) -> None:
        """``lane`` failed or is no longer wanted: closed, and dialed again when asked."""
        if self._lanes.get(lane.hop) is lane:
            del self._lanes[lane.hop]
        lane.close()

    def _want(self, tail: str) -> None:
        if tail in self._dialing:
            return
        failed = self._failed.get(tail)
        if failed is not None and time.monotonic() - failed < RETRY_S:
            return
        self._dialing.add(tail)
        task = asyncio.ensure_future(self._dial(tail))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dial(self, tail: str) -> None:
        try:
            offer = self.links.lane_offer(tail)
            if offer is None and await self.links.reachable(tail):  # opens a stream to it
                offer = self.links.lane_offer(tail)
            if offer is None:
                raise OSError("the tail offers no lane")
            if not self.links.lane_direct(tail):
                raise OSError("the tail's lane takes no direct steps (an older version)")
            host, port, secret = offer
            sock = await lanes.dial(host, port, secret, self.links.timeouts.connect)
            lane = AnswerLane(tail, sock)
            try:
                loop = asyncio.get_running_loop()
                message = lanes.message(LaneKind.ANSWERS, 0, lane.tag)
                await asyncio.wait_for(loop.sock_sendall(sock, message),
                                       self.links.timeouts.connect)  # fmt: skip
            except BaseException:
                sock.close()
                raise
        except (OSError, TimeoutError) as exc:
            self._failed[tail] = time.monotonic()
            logger.info("no answer lane to %s (%s): its answers come up the chain", tail, exc)
            return
        finally:
            self._dialing.discard(tail)
        lanes.blocking(sock)
        old = self._lanes.get(tail)
        self._lanes[tail] = lane
        if old is not None:
            old.close()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for lane in list(self._lanes.values()):
            self.drop(lane)

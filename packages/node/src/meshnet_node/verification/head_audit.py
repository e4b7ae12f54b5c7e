"""Auditing the head that feeds this node (docs/adr/0032): a node that is not a head, started
with ``--verify-fraction`` and a tracker, checks the hidden states a head sent it.

A head runs the audits of the hops after it (``Verifier``), so nobody checks its own output.
The hop after it can: it received the rows, and every step carries its token ids. For a
fraction of the sessions it opens where the coverage map shows two heads ``[0, S)`` of one
precision (``S``: where the session enters here), chosen at the opening step on its own
(a head could leave out the ``audit`` flag), the node keeps the session's input rows and
token ids (``InputRecord``). After a sampled decode step of such a session (one audit at a
time per session) it audits the head:

- the claim: the row the head sent for the last position with a known id;
- the sender: the head of ``[0, S)`` that holds the session under its key, found at the
  opening step (the head holds its session then; a short generation may end before an
  audit). Every head of the range is asked (``POST /v1/node/audit/holds/{session}``, the
  key named by a digest): the caller's address cannot tell heads on one host apart, and
  steps name no sender. A session no head admits to (or more than one) is ``skipped``. A
  wrong answer cannot convict an honest head: a verdict rests on the suspect's own signed
  recomputations;
- the inputs: the ids so far, an int64 frame ``(1, T)``, recomputed from layer 0 by the
  other heads of the range and the sender (``Stage.recompute``), judged exactly as a
  head's audits are (``judge``), and a conviction reported with its signed rows as the
  same ``Convictions`` do (reporter: this node).

Audits run beside the steps on the event loop and never delay one; the record is read on
the compute thread, between steps. A session's watch ends with it: an audit whose session
ended first is ``skipped``; one already under way finishes on what it read. A step without
ids (an older head) ends the session's watch, counted ``skipped``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

import torch

from meshnet_common import wire
from meshnet_node.verification.verifier import (
    AuditClient,
    Convictions,
    Finding,
    Replica,
    SwarmView,
    judge,
)

logger = logging.getLogger(__name__)

REPLICAS_TTL_S = 10.0  # how long the map read for choosing sessions at their opening holds


@dataclass
class _Watch:
    """A session whose head this node audits."""

    # The head that sent its rows and the other heads of its range and precision, found
    # at the opening (while the head surely holds the session), or why there are none.
    found: asyncio.Future
    task: asyncio.Task | None = None  # the audit under way


def _known(stage, session_id: str):
    """On the compute thread: the ids and the claimed row of a watched session."""
    session = stage.sessions.peek(session_id)
    if session is None or session.record is None:
        return None
    return session.record.known()


class HeadAuditor:
    """Audits a fraction of the sessions a head feeds this node; remembers its convictions."""

    def __init__(
        self,
        fraction: float,
        view: SwarmView,
        client: AuditClient,
        service,
        *,
        node_id: str,
        rng: random.Random | None = None,
        clock=time.monotonic,
    ) -> None:
        self.fraction = fraction
        self.view = view
        self.client = client
        self.service = service  # the NodeService: its stages, compute thread, metrics
        self.node_id = node_id
        self.rng = rng or random.Random()
        self.clock = clock
        self.convictions = Convictions(view, service.metrics, node_id=node_id, clock=clock)
        self._watched: dict[str, _Watch] = {}
        self._tasks: set[asyncio.Task] = set()
        self._map: list[Replica] | None = None  # the serving nodes, as last read
        self._map_at = float("-inf")
        self._reading: asyncio.Task | None = None

    def suspects(self) -> frozenset[str]:
        return self.convictions.suspects()

    # -- the data path's two hooks -----------------------------------------------------------

    def chooses(self, stage, req) -> bool:
        """At a session's opening step: whether this node keeps its inputs and ids to audit
        the head that sends them (then ``after_step`` watches it). Never raises."""
        start = stage.shard.layers.start if req.start_layer is None else req.start_layer
        key = req.session_key
        if stage.shard.is_head or not isinstance(start, int) or start <= 0 or not key:
            return False
        try:
            self._prune()
            if not self._auditable(start) or self.rng.random() >= self.fraction:
                return False
            found = self._spawn(self._find(req.session_id, key, start))
        except Exception:  # an audit never fails a step
            logger.exception("head audits: cannot choose session %s", req.session_id)
            return False
        self._watched[req.session_id] = _Watch(found)
        return True

    def after_step(self, stage, req) -> None:
        """After a step ran here: note its ids; after a decode step, maybe start an audit.
        Never raises: a failure ends the session's watch, counted ``skipped``."""
        watch = self._watched.get(req.session_id)
        if watch is None:
            return
        try:
            self._after_step(stage, req, watch)
        except Exception as exc:
            self._watched.pop(req.session_id, None)
            self.convictions.note(Finding("skipped", detail=f"{type(exc).__name__}: {exc}"))

    def _after_step(self, stage, req, watch: _Watch) -> None:
        session = stage.sessions.peek(req.session_id)
        record = None if session is None else session.record
        if record is None:
            del self._watched[req.session_id]
            return
        if req.ids is None:  # nothing to recompute the head's rows from
            del self._watched[req.session_id]
            self.convictions.note(Finding("skipped", detail="a step without token ids"))
            return
        record.note_ids(req.position, req.ids)
        decode = req.chunk == 0 and (len(req.ids) == 1 or req.drafts)  # one id a token
        if not decode or not req.sample or req.replay_pass:
            return
        if watch.task is not None and not watch.task.done():
            return
        if self.rng.random() >= self.fraction:
            return
        watch.task = self._spawn(self._audit(stage, req.session_id, watch))

    def _spawn(self, work) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the audit ---------------------------------------------------------------------------

    async def _audit(self, stage, session_id: str, watch: _Watch) -> None:
        try:
            finding = await self.audit(stage, session_id, watch)
        except Exception as exc:  # a node gone or refusing, a bad answer: no verdict
            finding = Finding("skipped", detail=f"{type(exc).__name__}: {exc}")
        if self.convictions.note(finding):
            await self.convictions.report(finding, self.service.model_id)

    async def audit(self, stage, session_id: str, watch: _Watch) -> Finding:
        """Audit the head that sent ``session_id``'s rows, on what it sent so far."""
        known = await self.service.compute(_known, stage, session_id)  # first: it may end
        if known is None:
            return Finding("skipped", detail="the session ended first")
        ids, claimed = known
        if claimed is None:
            return Finding("skipped", detail="no row with its token ids yet")
        found = await watch.found
        if isinstance(found, str):  # once: the session's watch ends
            self._watched.pop(session_id, None)
            return Finding("skipped", detail=found)
        sender, alternates = found
        inputs = wire.encode_tensor(
            torch.tensor([ids], dtype=torch.int64), self.service.wire_options
        )
        return await judge(self.client, sender, alternates, inputs, 0, claimed, self.rng)

    async def _find(self, session_id: str, key: str, start: int):
        """(the head of ``[0, start)`` holding the session under ``key``, the other heads
        of its range and precision), or why there is no such pair."""
        try:
            fresh = self._map is not None and self.clock() - self._map_at <= REPLICAS_TTL_S
            replicas = self._map if fresh else await self._replicas()
            heads = [r for r in replicas
                     if r.start == 0 and r.end == start and r.node_id != self.node_id]  # fmt: skip
            answers = await asyncio.gather(
                *(self.client.holds(h.url, session_id, key) for h in heads),
                return_exceptions=True,
            )  # fmt: skip
        except Exception as exc:  # the tracker unreachable, say
            return f"the sending head is unknown: {type(exc).__name__}: {exc}"
        holding = [h for h, held in zip(heads, answers, strict=True) if held is True]
        if len(holding) != 1:
            return f"{len(holding)} heads of [0, {start}) hold the session: the sender is unknown"
        sender = holding[0]
        alternates = [h for h in heads if h is not sender and h.same_precision(sender)]
        if not alternates:
            return f"the head {sender.node_id} has no replica to compare it with"
        return sender, alternates

    # -- the map -----------------------------------------------------------------------------

    async def _replicas(self) -> list[Replica]:
        self._map = await self.view.replicas(self.service.model_id)
        self._map_at = self.clock()
        return self._map

    def _auditable(self, start: int) -> bool:
        """Whether two heads ``[0, start)`` of one precision serve, as the map last read
        showed (read again in the background once stale; unread yet: yes, decided when
        auditing)."""
        if self.clock() - self._map_at > REPLICAS_TTL_S and (
            self._reading is None or self._reading.done()
        ):
            self._reading = asyncio.ensure_future(self._read_map())
        if self._map is None:
            return True
        heads = [r for r in self._map
                 if r.start == 0 and r.end == start and r.node_id != self.node_id]  # fmt: skip
        return any(a.same_precision(b) for i, a in enumerate(heads) for b in heads[i + 1 :])

    async def _read_map(self) -> None:
        try:
            await self._replicas()
        except Exception as exc:  # the tracker unreachable: the last map stays
            logger.debug("head audits: could not read the map: %s", exc)

    def _prune(self) -> None:
        """Forget watches of sessions that ended (and were not being audited)."""
        service = self.service
        for sid in [s for s, w in self._watched.items()
                    if service.stage_for(s).sessions.peek(s) is None
                    and (w.task is None or w.task.done())]:  # fmt: skip
            del self._watched[sid]

    async def aclose(self) -> None:
        for task in [*self._tasks, self._reading]:
            if task is not None:
                task.cancel()
        await self.client.aclose()


def build_head_auditor(settings, service, view: SwarmView | None, node_id: str):
    """The auditor of the heads feeding a node started with ``--verify-fraction`` (None: not
    auditing, or no tracker to ask for the map). Built for heads too: a reshard may move a
    node off the first layers, and a head's stage is never watched."""
    if not settings.verify_fraction or view is None:
        return None
    client = AuditClient(settings.swarm_token, max_bytes=settings.max_body_bytes,
                         identity=service.identity)  # fmt: skip
    return HeadAuditor(settings.verify_fraction, view, client, service, node_id=node_id)

"""The tracker's registry of nodes: soft state rebuilt from registrations and heartbeats."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from meshnet_common.errors import Conflict, RateLimited
from meshnet_common.layers import LayerRange
from meshnet_common.protocol import (
    MAX_ROUTE_TIMES,
    Heartbeat,
    NodeAnnouncement,
    NodeState,
    Verdict,
)
from meshnet_common.trust.evidence import Signer
from meshnet_common.trust.revocation import Revocations
from meshnet_common.web.auth import same_secret as _same
from meshnet_common.web.hosts import machine_names
from meshnet_tracker.coverage import ModelCoverage, ModelTable, ServingNode, build_coverage
from meshnet_tracker.routing import (
    measured_slowdowns,
    note_slowdown,
    route_reports,
    with_slowdowns,
)

logger = logging.getLogger(__name__)

MISSED_HEARTBEATS = 3  # a node silent this many intervals leaves the coverage map
# Plausible ranges of what nodes report for route choice, in ms (docs/adr/0032): a decode
# layer of a small model on a fast GPU takes some microseconds, a loopback round trip some
# tens; nothing takes a minute.
LAYER_MS = (0.002, 60_000.0)
LINK_MS = (0.02, 60_000.0)
# A head's report of a route's step time counts this long after it last sent it (docs/adr/0032).
ROUTE_TIMES_S = 300.0


def _clamp(value: float, bounds: tuple[float, float]) -> float:
    return min(max(value, bounds[0]), bounds[1])


@dataclass
class NodeRecord:
    """What the tracker knows of one node."""

    announcement: NodeAnnouncement
    state: NodeState
    last_heartbeat: float
    active_sessions: int = 0
    kv_tokens: int = 0
    memory_free_bytes: int = 0
    tokens_generated: int = 0
    tokens_served: int | None = None  # None until the first heartbeat after registering
    tokens_per_s: float = 0.0  # tokens generated through the node over the last interval
    layer_ms: float | None = None  # decode compute per layer it reported
    links: tuple[tuple[str, float], ...] = ()  # (next hop URL, round trip ms) it measured
    local: bool = False  # the tracker node itself: never expires
    quarantined: str | None = None  # why: replicas disagreed with it (docs/adr/0026)
    since: float = 0.0  # when it registered (a joining node's loading started then)
    # Its proof of id (docs/adr/0032): issued at its first registration, asked on every
    # later call; it dies with the record (a node that lost it waits for the record to expire).
    secret: str = ""
    slowdown: float = 1.0  # its compute measured against its claim (docs/adr/0032)
    prefix: tuple[int, int, int] = (0, 0, 0)  # prefix cache: blocks, lookups, hits (ADR-0035)
    # Its serving registration was confirmed by the tracker's call-back (or it is the
    # tracker node): only then do its signed rows and its layer count count (docs/adr/0032).
    called_back: bool = False
    source: str | None = None  # the address its registration came from

    @property
    def node_id(self) -> str:
        return self.announcement.node_id

    @property
    def shown_state(self) -> str:
        """Its state as the map shows it: ``quarantined`` outranks what the node says."""
        return "quarantined" if self.quarantined else self.state.value

    def signer(self) -> Signer:
        """It as the signer of evidence rows (``meshnet_common.trust.evidence``)."""
        announcement = self.announcement
        return Signer(
            secret=self.secret, called_back=self.called_back,
            serving=self.state == NodeState.SERVING and not self.quarantined,
            model_id=announcement.shard.model_id, precision=announcement.quantization.value,
            layers=announcement.shard.layers, hosts=machine_names(announcement.url, self.source),
            since=self.since,
        )  # fmt: skip

    def serving_node(self) -> ServingNode:
        shard = self.announcement.shard
        return ServingNode(
            node_id=self.node_id,
            url=self.announcement.url,
            model_id=shard.model_id,
            layers=shard.layers,
            load=self.active_sessions,
            state=self.shown_state,
            quantization=self.announcement.quantization.value,
            dtype=self.announcement.compute_dtype,
            quant_group_size=self.announcement.quant_group_size,
            layer_ms=self.layer_ms,
            links=self.links,
        )


class Registry:
    """Thread-safe map node_id -> NodeRecord with heartbeat expiry."""

    def __init__(
        self, heartbeat_interval_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.clock = clock
        self._nodes: dict[str, NodeRecord] = {}
        self.models = ModelTable()  # layer counts: the models dir's or called-back nodes'
        # Nodes dropped for missed heartbeats, and when: one may be restarting (ADR-0023).
        self._lost: dict[str, tuple[NodeRecord, float]] = {}
        # Verdicts against each node by reporter (docs/adr/0026: one reporter counts once),
        # and why the quarantined ones are: kept by node id and by URL across re-registration
        # (under a new id too), until an operator lifts them (docs/adr/0032).
        self._strikes: dict[str, dict[str, Verdict]] = {}
        self._quarantined: dict[str, str] = {}
        self._quarantined_urls: dict[str, str] = {}  # URL -> the node id quarantined there
        # The keys of removed and quarantined nodes: certified no more (docs/adr/0032).
        self.revocations = Revocations(clock)
        self.verdicts = 0  # verdicts received
        # What each head measured of the routes it used: reporter -> route URLs (after it) ->
        # (step ms, when reported); the latest per route, MAX_ROUTE_TIMES per reporter.
        self._route_times: dict[str, dict[tuple[str, ...], tuple[float, float]]] = {}
        self._lock = threading.Lock()
        # Told (kind, node id) after each change of its own making: "node" (registered or
        # heartbeat), "left", "verdicts" (a strike or a lift); the shared store's replica.
        self.on_change: Callable[[str, str], None] = lambda kind, node_id: None

    def authentic(self, node_id: str, proof: str | None) -> bool:
        """Whether ``proof`` is the secret of the live record ``node_id`` (constant time)."""
        record = self._nodes.get(node_id)
        return record is not None and _same(record.secret, proof)

    def secret_of(self, node_id: str) -> str | None:
        """The secret of the live record ``node_id`` (to check what it signed)."""
        record = self._nodes.get(node_id)
        return record.secret if record is not None else None

    def signer(self, node_id: str) -> Signer | None:
        """The live record ``node_id`` as the signer of evidence rows (None: no record)."""
        record = self._nodes.get(node_id)
        return record.signer() if record is not None else None

    def admit_source(
        self, source: str | None, node_id: str, model_id: str | None, *, max_nodes: int,
        max_models: int,
    ) -> None:  # fmt: skip
        """RateLimited when ``source`` already holds ``max_nodes`` live records other
        than ``node_id``, or introduced ``max_models`` models still in the table and
        ``model_id`` (a serving node's) would be another (docs/adr/0032)."""
        others = sum(
            1 for r in self._nodes.values()
            if r.source == source and r.node_id != node_id and not r.local
        )  # fmt: skip
        if others >= max_nodes:
            raise RateLimited(
                f"{source} already registered {others} live nodes (--max-nodes-per-source)",
                param="node_id", code="too_many_nodes",
            )  # fmt: skip
        introduced = self.models.introduced_by(source)
        if model_id is not None and model_id not in self.models.layers and introduced >= max_models:
            raise RateLimited(
                f"{source} already introduced {introduced} models the models dir does not "
                "list (--max-models-per-source)", param="shard", code="too_many_models",
            )  # fmt: skip

    def claim(self, node_id: str, proof: str | None) -> None:
        """Conflict unless ``node_id`` is free or ``proof`` is its live record's secret."""
        previous = self._nodes.get(node_id)
        if previous is not None and not _same(previous.secret, proof):
            raise Conflict(
                f"node id {node_id!r} is registered and alive; register it again with its "
                "node secret, or wait until its record expires after "
                f"{MISSED_HEARTBEATS} missed heartbeats",
                param="node_id", code="node_id_taken",
            )  # fmt: skip

    def register(
        self, announcement: NodeAnnouncement, *, local: bool = False, proof: str | None = None,
        called_back: bool = False, source: str | None = None,
    ) -> NodeRecord:  # fmt: skip
        """Record a registration. A live id registers again only with its secret
        (``proof``): anyone else gets Conflict until the record expires or leaves.
        ``called_back``: a serving registration the tracker confirmed by calling the node
        back; only such a node (or the tracker node) makes its model's layer count known.
        ``source``: the address the registration came from."""
        with self._lock:
            previous = self._nodes.get(announcement.node_id)
            if not local:
                self.claim(announcement.node_id, proof)
            quarantined = self._quarantined.get(announcement.node_id)
            if quarantined is None and announcement.url in self._quarantined_urls:
                was = self._quarantined_urls[announcement.url]
                quarantined = f"its address served {was!r}: {self._quarantined.get(was)}"
                self._quarantined[announcement.node_id] = quarantined
            if quarantined is None:  # certified anew (after a removal, say)
                self.revocations.lift(announcement.public_key)
            else:
                self.revocations.revoke(announcement.public_key)
            record = NodeRecord(
                announcement=announcement,
                state=announcement.state,
                last_heartbeat=self.clock(),
                memory_free_bytes=announcement.memory_free_bytes,
                local=local,
                quarantined=quarantined,
                secret=previous.secret if previous is not None else secrets.token_urlsafe(32),
                called_back=local or (called_back and announcement.state == NodeState.SERVING),
                source=source,
            )
            record.since = record.last_heartbeat
            if (
                previous is not None
                and previous.state == announcement.state
                and previous.announcement.shard == announcement.shard
            ):
                record.since = previous.since
            self._nodes[announcement.node_id] = record
            self._lost.pop(announcement.node_id, None)
            if record.called_back:
                shard = announcement.shard
                self.models.introduce(
                    shard.model_id, announcement.num_layers, source, record.last_heartbeat
                )
        self.on_change("node", announcement.node_id)
        logger.info(
            "node %s %s: %s layers %s at %s",
            announcement.node_id,
            "joining (loading)" if announcement.state == NodeState.JOINING else "registered",
            announcement.shard.model_id, announcement.shard.layers, announcement.url,
        )  # fmt: skip
        return record

    def heartbeat(self, beat: Heartbeat) -> bool:
        """Record a heartbeat; False when the node is unknown (it must register again)."""
        with self._lock:
            record = self._nodes.get(beat.node_id)
            if record is None:
                return False
            now = self.clock()
            elapsed = now - record.last_heartbeat
            if record.tokens_served is not None and elapsed > 0:
                served = max(0, beat.tokens_served - record.tokens_served)
                record.tokens_per_s = served / elapsed
            record.tokens_served = beat.tokens_served
            record.last_heartbeat = now
            # Serving is reached by registering (the tracker calls the node back), never
            # by a heartbeat of a node still joining (docs/adr/0032).
            if not (record.state == NodeState.JOINING and beat.state == NodeState.SERVING):
                record.state = beat.state
            record.active_sessions = beat.active_sessions
            record.kv_tokens = beat.kv_tokens
            record.memory_free_bytes = beat.memory_free_bytes
            record.tokens_generated = beat.tokens_generated
            record.prefix = (beat.prefix_blocks, beat.prefix_lookups, beat.prefix_hits)
            # Self-reported figures attract routes: kept within what hardware can do
            # (docs/adr/0032); routing cross-checks them against one another, and against
            # the step times heads measured (``coverage``).
            record.layer_ms = None if beat.layer_ms is None else _clamp(beat.layer_ms, LAYER_MS)
            record.links = tuple(sorted((u, _clamp(ms, LINK_MS)) for u, ms in beat.links.items()))
            mine = self._route_times.setdefault(beat.node_id, {})
            for measured in beat.route_times:  # one per route: the latest replaces it
                mine.pop(measured.hops, None)
                mine[measured.hops] = (measured.step_ms, now)
            while len(mine) > MAX_ROUTE_TIMES:  # the least recently reported go
                del mine[next(iter(mine))]
        self.on_change("node", beat.node_id)
        return True

    def strike(
        self, node_id: str, verdict: Verdict, *, quarantine_after: int, key: str | None = None
    ) -> tuple[int, bool]:
        """Count a verdict against ``node_id``, once per reporter; at ``quarantine_after``
        reporters it is quarantined (off the map's serving nodes, told so in its heartbeats),
        unless other serving nodes would not cover its layers without it: a verdict never
        takes a model down (docs/adr/0032). ``key`` (default: the reporter) is what counts
        once: the tracker's own audits count each. Returns (strikes, quarantined)."""
        with self._lock:
            strikes = self._strikes.setdefault(node_id, {})
            strikes[key or verdict.reporter] = verdict
            self.verdicts += 1
            quarantined = node_id in self._quarantined
            if not quarantined and len(strikes) >= quarantine_after:
                record = self._nodes.get(node_id)
                if record is not None and not self._covered_without(record):
                    logger.error(
                        "node %s: %d verdicts, but it is the only serving replica of its "
                        "layers: not quarantined (add a replica)", node_id, len(strikes),
                    )  # fmt: skip
                    return len(strikes), False
                reason = (
                    f"{len(strikes)} verdicts: its output for layers [{verdict.shard_start}, "
                    f"{verdict.shard_end}) lay {verdict.error:.3g} from "
                    f"{', '.join(verdict.witnesses)}'s (tolerance {verdict.tolerance:.3g})"
                )
                self._quarantined[node_id] = reason
                if record is not None:
                    record.quarantined = reason
                    self._quarantined_urls[record.announcement.url] = node_id
                    self.revocations.revoke(record.announcement.public_key)
                quarantined = True
                logger.error("node %s quarantined: %s", node_id, reason)
        self.on_change("verdicts", node_id)
        return len(strikes), quarantined

    def _covered_without(self, suspect: NodeRecord) -> bool:
        """Whether the other serving, unquarantined nodes of its model cover its layers."""
        shard = suspect.announcement.shard
        others = [
            r.announcement.shard.layers
            for r in self._nodes.values()
            if r is not suspect and r.state == NodeState.SERVING and not r.quarantined
            and r.announcement.shard.model_id == shard.model_id
        ]  # fmt: skip
        return _covers(others, shard.layers)

    def lift(self, node_id: str) -> bool:
        """End a quarantine (an operator fixed the node); False if it was not quarantined."""
        with self._lock:
            self._strikes.pop(node_id, None)
            lifted = self._quarantined.pop(node_id, None) is not None
            for url in [u for u, n in self._quarantined_urls.items() if n == node_id]:
                del self._quarantined_urls[url]
            record = self._nodes.get(node_id)
            if record is not None:
                record.quarantined = None
                self._quarantined_urls.pop(record.announcement.url, None)
                self.revocations.lift(record.announcement.public_key)
        if lifted:
            logger.warning("node %s: quarantine lifted", node_id)
        self.on_change("verdicts", node_id)
        return lifted

    def strikes(self, node_id: str) -> int:
        """Distinct reporters of verdicts against ``node_id``."""
        return len(self._strikes.get(node_id, ()))

    def remove(self, node_id: str) -> bool:
        with self._lock:
            record = self._nodes.pop(node_id, None)
            self._route_times.pop(node_id, None)
            if record is not None:  # its certificate ends now, not in 10 minutes
                self.revocations.revoke(record.announcement.public_key)
            if record is not None and record.state == NodeState.SERVING:
                self.models.held(record.announcement.shard.model_id, self.clock())
        removed = record is not None
        if removed:
            logger.info("node %s left", node_id)
            self.on_change("left", node_id)
        return removed

    def adopt(self, record: NodeRecord) -> None:
        """A record another tracker of the swarm wrote (``store.replica``): taken as is."""
        with self._lock:
            self._nodes[record.node_id] = record
            self._lost.pop(record.node_id, None)

    def drop(self, node_id: str) -> None:
        """Its lease ran out in the shared store: dropped as a silent node is (ADR-0023)."""
        with self._lock:
            record = self._nodes.get(node_id)
            if record is not None and not record.local:
                self._lost[node_id] = (self._nodes.pop(node_id), self.clock())
                self._route_times.pop(node_id, None)

    def verdicts_of(self, node_id: str) -> tuple[dict[str, Verdict], str | None, list[str]]:
        """The verdicts against ``node_id`` by key, why it is quarantined, its URLs held."""
        with self._lock:
            urls = [u for u, n in self._quarantined_urls.items() if n == node_id]
            return dict(self._strikes.get(node_id, {})), self._quarantined.get(node_id), urls

    def set_verdicts(
        self, node_id: str, strikes: dict[str, Verdict], reason: str | None, urls: list[str]
    ) -> None:
        """What another tracker counted against ``node_id`` (``verdicts_of`` there)."""
        if reason is None:
            self.lift(node_id)
        with self._lock:
            self._strikes[node_id] = strikes
            record = self._nodes.get(node_id)
            if reason is not None:
                self._quarantined[node_id] = reason
                self._quarantined_urls.update(dict.fromkeys(urls, node_id))
                if record is not None:
                    record.quarantined = reason
                    self.revocations.revoke(record.announcement.public_key)

    def forgive(self, seconds: float) -> None:
        """The tracker itself stalled for ``seconds``: heartbeats that arrived meanwhile may
        still wait unread, so no node is blamed for that time."""
        with self._lock:
            for record in self._nodes.values():
                record.last_heartbeat += seconds

    def prune(self) -> list[str]:
        """Drop nodes silent for MISSED_HEARTBEATS intervals; returns their ids."""
        deadline = self.clock() - MISSED_HEARTBEATS * self.heartbeat_interval_s
        with self._lock:
            dead = [
                nid for nid, r in self._nodes.items() if not r.local and r.last_heartbeat < deadline
            ]
            now = self.clock()
            for nid in dead:
                self._lost[nid] = (self._nodes.pop(nid), now)
                self._route_times.pop(nid, None)
            held = {
                r.announcement.shard.model_id for r in self._nodes.values()
                if r.state == NodeState.SERVING
            }  # fmt: skip
            forgotten = self.models.expire(held, now)
        for nid in dead:
            logger.warning("node %s missed %d heartbeats: dropped", nid, MISSED_HEARTBEATS)
        for model_id in forgotten:
            logger.info("model %s: held by no node for a while: forgotten", model_id)
        return dead

    def lost(self, within_s: float) -> list[NodeRecord]:
        """Nodes dropped for missed heartbeats in the last ``within_s`` seconds that have not
        registered again (a node that left on purpose is not among them)."""
        since = self.clock() - within_s
        with self._lock:
            for nid in [n for n, (_, when) in self._lost.items() if when < since]:
                del self._lost[nid]
            return [record for record, _ in self._lost.values()]

    def records(self) -> list[NodeRecord]:
        self.prune()
        with self._lock:
            return list(self._nodes.values())

    def get(self, node_id: str) -> NodeRecord | None:
        return self._nodes.get(node_id)

    def num_layers(self, model_id: str) -> int | None:
        """The layer count the tracker knows for ``model_id`` (None if unknown)."""
        return self.models.layers.get(model_id)

    def note_model(self, model_id: str, num_layers: int) -> None:
        """Make a model known (e.g. found in the models dir) even before any node serves it."""
        with self._lock:
            self.models.list_in_dir(model_id, num_layers)

    def forget_model(self, model_id: str) -> bool:
        """Forget a model no node holds (it left the models dir); False while nodes hold it."""
        with self._lock:
            self.models.unlist_from_dir(model_id)  # nodes may hold it on: then it expires
            if any(r.announcement.shard.model_id == model_id for r in self._nodes.values()):
                return False
            return self.models.forget(model_id)

    def coverage(self) -> dict[str, ModelCoverage]:
        """The map, each node's compute cross-checked against what heads measured."""
        records = self.records()
        with self._lock:
            layers = dict(self.models.layers)
            reports = route_reports(self._route_times, records, self.clock() - ROUTE_TIMES_S)
        coverage = build_coverage((r.serving_node() for r in records), layers)
        slowdowns = {
            model_id: measured_slowdowns(model, reports.get(model_id, ()))
            for model_id, model in coverage.items()
        }  # fmt: skip
        for record in records:
            slowdown = slowdowns.get(record.announcement.shard.model_id, {}).get(record.node_id)
            note_slowdown(record, slowdown or 1.0)
        return {m: with_slowdowns(model, slowdowns[m]) for m, model in coverage.items()}

    def measured(self, model_id: str) -> set[str]:
        """The nodes of ``model_id`` on some route a head timed lately (docs/adr/0032)."""
        records = self.records()
        with self._lock:
            since = self.clock() - ROUTE_TIMES_S
            reports = route_reports(self._route_times, records, since).get(model_id, ())
        return {node_id for report in reports for node_id in report.hops}


def _covers(ranges: list[LayerRange], want: LayerRange) -> bool:
    """Whether the union of ``ranges`` holds every layer of ``want``."""
    at = want.start
    for layers in sorted(ranges, key=lambda r: r.start):
        if layers.start > at:
            break
        at = max(at, layers.end)
        if at >= want.end:
            return True
    return at >= want.end

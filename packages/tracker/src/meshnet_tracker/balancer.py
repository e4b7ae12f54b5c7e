"""Assignment bookkeeping and rebalancing: the stateful shell around the pure placement policy.

Capacity that is on its way counts as coverage: assignments handed out but not yet serving
("pending"), and nodes that announced their range and are still loading it ("joining", until
``joining_ttl_s``). So simultaneous joins do not pile onto one gap, and a node still loading
is no gap to close. When a gap lasts ``move_grace_s`` (hysteresis: a node restarting or a
heartbeat late does not churn ranges), a redundant *movable* node — one the tracker placed,
or one started with ``--allow-rebalance`` — is sent LOAD_SHARD (new range) + DROP_SHARD (old
range) in its next heartbeat reply. A range given by hand is never moved. Moves are
rate-limited per node, logged with their reason and counted per model.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from meshnet_common.layers import LayerRange
from meshnet_common.memory import ModelCosts
from meshnet_common.precision import DEFAULT_GROUP_SIZE
from meshnet_common.protocol import (
    AssignRequest,
    Directive,
    DirectiveKind,
    NodeState,
    ShardSpec,
)
from meshnet_tracker.placement import (
    ModelView,
    MoveCandidate,
    NodeRequest,
    Placement,
    choose_move,
    place,
)
from meshnet_tracker.registry import Registry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pending:
    """An assignment (or move) handed out whose node is not serving it yet."""

    node_id: str
    model_id: str
    layers: LayerRange
    expires: float


class Balancer:
    """Hands out assignments and plans moves; thread-safe."""

    def __init__(
        self,
        registry: Registry,
        costs: dict[str, ModelCosts],
        demand: Counter,
        *,
        pending_ttl_s: float = 180.0,
        move_cooldown_s: float = 30.0,
        move_grace_s: float = 10.0,
        restart_grace_s: float = 60.0,
        joining_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.costs = costs
        self.demand = demand
        self.pending_ttl_s = pending_ttl_s
        self.move_cooldown_s = move_cooldown_s
        self.move_grace_s = move_grace_s
        self.restart_grace_s = max(restart_grace_s, move_grace_s)
        self.joining_ttl_s = joining_ttl_s
        self.clock = clock
        self._pending: dict[str, Pending] = {}
        self._directives: dict[str, list[Directive]] = {}
        self._last_move: dict[str, float] = {}
        self._gap_since: dict[str, float] = {}  # model -> when its (pending-aware) gap opened
        self.moves = 0
        self.move_counts: Counter = Counter()  # (model, reason) -> moves planned
        self.passes = 0  # plan_moves calls so far (``meshnet_rebalance_passes_total``)
        self._lock = threading.Lock()

    def _live_pending(self) -> list[Pending]:
        now = self.clock()
        for node_id in [n for n, p in self._pending.items() if p.expires < now]:
            del self._pending[node_id]
        return list(self._pending.values())

    def _serving_capacity(self) -> dict[str, list[int]]:
        coverage = self.registry.coverage()
        return {m: coverage[m].layer_counts() for m in self.costs if m in coverage}

    def _joining(self) -> dict[str, Pending]:
        """Nodes that announced a range and are loading it (not for longer than the TTL)."""
        now = self.clock()
        return {
            r.node_id: Pending(r.node_id, r.announcement.shard.model_id,
                               r.announcement.shard.layers, r.since + self.joining_ttl_s)
            for r in self.registry.records()
            if r.state == NodeState.JOINING and now - r.since < self.joining_ttl_s
        }  # fmt: skip

    def views(self) -> list[ModelView]:
        """Placement's view: serving capacity plus pending assignments and joining nodes."""
        capacity = self._serving_capacity()
        joining = self._joining()
        pending = [p for p in self._live_pending() if p.node_id not in joining]
        for entry in (*pending, *joining.values()):
            counts = capacity.get(entry.model_id)
            if counts is not None:
                for layer in entry.layers:
                    if layer < len(counts):
                        counts[layer] += 1
        return [
            ModelView(model_id, self.costs[model_id], tuple(counts), self.demand[model_id])
            for model_id, counts in sorted(capacity.items())
        ]

    def coverage_on_its_way(self, model_id: str) -> bool:
        """Whether every layer of ``model_id`` is held by a serving node or by capacity on its
        way (a pending assignment or move, a node still loading): a gap in the routes is then
        expected to heal, and requests wait for it (docs/adr/0023)."""
        with self._lock:
            view = next((v for v in self.views() if v.model_id == model_id), None)
        if view is None:
            return False
        counts = list(view.capacity)
        # A node lost to missed heartbeats may be restarting: requests wait for it for
        # restart_grace_s (a process restart on a loaded host takes tens of seconds before it
        # even announces its range), while moves wait only move_grace_s (a move costs a
        # shard download, and is itself coverage on its way).
        for record in self.registry.lost(self.restart_grace_s):
            if record.announcement.shard.model_id == model_id:
                for layer in record.announcement.shard.layers:
                    if layer < len(counts):
                        counts[layer] += 1
        return all(counts)

    def assign(self, request: AssignRequest) -> Placement:
        node_request = NodeRequest(
            memory_bytes=request.memory_bytes,
            precision=request.quantization,
            kv_tokens=request.kv_tokens,
            held_models=frozenset(request.held_models),
            dtype=request.dtype,
            group_size=request.quant_group_size,
        )
        with self._lock:
            placement = place(self.views(), node_request)
            self._pending[request.node_id] = Pending(
                request.node_id,
                placement.model_id,
                placement.layers,
                self.clock() + self.pending_ttl_s,
            )
        logger.info(
            "assigned %s -> %s layers %s (%s)",
            request.node_id, placement.model_id, placement.layers, placement.reason,
        )  # fmt: skip
        return placement

    def registered(self, node_id: str) -> None:
        """The node now serves what it was given: it counts as serving, not pending."""
        with self._lock:
            self._pending.pop(node_id, None)

    def peek_directives(self, node_id: str) -> tuple[Directive, ...]:
        with self._lock:
            return tuple(self._directives.get(node_id, ()))

    def directives_for(self, node_id: str) -> tuple[Directive, ...]:
        """Directives queued for ``node_id``; each is delivered once."""
        with self._lock:
            return tuple(self._directives.pop(node_id, ()))

    def take_directives(self) -> dict[str, list[Directive]]:
        """Every queued directive, taken: the leader hands them to the shared store."""
        with self._lock:
            taken, self._directives = self._directives, {}
            return taken

    def plan_moves(self) -> int:
        """Direct redundant movable nodes into gaps that outlasted the grace period; returns
        how many moves were planned."""
        planned = 0
        with self._lock:
            self.passes += 1
            serving = self._serving_capacity()
            busy = {p.node_id for p in self._live_pending()}  # expired moves free their node
            now = self.clock()
            records = self.registry.records()
            for view in self.views():
                if not view.gaps():
                    self._gap_since.pop(view.model_id, None)
                    continue
                opened = self._gap_since.setdefault(view.model_id, now)
                if now - opened < self.move_grace_s:
                    continue  # hysteresis: a gap that closes by itself moves nobody
                candidates = [
                    MoveCandidate(
                        r.node_id,
                        r.announcement.shard.layers,
                        NodeRequest(
                            r.announcement.memory_declared_bytes,
                            r.announcement.quantization,
                            r.announcement.kv_budget_tokens,
                            dtype=r.announcement.compute_dtype,
                            group_size=r.announcement.quant_group_size or DEFAULT_GROUP_SIZE,
                        ),
                        r.active_sessions,
                    )
                    for r in records
                    if r.announcement.shard.model_id == view.model_id
                    and not r.local
                    and r.announcement.movable
                    and r.state == NodeState.SERVING
                    and r.quarantined is None
                    and r.node_id not in busy
                    and now - self._last_move.get(r.node_id, -1e18) >= self.move_cooldown_s
                ]
                move = choose_move(view, serving[view.model_id], candidates)
                if move is None:
                    continue
                cand, layers = move
                self._directives[cand.node_id] = [
                    Directive(kind=DirectiveKind.LOAD_SHARD, shard=_spec(view.model_id, layers)),
                    Directive(
                        kind=DirectiveKind.DROP_SHARD, shard=_spec(view.model_id, cand.layers)
                    ),
                ]
                self._pending[cand.node_id] = Pending(
                    cand.node_id, view.model_id, layers, now + self.pending_ttl_s
                )
                self._last_move[cand.node_id] = now
                busy.add(cand.node_id)
                planned += 1
                self.moves += 1
                self.move_counts[(view.model_id, "gap")] += 1
                gap = view.gaps()[0]
                logger.info(
                    "move %s: %s %s -> %s (reason=gap: layers %s uncovered for %.0fs, no node "
                    "joining them; %s is redundant)",
                    cand.node_id, view.model_id, cand.layers, layers, gap, now - opened,
                    cand.layers,
                )  # fmt: skip
        return planned


def _spec(model_id: str, layers: LayerRange) -> ShardSpec:
    return ShardSpec(model_id=model_id, shard_start=layers.start, shard_end=layers.end)

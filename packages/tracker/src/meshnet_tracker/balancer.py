"""Assignment bookkeeping and rebalancing: the stateful shell around the pure placement policy.

Assignments handed out but not yet serving count as coverage ("pending"), so simultaneous
joins do not pile onto one gap. When a node leaves and opens a gap, a redundant node is sent
LOAD_SHARD (new range) + DROP_SHARD (old range) in its next heartbeat reply; moves are
rate-limited per node.
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
from meshnet_common.protocol import AssignRequest, Directive, DirectiveKind, ShardSpec
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.costs = costs
        self.demand = demand
        self.pending_ttl_s = pending_ttl_s
        self.move_cooldown_s = move_cooldown_s
        self.clock = clock
        self._pending: dict[str, Pending] = {}
        self._directives: dict[str, list[Directive]] = {}
        self._last_move: dict[str, float] = {}
        self.moves = 0
        self._lock = threading.Lock()

    def _live_pending(self) -> list[Pending]:
        now = self.clock()
        for node_id in [n for n, p in self._pending.items() if p.expires < now]:
            del self._pending[node_id]
        return list(self._pending.values())

    def _serving_capacity(self) -> dict[str, list[int]]:
        coverage = self.registry.coverage()
        return {m: coverage[m].layer_counts() for m in self.costs if m in coverage}

    def views(self) -> list[ModelView]:
        """Placement's view: serving capacity plus pending assignments."""
        capacity = self._serving_capacity()
        for pending in self._live_pending():
            counts = capacity.get(pending.model_id)
            if counts is not None:
                for layer in pending.layers:
                    counts[layer] += 1
        return [
            ModelView(model_id, self.costs[model_id], tuple(counts), self.demand[model_id])
            for model_id, counts in sorted(capacity.items())
        ]

    def assign(self, request: AssignRequest) -> Placement:
        node_request = NodeRequest(
            memory_bytes=request.memory_bytes,
            precision=request.quantization,
            kv_tokens=request.kv_tokens,
            held_models=frozenset(request.held_models),
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

    def plan_moves(self) -> int:
        """Direct redundant nodes into gaps; returns how many moves were planned."""
        planned = 0
        with self._lock:
            serving = self._serving_capacity()
            busy = {p.node_id for p in self._live_pending()}  # expired moves free their node
            now = self.clock()
            records = self.registry.records()
            for view in self.views():
                candidates = [
                    MoveCandidate(
                        r.node_id,
                        r.announcement.shard.layers,
                        NodeRequest(
                            r.announcement.memory_declared_bytes,
                            r.announcement.quantization,
                            r.announcement.kv_budget_tokens,
                        ),
                        r.active_sessions,
                    )
                    for r in records
                    if r.announcement.shard.model_id == view.model_id
                    and not r.local
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
                logger.info(
                    "move %s: %s %s -> %s to close a gap",
                    cand.node_id, view.model_id, cand.layers, layers,
                )  # fmt: skip
        return planned


def _spec(model_id: str, layers: LayerRange) -> ShardSpec:
    return ShardSpec(model_id=model_id, shard_start=layers.start, shard_end=layers.end)

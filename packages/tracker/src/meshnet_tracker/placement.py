"""Coverage-first, memory-aware assignment: a pure function of (swarm view, node request).

1. Coverage first: while a model has a gap, the node fills one — the largest run of uncovered
   layers it can hold, anchored at the start of the gap (so chains stay short). Models closest
   to being fully covered go first, then models the node already holds, then busier models.
2. Redundancy: otherwise the node joins the model whose weakest layer (lowest per-layer
   serving capacity) is weakest, over a window holding as many of those layers as it can.
3. A node that cannot hold even one layer of any model is refused.

A node asks for a quantization (``auto`` included), a compute dtype and an int4 group size;
each model resolves them with its own shipped format (``resolve_precision``) and prices its
layers at the result. A model the node cannot serve at all (fp8 asked of a plain checkpoint,
nf4 of an MoE) is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshnet_common.config import defaults
from meshnet_common.errors import InsufficientMemory, InvalidRequest
from meshnet_common.layers import LayerRange
from meshnet_common.memory import ModelCosts
from meshnet_common.precision import (
    DEFAULT_GROUP_SIZE,
    Precision,
    compute_dtype_name,
    describe_precision,
    resolve_precision,
)


@dataclass(frozen=True)
class NodeRequest:
    """What a joining node offers. ``precision`` is what it asks for: a ``Precision``, or
    ``"auto"`` (each model's shipped format, else the compute dtype); ``dtype`` its compute
    dtype, ``group_size`` its int4 group size."""

    memory_bytes: int
    precision: Precision | str = Precision.BFLOAT16
    kv_tokens: int = defaults.KV_BUDGET_TOKENS
    held_models: frozenset[str] = frozenset()
    dtype: str = "bfloat16"
    group_size: int = DEFAULT_GROUP_SIZE

    def resolved(self, costs: ModelCosts) -> Precision | None:
        """The precision this node would serve the model at; None: it cannot serve it."""
        try:
            precision = resolve_precision(str(self.precision), self.dtype, costs.native)
        except InvalidRequest:
            return None
        return None if costs.refusal(precision) is not None else precision

    def refusal(self, costs: ModelCosts) -> str | None:
        """Why this node cannot serve the model at all (None: it can)."""
        try:
            precision = resolve_precision(str(self.precision), self.dtype, costs.native)
        except InvalidRequest as exc:  # fp8 / mxfp4 asked of a model that does not ship it
            asked = str(self.precision)
            native = asked in (Precision.FP8, Precision.MXFP4)
            return (native and costs.refusal(Precision(asked))) or exc.message
        return costs.refusal(precision)

    def shard_bytes(self, costs: ModelCosts, layers: LayerRange) -> int | None:
        """What ``layers`` need on this node (None: it cannot serve the model)."""
        precision = self.resolved(costs)
        if precision is None:
            return None
        return costs.shard_bytes(
            layers, precision, self.kv_tokens,
            dtype=compute_dtype_name(precision, self.dtype, gguf=costs.gguf),
            group_size=self.group_size,
        )  # fmt: skip

    def max_layers_from(self, costs: ModelCosts, start: int, limit: int) -> int:
        """Most layers from ``start`` (at most ``limit``) this node holds of the model."""
        precision = self.resolved(costs)
        if precision is None:
            return 0
        return costs.max_layers_from(
            start, limit, self.memory_bytes, precision, self.kv_tokens,
            dtype=compute_dtype_name(precision, self.dtype, gguf=costs.gguf),
            group_size=self.group_size,
        )  # fmt: skip

    def describe(self) -> str:
        return describe_precision(str(self.precision), self.dtype, self.group_size)


@dataclass(frozen=True)
class ModelView:
    """One model as placement sees it: costs and per-layer capacity (serving + pending)."""

    model_id: str
    costs: ModelCosts
    capacity: tuple[int, ...]
    demand: int = 0

    def gaps(self) -> list[LayerRange]:
        gaps, start = [], None
        for layer, count in enumerate(self.capacity):
            if count == 0 and start is None:
                start = layer
            elif count and start is not None:
                gaps.append(LayerRange(start, layer))
                start = None
        if start is not None:
            gaps.append(LayerRange(start, len(self.capacity)))
        return gaps


@dataclass(frozen=True)
class Placement:
    """Where a node should go, and why."""

    model_id: str
    layers: LayerRange
    reason: str  # "gap" | "redundancy"
    # The precision the node serves it at (its request resolved for this model).
    precision: Precision | None = field(default=None, compare=False)


def _fit(view: ModelView, request: NodeRequest, start: int, limit: int) -> int:
    return request.max_layers_from(view.costs, start, limit)


def fill_gap(view: ModelView, request: NodeRequest) -> LayerRange | None:
    """The best range inside one of the model's gaps, or None if the node fits none."""
    best: tuple[int, int] | None = None  # (layers, start)
    for gap in view.gaps():
        k = _fit(view, request, gap.start, len(gap))
        start = gap.start
        if k == 0:
            # The gap's first layer is too big (e.g. embeddings): take the largest piece.
            for s in range(gap.start + 1, gap.end):
                k = _fit(view, request, s, gap.end - s)
                if k:
                    start = s
                    break
        if k and (best is None or k > best[0]):
            best = (k, start)
    return None if best is None else LayerRange(best[1], best[1] + best[0])


def add_redundancy(view: ModelView, request: NodeRequest) -> LayerRange | None:
    """A window over the model's weakest layers, as wide as the node can hold.

    In each run of weakest layers the window starts at the first layer the node fits from
    (the run's head may carry embeddings it cannot hold). If it fits no weakest layer, it
    goes where capacity is lowest among the layers it can hold.
    """
    capacity = view.capacity
    weakest = min(capacity)
    best: tuple[int, int, int] | None = None  # (-weak layers covered, start, k)
    run_placed = False
    for start in range(len(capacity)):
        if capacity[start] != weakest:
            run_placed = False
            continue
        if run_placed:
            continue
        k = _fit(view, request, start, len(capacity) - start)
        if not k:
            continue
        run_placed = True
        covered = sum(1 for c in capacity[start : start + k] if c == weakest)
        if best is None or (-covered, start) < best[:2]:
            best = (-covered, start, k)
    if best is not None:
        return LayerRange(best[1], best[1] + best[2])
    fallback: tuple[int, int, int] | None = None  # (capacity at start, start, k)
    for start in range(len(capacity)):
        k = _fit(view, request, start, len(capacity) - start)
        if k and (fallback is None or (capacity[start], start) < fallback[:2]):
            fallback = (capacity[start], start, k)
    return None if fallback is None else LayerRange(fallback[1], fallback[1] + fallback[2])


def place(views: Sequence[ModelView], request: NodeRequest) -> Placement:
    """Deterministic placement of one node; InsufficientMemory if it fits nowhere."""
    refused = {v.model_id: why for v in views if (why := request.refusal(v.costs))}
    views = [v for v in views if v.model_id not in refused]
    with_gaps = [v for v in views if 0 in v.capacity]
    with_gaps.sort(
        key=lambda v: (
            -sum(1 for c in v.capacity if c) / len(v.capacity),
            v.model_id not in request.held_models,
            -v.demand,
            v.model_id,
        )
    )
    for view in with_gaps:
        layers = fill_gap(view, request)
        if layers is not None:
            return Placement(view.model_id, layers, "gap", request.resolved(view.costs))
    others = sorted(
        (v for v in views if 0 not in v.capacity),
        key=lambda v: (
            min(v.capacity),
            v.model_id not in request.held_models,
            -v.demand,
            v.model_id,
        ),
    )
    for view in others:
        layers = add_redundancy(view, request)
        if layers is not None:
            return Placement(view.model_id, layers, "redundancy", request.resolved(view.costs))
    why = f" ({_refusals(refused)})" if refused else ""
    if refused and not views:
        raise InsufficientMemory(
            f"no model this tracker serves can be served at {request.describe()}{why}",
            code="node_too_small",
        )
    raise InsufficientMemory(
        f"{request.memory_bytes / 2**30:.2f} GiB at {request.describe()} cannot hold even "
        f"one layer of any model this tracker serves{why}",
        code="node_too_small",
    )


def _refusals(refused: dict[str, str], shown: int = 3) -> str:
    """Models refused, grouped by reason: ``a, b and 4 more: reason; c: other reason``."""
    by_reason: dict[str, list[str]] = {}
    for model_id, reason in refused.items():
        by_reason.setdefault(reason, []).append(model_id)
    parts = []
    for reason, models in by_reason.items():
        names = ", ".join(models[:shown])
        if len(models) > shown:
            names += f" and {len(models) - shown} more"
        parts.append(f"{names}: {reason}")
    return "; ".join(parts)


@dataclass(frozen=True)
class MoveCandidate:
    """A serving node the tracker could redirect into a gap."""

    node_id: str
    layers: LayerRange
    request: NodeRequest
    load: int = 0


def choose_move(
    view: ModelView, serving_capacity: Sequence[int], candidates: Sequence[MoveCandidate]
) -> tuple[MoveCandidate, LayerRange] | None:
    """Pick a redundant node to move into the model's first gap, or None.

    Only gap-closing moves are made (hysteresis: the minimum per-layer capacity goes from 0
    to at least 1), and only nodes whose every layer another node also serves may move, so a
    move never opens a new gap.
    """
    gaps = view.gaps()
    if not gaps:
        return None
    gap = gaps[0]
    best: tuple[tuple, MoveCandidate, LayerRange] | None = None
    for cand in candidates:
        if any(serving_capacity[layer] < 2 for layer in cand.layers):
            continue  # its layers are not all covered by others: moving it opens a gap
        k = cand.request.max_layers_from(view.costs, gap.start, len(gap))
        if not k:
            continue
        key = (-k, cand.load, cand.node_id)
        if best is None or key < best[0]:
            best = (key, cand, LayerRange(gap.start, gap.start + k))
    return None if best is None else (best[1], best[2])

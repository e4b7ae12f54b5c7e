"""Route choice: a pure function from a coverage snapshot to a chain of hops.

A route covers ``[0, num_layers)`` contiguously. Ranges may overlap: each hop starts at the
layer where the previous one ended (a node can be entered mid-shard). Among valid chains we
prefer fewer hops, then less total load, then node ids (so the choice is deterministic).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import dataclass

from meshnet_common.errors import ModelNotCovered
from meshnet_tracker.coverage import ModelCoverage, ServingNode, describe_gaps


@dataclass(frozen=True)
class Hop:
    """One node of a route and the layer it starts at for this route."""

    node: ServingNode
    start_layer: int


def choose_route(
    model: ModelCoverage,
    *,
    head: str | None = None,
    exclude: Collection[str] = (),
) -> list[Hop]:
    """Shortest, least-loaded chain over the serving nodes; ModelNotCovered if none exists.

    ``head`` forces the first hop (the node that will drive generation).
    """
    nodes = [n for n in model.serving if n.node_id not in exclude]
    if head is not None and not any(n.node_id == head and n.layers.start == 0 for n in nodes):
        raise ModelNotCovered(f"node {head} does not serve the first layers of {model.model_id}")
    target = model.num_layers
    # Dijkstra over layer positions; cost = (hops, load, node ids along the way).
    best: dict[int, tuple] = {0: (0, 0, ())}
    queue: list[tuple] = [(0, 0, (), 0, ())]
    while queue:
        hops, load, ids, position, path = heapq.heappop(queue)
        if position == target:
            return [Hop(node, start) for node, start in path]
        if best.get(position, (hops, load, ids)) < (hops, load, ids):
            continue
        for node in nodes:
            if not node.layers.start <= position < node.layers.end:
                continue
            if position == 0 and head is not None and node.node_id != head:
                continue
            end = min(node.layers.end, target)
            cost = (hops + 1, load + node.load, ids + (node.node_id,))
            if end not in best or cost < best[end]:
                best[end] = cost
                heapq.heappush(queue, (*cost, end, path + ((node, position),)))
    gaps = model.gaps()
    if gaps:
        raise ModelNotCovered(
            f"model {model.model_id} is not fully covered; missing layers: {describe_gaps(gaps)}",
            code="model_not_covered",
        )
    avoided = sorted(n.node_id for n in model.serving if n.node_id in exclude)
    if avoided:
        raise ModelNotCovered(
            f"no chain of serving nodes covers {model.model_id} without the failed "
            f"node(s) {', '.join(avoided)}",
            code="model_not_covered",
        )
    raise ModelNotCovered(f"no chain of serving nodes covers {model.model_id}")

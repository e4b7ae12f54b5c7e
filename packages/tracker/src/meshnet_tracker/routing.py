"""Route choice: a pure function from a coverage snapshot to a chain of hops.

A route covers ``[0, num_layers)`` contiguously. Ranges may overlap: each hop starts at the
layer where the previous one ended (a node can be entered mid-shard). Among valid chains we
prefer the shortest expected step time, then fewer hops, then less total load, then node
ids (so the choice is deterministic).

The expected step time (docs/adr/0021) adds up each hop's compute for the layers it runs
(its reported decode milliseconds per layer) and the round trip of each link from one hop
to the next (as the sending node measured it). What no node reported is estimated: a
node's compute as the model's median, a link as the median of the measured ones, or
``DEFAULT_LINK_MS`` when none was. With no measurement at all every hop costs the same, so
the fewest hops win, as before.

What nodes claim is cross-checked against what heads measure (docs/adr/0032,
``measured_slowdowns``): a node's compute counts as claimed times its measured slowdown.

Prefix affinity (docs/adr/0035): requests that start alike go down the chain that computed
the first of them, where that chain's hops keep the prompt's blocks.

The tracker does not tokenize, so it cannot name blocks; it names a request's *prefix*: the
client's ``prompt_cache_key`` where it gives one (OpenAI's routing hint), else the start of
the prompt (a chat's first two messages: its system prompt and first question, which every
later turn repeats; a completion's first 2048 characters or 512 token ids), with the model,
the ``cache_salt`` and the client's tenant (its API key's digest). The chain a prefix went
down last is preferred while all of its nodes still serve the same layers; otherwise routing
is as before. The head still agrees with
its hops on the blocks they hold (``meshnet_node.caching.api``): a stale preference costs
a prefill, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import statistics
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace

from meshnet_common.errors import ModelNotCovered
from meshnet_tracker.coverage import ModelCoverage, ServingNode, describe_gaps

logger = logging.getLogger(__name__)
SLOW_LOGGED = 2.0  # a measured slowdown from this on is logged

DEFAULT_LINK_MS = 1.0  # a link nobody measured, when no link of the model was measured
SWITCH_GAIN = 0.10  # hysteresis: a new route must be this much faster (and 0.5 ms) to win
SWITCH_MIN_MS = 0.5
# The most a node's reported compute may undercut the model's median (a GPU among CPUs is
# 10-30x faster); below that its claim counts for no more (docs/adr/0032).
MAX_SPEEDUP = 32.0
# A route measured within this factor of the normal ratio (measured / predicted step time)
# shows each of its nodes as claimed: load and noise move a route's time that much.
MEASURED_TOLERANCE = 1.5
MAX_SLOWDOWN = 1000.0


@dataclass(frozen=True)
class Hop:
    """One node of a route and the layer it starts at for this route."""

    node: ServingNode
    start_layer: int


class StepEstimate:
    """Expected step time of hops over one model's serving nodes (measured or estimated).

    Every figure is what a node says of itself, so none may make it look faster than the
    evidence (docs/adr/0032): a node's compute counts as at least the model's median over
    ``MAX_SPEEDUP``, and a link as at least what the other end measured of the way back;
    and a node's compute counts times its measured slowdown, unless ``as_claimed`` (what
    the nodes claim, which measurements are held against)."""

    def __init__(self, nodes: Collection[ServingNode], *, as_claimed: bool = False) -> None:
        self.as_claimed = as_claimed
        computes = [n.layer_ms for n in nodes if n.layer_ms is not None]
        self.compute_default = statistics.median(computes) if computes else 0.0
        self.compute_floor = self.compute_default / MAX_SPEEDUP
        links = [ms for n in nodes for _, ms in n.links]
        self.link_default = statistics.median(links) if links else DEFAULT_LINK_MS
        self._links = {(n.url, url): ms for n in nodes for url, ms in n.links}

    def compute_ms(self, node: ServingNode) -> float:
        if node.layer_ms is None:
            claimed = self.compute_default
        else:
            claimed = max(node.layer_ms, self.compute_floor)
        return claimed if self.as_claimed else claimed * node.slowdown

    def link_ms(self, previous: ServingNode, node: ServingNode) -> float:
        claimed = self._links.get((previous.url, node.url))
        back = self._links.get((node.url, previous.url))  # measured by the other end
        if claimed is None:
            return self.link_default if back is None else back
        return claimed if back is None else max(claimed, back)

    def hop_ms(self, previous: ServingNode | None, node: ServingNode, layers: int) -> float:
        link = 0.0 if previous is None else self.link_ms(previous, node)
        return self.compute_ms(node) * layers + link

    def route_ms(self, route: list[Hop], num_layers: int) -> float:
        total, previous = 0.0, None
        for i, hop in enumerate(route):
            end = route[i + 1].start_layer if i + 1 < len(route) else num_layers
            total += self.hop_ms(previous, hop.node, end - hop.start_layer)
            previous = hop.node
        return total


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
        raise ModelNotCovered(
            f"node {head} does not serve the first layers of {model.model_id}", code="not_head"
        )
    target = model.num_layers
    estimate = StepEstimate(model.serving)
    # Dijkstra over (layer position, last node): a link's cost depends on the hop before.
    # cost = (expected ms, hops, load, node ids along the way).
    start = (0.0, 0, 0, ())
    best: dict[tuple[int, str | None], tuple] = {(0, None): start}
    queue: list[tuple] = [(*start, 0, None, ())]
    by_id = {n.node_id: n for n in nodes}
    while queue:
        ms, hops, load, ids, position, last, path = heapq.heappop(queue)
        if position == target:
            return [Hop(by_id[node_id], at) for node_id, at in path]
        if best.get((position, last), (ms, hops, load, ids)) < (ms, hops, load, ids):
            continue
        previous = by_id.get(last) if last is not None else None
        for node in nodes:
            if not node.layers.start <= position < node.layers.end:
                continue
            if position == 0 and head is not None and node.node_id != head:
                continue
            end = min(node.layers.end, target)
            cost = (
                ms + estimate.hop_ms(previous, node, end - position),
                hops + 1, load + node.load, ids + (node.node_id,),
            )  # fmt: skip
            state = (end, node.node_id)
            if state not in best or cost < best[state]:
                best[state] = cost
                heapq.heappush(
                    queue, (*cost, end, node.node_id, path + ((node.node_id, position),))
                )
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


def renew(model: ModelCoverage, chain, exclude=frozenset()) -> list[Hop] | None:
    """Today's view of a chain, given as (node id, layers, start layer) per hop: None when
    one of its nodes no longer serves the same layers, or is to be avoided."""
    if not chain:
        return None
    current = {n.node_id: n for n in model.serving}
    renewed = []
    for node_id, layers, start in chain:
        node = current.get(node_id)
        if node is None or node.layers != layers or node_id in exclude:
            return None
        renewed.append(Hop(node, start))
    return renewed


def keep_or_switch(
    model: ModelCoverage, previous: list[Hop] | None, chosen: list[Hop]
) -> list[Hop]:
    """Hysteresis: the route a head used last stays while it is still valid, the new best
    is not faster by ``SWITCH_GAIN`` and ``SWITCH_MIN_MS``, and it carries no more load, so
    that routes do not flap with every measurement's noise (while sessions still spread
    over equally fast replicas)."""
    if not previous or [h.node.node_id for h in previous] == [h.node.node_id for h in chosen]:
        return chosen
    renewed = renew(model, tuple((h.node.node_id, h.node.layers, h.start_layer) for h in previous))
    if renewed is None:
        return chosen
    estimate = StepEstimate(model.serving)
    old_ms = estimate.route_ms(renewed, model.num_layers)
    new_ms = estimate.route_ms(chosen, model.num_layers)
    faster = new_ms < old_ms * (1 - SWITCH_GAIN) and old_ms - new_ms >= SWITCH_MIN_MS
    lighter = sum(h.node.load for h in chosen) < sum(h.node.load for h in renewed)
    close = old_ms <= new_ms * (1 + SWITCH_GAIN) + SWITCH_MIN_MS
    return renewed if close and not faster and not lighter else chosen


@dataclass(frozen=True)
class RouteReport:
    """A head's measured decode step over a route (``RouteTime``), its hops as node ids."""

    reporter: str  # the head's node id
    hops: tuple[str, ...]  # the head first
    step_ms: float


@dataclass(frozen=True)
class _Measured:
    reporter: str
    step_ms: float
    predicted_ms: float  # from the claims
    shares: dict[str, float]  # node id -> its claimed compute on this route, ms


def measured_slowdowns(model: ModelCoverage, reports: Iterable[RouteReport]) -> dict[str, float]:
    """Node id -> how much slower than it claims its compute measured, for nodes over 1.

    Each report's *ratio* is its measured step time over the time the claims predict
    (``StepEstimate(as_claimed=True)``). The *normal ratio* is the median over nodes of
    each node's least ratio: the overhead every route pays (HTTP, sampling), not counted
    against anyone. A route within ``MEASURED_TOLERANCE`` of the normal ratio shows its
    nodes as claimed; beyond it, a node's slowdown on that route is the factor its own
    compute would need for it alone to explain the route's excess. A node's slowdown is its
    least over the reports that include it, so one route measured normal clears it (a
    reporter cannot slander a node others see as normal). A head's own reports count for it
    only when no other reporter's include it (it cannot vouch for itself against them).
    Reports whose hops do not chain ``[0, num_layers)`` over serving nodes are ignored."""
    estimate = StepEstimate(model.serving, as_claimed=True)
    by_id = {n.node_id: n for n in model.serving}
    seen: list[_Measured] = []
    for report in reports:
        route = _route_of(report.hops, by_id, model.num_layers)
        if route is None:
            continue
        shares = {}
        for i, hop in enumerate(route):
            end = route[i + 1].start_layer if i + 1 < len(route) else model.num_layers
            shares[hop.node.node_id] = estimate.compute_ms(hop.node) * (end - hop.start_layer)
        predicted = estimate.route_ms(route, model.num_layers)
        if predicted > 0:
            seen.append(_Measured(report.reporter, report.step_ms, predicted, shares))
    witnesses: dict[str, list[_Measured]] = {}
    for node_id in {n for m in seen for n in m.shares}:
        about = [m for m in seen if node_id in m.shares]
        witnesses[node_id] = [m for m in about if m.reporter != node_id] or about
    if not witnesses:
        return {}
    normal = statistics.median(
        min(m.step_ms / m.predicted_ms for m in found) for found in witnesses.values()
    )

    def slowdown_on(m: _Measured, node_id: str) -> float:
        share = m.shares[node_id]
        if m.step_ms <= MEASURED_TOLERANCE * normal * m.predicted_ms or share <= 0:
            return 1.0
        return 1.0 + (m.step_ms / normal - m.predicted_ms) / share

    slowdowns = {}
    for node_id, found in witnesses.items():
        slowdown = min(slowdown_on(m, node_id) for m in found)
        if slowdown > 1.0:
            slowdowns[node_id] = min(slowdown, MAX_SLOWDOWN)
    return slowdowns


def route_reports(route_times: dict, records: list, since: float) -> dict[str, list[RouteReport]]:
    """Model id -> the recent route times of live heads (``route_times``: reporter -> route
    URLs -> (step ms, when), the registry's), their URLs as node ids (a URL no record
    announced is the tracker node's, which heads reach at the tracker's own address).
    Drops those reported before ``since``. ``records``: the registry's live records."""
    live = {r.node_id: r for r in records}
    reports: dict[str, list[RouteReport]] = {}
    for reporter, routes in route_times.items():
        for expired in [urls for urls, (_, when) in routes.items() if when < since]:
            del routes[expired]
        head = live.get(reporter)
        if head is None or not routes:
            continue
        model_id = head.announcement.shard.model_id
        mine = [r for r in records if r.announcement.shard.model_id == model_id]
        ids = {r.announcement.url: r.node_id for r in mine}
        local = next((r.node_id for r in mine if r.local), None)
        for urls, (step_ms, _) in routes.items():
            hops = [ids.get(url, local) for url in urls]
            if None not in hops:
                report = RouteReport(reporter, (reporter, *hops), step_ms)
                reports.setdefault(model_id, []).append(report)
    return reports


def note_slowdown(record, slowdown: float) -> None:
    """Set a registry record's measured ``slowdown``, logging when it crosses SLOW_LOGGED."""
    was, record.slowdown = record.slowdown, slowdown
    if slowdown >= SLOW_LOGGED > was:
        logger.warning(
            "node %s: its decode compute measured %.1fx slower than it reports; routes "
            "count it so", record.node_id, slowdown,
        )  # fmt: skip
    elif was >= SLOW_LOGGED > slowdown:
        logger.info("node %s: its compute measures as it reports again", record.node_id)


def with_slowdowns(model: ModelCoverage, slowdowns: dict[str, float]) -> ModelCoverage:
    """``model`` with each node's measured slowdown set (1 where none was measured)."""
    if not slowdowns:
        return model
    nodes = tuple(replace(n, slowdown=slowdowns.get(n.node_id, 1.0)) for n in model.nodes)
    return replace(model, nodes=nodes)


def _route_of(
    hops: tuple[str, ...], by_id: dict[str, ServingNode], num_layers: int
) -> list[Hop] | None:
    """The route of these node ids, each entered where the one before ends; None unless
    they chain ``[0, num_layers)``."""
    route, position = [], 0
    for node_id in hops:
        node = by_id.get(node_id)
        if node is None or not node.layers.start <= position < node.layers.end:
            return None
        route.append(Hop(node, position))
        position = min(node.layers.end, num_layers)
    return route if route and position == num_layers else None


# -- prefix affinity (docs/adr/0035) ---------------------------------------------------

MAX_PREFIXES = 4096  # prefixes remembered, least recently used forgotten first
PROMPT_CHARS = 2048
PROMPT_IDS = 512


def prefix_key(model_id: str, payload: dict, tenant: str | None = None) -> str | None:
    """The name of a request's prefix (None: nothing to go by); ``tenant``'s own, as the
    heads' blocks are (``web.auth.tenant_of``)."""
    salt = payload.get("cache_salt")
    key = payload.get("prompt_cache_key")
    if isinstance(key, str) and key:
        start: object = ["key", key]
    elif isinstance(messages := payload.get("messages"), list) and messages:
        start = ["chat", messages[:2]]
    elif isinstance(prompt := payload.get("prompt"), str):
        start = ["text", prompt[:PROMPT_CHARS]]
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
        start = ["ids", prompt[:PROMPT_IDS]]
    else:  # several prompts in one request, or nothing usable
        return None
    try:
        text = json.dumps([model_id, tenant, salt, start], sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class PrefixAffinity:
    """The chain each recent prefix went down: (node id, layers, start layer) per hop, the
    head first."""

    def __init__(self, size: int = MAX_PREFIXES) -> None:
        self.size = size
        self._chains: OrderedDict[str, tuple] = OrderedDict()

    def chain(self, key: str | None) -> tuple | None:
        if key is None or key not in self._chains:
            return None
        self._chains.move_to_end(key)
        return self._chains[key]

    def remember(self, key: str | None, chain: tuple) -> None:
        if key is None:
            return
        self._chains[key] = chain
        self._chains.move_to_end(key)
        while len(self._chains) > self.size:
            self._chains.popitem(last=False)

"""Route choice over made-up swarms: exact and overlapping chains, preferences, properties."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_common.errors import ModelNotCovered
from meshnet_common.layers import LayerRange
from meshnet_tracker.coverage import ModelCoverage, ServingNode
from meshnet_tracker.routing import Hop, choose_route, keep_or_switch

MODEL = "org/model"


def node(node_id: str, start: int, end: int, *, load: int = 0, state: str = "serving"):
    return ServingNode(
        node_id=node_id,
        url=f"http://{node_id}.test:8000",
        model_id=MODEL,
        layers=LayerRange(start, end),
        load=load,
        state=state,
    )


def swarm(num_layers: int, *nodes: ServingNode) -> ModelCoverage:
    return ModelCoverage(MODEL, num_layers, tuple(nodes))


def summary(route: list[Hop]) -> list[tuple[str, int]]:
    return [(hop.node.node_id, hop.start_layer) for hop in route]


# -- examples ------------------------------------------------------------------------------


def test_exact_boundary_chain():
    model = swarm(6, node("c", 4, 6), node("a", 0, 2), node("b", 2, 4))
    assert summary(choose_route(model)) == [("a", 0), ("b", 2), ("c", 4)]


def test_single_node_covering_everything():
    model = swarm(6, node("solo", 0, 6))
    assert summary(choose_route(model)) == [("solo", 0)]


def test_overlapping_hops_start_where_the_previous_ended():
    model = swarm(6, node("a", 0, 4), node("b", 2, 6))
    assert summary(choose_route(model)) == [("a", 0), ("b", 4)]
    model = swarm(10, node("a", 0, 3), node("b", 1, 7), node("c", 5, 10))
    assert summary(choose_route(model)) == [("a", 0), ("b", 3), ("c", 7)]


def test_fewer_hops_beat_lower_load():
    model = swarm(6, node("busy", 0, 6, load=50), node("a", 0, 3), node("b", 3, 6))
    assert summary(choose_route(model)) == [("busy", 0)]


def test_lower_load_among_equally_short_chains():
    model = swarm(6, node("a", 0, 6, load=3), node("b", 0, 6, load=1), node("c", 0, 6, load=2))
    assert summary(choose_route(model)) == [("b", 0)]
    model = swarm(
        6,
        node("h1", 0, 3, load=1), node("h2", 0, 4, load=2),
        node("t1", 3, 6, load=5), node("t2", 4, 6, load=0), node("t3", 2, 6, load=3),
    )  # fmt: skip
    # Total loads: h1+t1 = 6, h2+t2 = 2, h1+t3 = 4, h2+t3 = 5.
    assert summary(choose_route(model)) == [("h2", 0), ("t2", 4)]


def test_ties_break_on_node_ids():
    model = swarm(4, node("zeta", 0, 4), node("alpha", 0, 4), node("mid", 0, 4))
    assert summary(choose_route(model)) == [("alpha", 0)]


def test_only_serving_nodes_are_used():
    model = swarm(4, node("leaving", 0, 4, state="leaving"), node("a", 0, 2), node("b", 2, 4))
    assert summary(choose_route(model)) == [("a", 0), ("b", 2)]
    joining = swarm(4, node("j", 0, 4, state="joining"))
    with pytest.raises(ModelNotCovered, match=r"\[0, 4\)"):
        choose_route(joining)


def test_head_forces_the_first_hop():
    model = swarm(6, node("whole", 0, 6), node("head", 0, 2), node("rest", 2, 6))
    assert summary(choose_route(model)) == [("whole", 0)]
    assert summary(choose_route(model, head="head")) == [("head", 0), ("rest", 2)]
    # The forced head may be used even when it could be skipped, and may be the whole chain.
    assert summary(choose_route(model, head="whole")) == [("whole", 0)]


@pytest.mark.parametrize("head", ["rest", "nobody"])
def test_head_that_does_not_start_at_zero_is_refused(head):
    model = swarm(6, node("head", 0, 2), node("rest", 2, 6))
    with pytest.raises(ModelNotCovered, match=head):
        choose_route(model, head=head)


def test_head_that_is_excluded_or_not_serving_is_refused():
    model = swarm(6, node("head", 0, 6), node("other", 0, 6))
    with pytest.raises(ModelNotCovered):
        choose_route(model, head="head", exclude={"head"})
    model = swarm(6, node("head", 0, 6, state="leaving"), node("other", 0, 6))
    with pytest.raises(ModelNotCovered):
        choose_route(model, head="head")


def test_exclude_routes_around_nodes():
    model = swarm(6, node("a", 0, 6), node("b", 0, 3), node("c", 3, 6), node("d", 2, 6))
    assert summary(choose_route(model, exclude={"a"})) == [("b", 0), ("c", 3)]
    assert summary(choose_route(model, exclude=["a", "c"])) == [("b", 0), ("d", 3)]
    with pytest.raises(ModelNotCovered):
        choose_route(model, exclude={"a", "b"})


@pytest.mark.parametrize(
    ("nodes", "missing"),
    [
        ([], ["[0, 6)"]),
        ([(0, 2), (4, 6)], ["[2, 4)"]),
        ([(1, 6)], ["[0, 1)"]),
        ([(0, 5)], ["[5, 6)"]),
        ([(1, 2), (3, 4)], ["[0, 1)", "[2, 3)", "[4, 6)"]),
    ],
)
def test_gaps_raise_model_not_covered_naming_the_missing_ranges(nodes, missing):
    model = swarm(6, *(node(f"n{i}", a, b) for i, (a, b) in enumerate(nodes)))
    with pytest.raises(ModelNotCovered) as info:
        choose_route(model)
    error = info.value
    assert error.status == 503
    assert error.code == "model_not_covered"
    assert MODEL in error.message
    assert error.message.endswith("missing layers: " + ", ".join(missing))


def test_nodes_reaching_past_the_model_end_are_clamped():
    model = swarm(6, node("a", 0, 4), node("b", 3, 9))
    route = choose_route(model)
    assert summary(route) == [("a", 0), ("b", 4)]


# -- properties ----------------------------------------------------------------------------


@st.composite
def swarms(draw, max_layers: int = 10, max_nodes: int = 7) -> ModelCoverage:
    num_layers = draw(st.integers(1, max_layers))
    count = draw(st.integers(0, max_nodes))
    nodes = []
    for i in range(count):
        start = draw(st.integers(0, num_layers - 1))
        end = draw(st.integers(start + 1, num_layers))
        load = draw(st.integers(0, 4))
        state = draw(st.sampled_from(["serving"] * 4 + ["joining", "leaving"]))
        nodes.append(node(f"n{i}", start, end, load=load, state=state))
    return swarm(num_layers, *nodes)


def all_chains(model: ModelCoverage, *, head=None, exclude=()):
    """Every chain over serving nodes from layer 0 to the end (brute force, small swarms)."""
    nodes = [n for n in model.serving if n.node_id not in exclude]
    chains = []

    def extend(position: int, path: list[Hop]) -> None:
        if position >= model.num_layers:
            chains.append(list(path))
            return
        for n in nodes:
            if not n.layers.start <= position < n.layers.end:
                continue
            if not path and head is not None and n.node_id != head:
                continue
            path.append(Hop(n, position))
            extend(min(n.layers.end, model.num_layers), path)
            path.pop()

    extend(0, [])
    return chains


def cost(route: list[Hop]) -> tuple:
    return (len(route), sum(h.node.load for h in route), tuple(h.node.node_id for h in route))


def min_hops_bfs(model: ModelCoverage) -> int | None:
    """Fewest hops from layer 0 to the end, by breadth-first search over layer positions."""
    frontier, seen, hops = {0}, {0}, 0
    while frontier:
        if model.num_layers in frontier:
            return hops
        nxt = set()
        for position in frontier:
            for n in model.serving:
                if n.layers.start <= position < n.layers.end:
                    nxt.add(min(n.layers.end, model.num_layers))
        frontier = nxt - seen
        seen |= nxt
        hops += 1
    return None


def assert_valid(model: ModelCoverage, route: list[Hop]) -> None:
    serving = set(model.serving)
    assert route, "a route has at least one hop"
    position = 0
    for hop in route:
        assert hop.node in serving
        assert hop.node.model_id == model.model_id
        assert hop.start_layer == position
        assert hop.start_layer in hop.node.layers
        position = min(hop.node.layers.end, model.num_layers)
    assert position == model.num_layers


@settings(max_examples=400, deadline=None)
@given(model=swarms())
def test_route_exists_exactly_when_there_are_no_gaps(model):
    try:
        route = choose_route(model)
    except ModelNotCovered as exc:
        gaps = model.gaps()
        assert gaps
        assert all(str(g) in exc.message for g in gaps)
        return
    assert not model.gaps()
    assert model.covered
    assert_valid(model, route)


@settings(max_examples=300, deadline=None)
@given(model=swarms(max_layers=8, max_nodes=6))
def test_route_has_the_fewest_hops(model):
    best = min_hops_bfs(model)
    if best is None:
        with pytest.raises(ModelNotCovered):
            choose_route(model)
        return
    assert len(choose_route(model)) == best


@settings(max_examples=300, deadline=None)
@given(model=swarms(max_layers=8, max_nodes=6))
def test_route_is_the_cheapest_chain(model):
    """Fewest hops, then least total load, then node ids: the minimum over every chain."""
    chains = all_chains(model)
    if not chains:
        with pytest.raises(ModelNotCovered):
            choose_route(model)
        return
    assert cost(choose_route(model)) == min(cost(c) for c in chains)


@settings(max_examples=200, deadline=None)
@given(model=swarms(), seed=st.integers(0, 2**32 - 1))
def test_route_ignores_node_order(model, seed):
    shuffled = list(model.nodes)
    random.Random(seed).shuffle(shuffled)
    other = swarm(model.num_layers, *shuffled)
    try:
        expected = summary(choose_route(model))
    except ModelNotCovered as exc:
        with pytest.raises(ModelNotCovered) as again:
            choose_route(other)
        assert again.value.message == exc.message
        return
    assert summary(choose_route(other)) == expected
    assert summary(choose_route(model)) == expected  # same input, same output


@settings(max_examples=300, deadline=None)
@given(model=swarms(max_layers=8, max_nodes=6), data=st.data())
def test_head_and_exclude_constraints_hold(model, data):
    ids = [n.node_id for n in model.nodes]
    exclude = set(data.draw(st.lists(st.sampled_from(ids), max_size=2))) if ids else set()
    heads = [n.node_id for n in model.serving if n.layers.start == 0 and n.node_id not in exclude]
    head = data.draw(st.sampled_from(heads)) if heads and data.draw(st.booleans()) else None
    chains = all_chains(model, head=head, exclude=exclude)
    if not chains:
        with pytest.raises(ModelNotCovered):
            choose_route(model, head=head, exclude=exclude)
        return
    route = choose_route(model, head=head, exclude=exclude)
    assert_valid(model, route)
    assert not {h.node.node_id for h in route} & exclude
    if head is not None:
        assert route[0].node.node_id == head
    assert cost(route) == min(cost(c) for c in chains)


# -- routes that know the links (docs/adr/0021) --------------------------------------------


def measured(node_id, start, end, *, layer_ms=None, links=(), load=0):
    base = node(node_id, start, end, load=load)
    return ServingNode(**{**base.__dict__, "layer_ms": layer_ms,
                          "links": tuple((f"http://{t}.test:8000", ms) for t, ms in links)})  # fmt: skip


def test_a_fast_link_beats_a_slow_one():
    model = swarm(
        6,
        measured("a", 0, 3, layer_ms=2.0, links=[("b", 50.0), ("c", 5.0)]),
        measured("b", 3, 6, layer_ms=2.0),
        measured("c", 3, 6, layer_ms=2.0),
    )
    assert summary(choose_route(model)) == [("a", 0), ("c", 3)]


def test_slow_compute_can_outweigh_a_fast_link():
    model = swarm(
        6,
        measured("a", 0, 3, layer_ms=2.0, links=[("b", 20.0), ("c", 5.0)]),
        measured("b", 3, 6, layer_ms=1.0),  # 20 + 3 x 1 = 23 ms
        measured("c", 3, 6, layer_ms=10.0),  # 5 + 3 x 10 = 35 ms
    )
    assert summary(choose_route(model)) == [("a", 0), ("b", 3)]


def test_more_hops_over_fast_links_beat_one_slow_link():
    model = swarm(
        9,
        measured("a", 0, 3, links=[("far", 80.0), ("m1", 2.0)]),
        measured("far", 3, 9),
        measured("m1", 3, 6, links=[("m2", 2.0), ("far", 40.0)]),
        measured("m2", 6, 9),
    )
    assert summary(choose_route(model)) == [("a", 0), ("m1", 3), ("m2", 6)]


def test_unmeasured_links_cost_the_median_of_the_measured_ones():
    model = swarm(
        6,
        measured("a", 0, 3, links=[("b", 30.0), ("d", 30.0)]),
        measured("b", 3, 6),
        measured("c", 3, 6),  # not measured: 30 ms like the others, then load decides
        measured("d", 3, 6),
    )
    assert summary(choose_route(model))[1][0] == "b"  # ids break the tie


def test_routes_do_not_flap_on_small_differences():
    def model(c_ms: float, b_load: int = 0):
        return swarm(
            6,
            measured("a", 0, 3, links=[("b", 20.0), ("c", c_ms)]),
            measured("b", 3, 6, load=b_load),
            measured("c", 3, 6),
        )

    first = choose_route(model(25.0))
    assert summary(first) == [("a", 0), ("b", 3)]
    slightly = model(19.0)  # c is 1 ms faster now: noise, keep b
    kept = keep_or_switch(slightly, first, choose_route(slightly))
    assert summary(kept) == [("a", 0), ("b", 3)]
    much = model(10.0)  # c is clearly faster: switch
    assert summary(keep_or_switch(much, first, choose_route(much))) == [("a", 0), ("c", 3)]
    busy = model(20.0, b_load=3)  # as fast, but b carries sessions: spread to c
    assert summary(keep_or_switch(busy, first, choose_route(busy))) == [("a", 0), ("c", 3)]
    gone = swarm(6, measured("a", 0, 3), measured("c", 3, 6))  # b left: never kept
    assert summary(keep_or_switch(gone, first, choose_route(gone))) == [("a", 0), ("c", 3)]

"""The placement policy over made-up swarms: examples, then properties (hypothesis).

Costs are synthetic ``ModelCosts`` (no checkpoints): layers of a few hundred million
parameters, embeddings priced as head/tail extras, a KV budget where it matters.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from meshnet_common.errors import InsufficientMemory
from meshnet_common.layers import LayerRange
from meshnet_common.memory import ModelCosts
from meshnet_common.precision import Precision
from meshnet_tracker.placement import (
    ModelView,
    MoveCandidate,
    NodeRequest,
    Placement,
    add_redundancy,
    choose_move,
    fill_gap,
    place,
)

GIB = 2**30
BF16 = Precision.BFLOAT16
LAYER = 100_000_000  # parameters per decoder layer (~0.2 GB at bfloat16)
EMBED = 500_000_000  # parameters of the embeddings / lm_head (~1 GB at bfloat16)


def costs(
    num_layers: int,
    *,
    layer: int = LAYER,
    head: int = 0,
    tail: int = 0,
    tied: int = 0,
    kv_elements: int = 0,
) -> ModelCosts:
    """Uniform layers of ``layer`` quantizable parameters plus a little norm weight each."""
    return ModelCosts(
        num_layers=num_layers,
        layer_quantizable=(layer,) * num_layers,
        layer_other=(1024,) * num_layers,
        head_numel=head,
        tail_numel=tail,
        tied_numel=tied,
        kv_elements=kv_elements,
    )


def view(model_id: str, model_costs: ModelCosts, capacity, demand: int = 0) -> ModelView:
    return ModelView(model_id, model_costs, tuple(capacity), demand)


def holding(model_costs: ModelCosts, layers: LayerRange, **request) -> NodeRequest:
    """A node whose memory is exactly what ``layers`` needs (so it holds that much, no more)."""
    precision = request.get("precision", BF16)
    kv_tokens = request.get("kv_tokens", 0)
    dtype, group = request.get("dtype", "bfloat16"), request.get("group_size", 64)
    ask = NodeRequest(0, precision, kv_tokens, dtype=dtype, group_size=group)
    need = ask.shard_bytes(model_costs, layers)
    return NodeRequest(
        need, precision, kv_tokens, request.get("held_models", frozenset()),
        dtype=dtype, group_size=group,
    )  # fmt: skip


def fits(view_: ModelView, request: NodeRequest, layers: LayerRange) -> bool:
    """Whether the node can serve the model at all and ``layers`` fit in its memory."""
    need = request.shard_bytes(view_.costs, layers)
    return need is not None and need <= request.memory_bytes


def one_layer_fits(view_: ModelView, request: NodeRequest, layer: int) -> bool:
    return fits(view_, request, LayerRange(layer, layer + 1))


def apply(capacity: list[int], layers: LayerRange, delta: int = 1) -> None:
    for layer in layers:
        capacity[layer] += delta


# -- refusal -------------------------------------------------------------------------------


def test_a_node_too_small_for_one_layer_is_refused_clearly():
    model = costs(8, head=EMBED, tail=EMBED)
    views = [view("org/a", model, [0] * 8), view("org/b", model, [1] * 8)]
    request = NodeRequest(100 * 2**20, Precision.INT8, kv_tokens=0)  # 0.1 GiB < one layer
    with pytest.raises(InsufficientMemory) as excinfo:
        place(views, request)
    err = excinfo.value
    assert err.code == "node_too_small"
    assert err.status == 507
    assert "0.10 GiB at int8" in err.message
    assert "cannot hold even one layer" in err.message


def test_the_kv_budget_counts_against_memory():
    model = costs(8, kv_elements=2 * 8 * 128)
    roomy = holding(model, LayerRange(0, 4))
    with_kv = NodeRequest(roomy.memory_bytes, BF16, kv_tokens=32768)  # 128 MiB/layer of KV
    assert place([view("m", model, [0] * 8)], roomy).layers == LayerRange(0, 4)
    assert len(place([view("m", model, [0] * 8)], with_kv).layers) < 4


# -- precisions ----------------------------------------------------------------------------


def _packed_costs(num_layers: int, native: str | None, *, moe: bool = False) -> ModelCosts:
    """Layers of 100M quantizable weights, 1% of rows' scales; ``native`` ships packed."""
    layer = (LAYER,) * num_layers
    return ModelCosts(
        num_layers=num_layers, layer_quantizable=layer, layer_other=(1024,) * num_layers,
        head_numel=0, tail_numel=0, tied_numel=0, kv_elements=0, moe=moe, native=native,
        layer_int8=layer, layer_int8_rows=(LAYER // 4096,) * num_layers,
        layer_int4=(layer, layer, layer),
        layer_packed=layer if native else None,
        layer_packed_bytes=(LAYER + LAYER // 4096,) * num_layers if native else None,
    )  # fmt: skip


def test_the_same_memory_holds_more_layers_at_fewer_bits():
    model = _packed_costs(40, None)
    memory = 2 * GIB
    held = {
        precision: len(place([view("m", model, [0] * 40)], NodeRequest(memory, precision, 0)).layers)
        for precision in (Precision.FLOAT32, BF16, Precision.INT8, Precision.INT4)
    }  # fmt: skip
    assert held[Precision.FLOAT32] < held[BF16] < held[Precision.INT8] < held[Precision.INT4]
    assert held[Precision.INT8] == pytest.approx(2 * held[BF16], abs=1)
    assert held[Precision.INT4] >= 3 * held[BF16]
    float32_compute = NodeRequest(memory, Precision.INT8, 0, dtype="float32")
    assert len(place([view("m", model, [0] * 40)], float32_compute).layers) <= held[Precision.INT8]


def test_mixed_precisions_fill_a_model_together():
    model = _packed_costs(24, None)
    capacity = [0] * 24
    ranges = []
    for precision in (Precision.INT4, BF16, Precision.INT8, Precision.FLOAT32, Precision.INT4):
        request = NodeRequest(GIB, precision, 0, group_size=32)
        placement = place([view("m", model, capacity)], request)
        assert placement.precision is precision
        assert fits(view("m", model, capacity), request, placement.layers)
        apply(capacity, placement.layers)
        ranges.append(placement.layers)
    assert all(capacity[:22])  # five 1 GiB nodes cover what bfloat16 alone could not
    sizes = [len(r) for r in ranges]
    assert sizes[0] > sizes[2] > sizes[1] > sizes[3]  # int4 > int8 > bf16 > float32


def test_moe_models_take_int8_and_int4_nodes_but_not_nf4():
    moe = _packed_costs(8, None, moe=True)
    for precision in (Precision.INT8, Precision.INT4):
        placement = place([view("org/moe", moe, [0] * 8)], NodeRequest(GIB, precision, 0))
        assert placement.model_id == "org/moe" and placement.precision is precision
    with pytest.raises(InsufficientMemory) as info:
        place([view("org/moe", moe, [0] * 8)], NodeRequest(GIB, Precision.NF4, 0))
    assert "org/moe: nf4 is not supported for Mixture-of-Experts" in info.value.message


def test_fp8_nodes_go_only_to_models_that_ship_fp8_and_auto_resolves_per_model():
    plain = _packed_costs(8, None)
    fp8 = _packed_costs(8, "fp8")
    views = [view("org/plain", plain, [0] * 8), view("org/zz-fp8", fp8, [0] * 8)]
    placement = place(views, NodeRequest(GIB, Precision.FP8, 0))
    assert placement.model_id == "org/zz-fp8" and placement.precision is Precision.FP8
    with pytest.raises(InsufficientMemory) as info:
        place(views[:1], NodeRequest(GIB, Precision.FP8, 0))
    assert info.value.message.startswith("no model this tracker serves can be served at fp8")
    assert "org/plain: fp8 needs a checkpoint that ships it" in info.value.message
    many = [view(f"org/p{i}", plain, [0] * 8) for i in range(6)]
    many.append(view("org/x", _packed_costs(8, "mxfp4"), [0] * 8))
    with pytest.raises(InsufficientMemory) as info:
        place(many, NodeRequest(GIB, Precision.FP8, 0))
    assert "org/p0, org/p1, org/p2 and 3 more: fp8 needs a checkpoint that ships it and this " \
        "one ships plain weights; org/x: fp8 needs" in info.value.message  # fmt: skip
    # auto: the plain model at bfloat16, the FP8 one packed (so more of its layers fit)
    on_plain = place(views[:1], NodeRequest(GIB, "auto", 0))
    on_fp8 = place(views[1:], NodeRequest(GIB, "auto", 0))
    assert on_plain.precision is BF16 and on_fp8.precision is Precision.FP8
    assert len(on_fp8.layers) > len(on_plain.layers)
    # auto with a float32 compute dtype: float32 weights on the plain model
    assert place(views[:1], NodeRequest(GIB, "auto", 0, dtype="float32")).precision is (
        Precision.FLOAT32
    )


# -- coverage first ------------------------------------------------------------------------


def test_gap_range_is_anchored_at_the_gap_start():
    model = costs(8)
    request = holding(model, LayerRange(2, 5))
    placement = place([view("m", model, [1, 1, 0, 0, 0, 0, 0, 1])], request)
    assert placement == Placement("m", LayerRange(2, 5), "gap")


def test_the_whole_gap_when_it_fits_and_never_past_it():
    model = costs(8)
    request = holding(model, LayerRange(1, 7))  # could hold 6 layers
    assert fill_gap(view("m", model, [1, 1, 0, 0, 0, 1, 1, 1]), request) == LayerRange(2, 5)


def test_the_largest_fillable_run_across_the_model_gaps():
    model = costs(10)
    three = holding(model, LayerRange(1, 4))
    capacity = [1, 0, 1, 0, 0, 0, 0, 0, 1, 1]  # gaps [1, 2) and [3, 8)
    assert fill_gap(view("m", model, capacity), three) == LayerRange(3, 6)
    one = holding(model, LayerRange(1, 2))
    assert fill_gap(view("m", model, capacity), one) == LayerRange(1, 2)  # tie: earliest


def test_a_node_that_cannot_hold_the_head_takes_the_layers_after_it():
    model = costs(8, head=EMBED, tail=EMBED)
    request = holding(model, LayerRange(1, 4))  # 3 middle layers; the head alone is bigger
    assert not one_layer_fits(view("m", model, [0] * 8), request, 0)
    assert place([view("m", model, [0] * 8)], request).layers == LayerRange(1, 4)


def test_head_and_tail_extras_shrink_the_range():
    model = costs(12, head=EMBED, tail=EMBED)  # each end costs as much as five layers
    request = holding(model, LayerRange(1, 9))  # eight middle layers
    assert place([view("m", model, [0] * 12)], request).layers == LayerRange(0, 3)
    tail_gap = [1] * 6 + [0] * 6
    assert place([view("m", model, tail_gap)], request).layers == LayerRange(6, 11)


def test_models_closest_to_covered_go_first():
    model = costs(8)
    request = holding(model, LayerRange(0, 2))
    views = [
        view("org/a", model, [1, 1, 0, 0, 0, 0, 0, 0], demand=9),
        view("org/b", model, [1, 1, 1, 1, 1, 1, 0, 0]),
        view("org/c", model, [1, 1, 1, 1, 0, 0, 0, 0]),
    ]
    assert place(views, request) == Placement("org/b", LayerRange(6, 8), "gap")


def test_a_model_the_node_cannot_fill_is_skipped_for_one_it_can():
    big = costs(8, layer=10 * LAYER)
    small = costs(8)
    request = holding(small, LayerRange(0, 2))
    views = [view("org/big", big, [1] * 7 + [0]), view("org/small", small, [0] * 8)]
    assert place(views, request) == Placement("org/small", LayerRange(0, 2), "gap")


def test_held_models_break_ties_before_demand():
    model = costs(8)
    request = holding(model, LayerRange(0, 2))
    capacity = [1, 1, 1, 1, 0, 0, 0, 0]
    views = [view("org/a", model, capacity, demand=5), view("org/b", model, capacity)]
    assert place(views, request).model_id == "org/a"  # more demand
    held = NodeRequest(request.memory_bytes, kv_tokens=0, held_models=frozenset({"org/b"}))
    assert place(views, held).model_id == "org/b"  # already on disk


def test_demand_then_model_id_break_ties():
    model = costs(8)
    request = holding(model, LayerRange(0, 2))
    views = [view("org/b", model, [0] * 8), view("org/a", model, [0] * 8)]
    assert place(views, request).model_id == "org/a"
    views.append(view("org/c", model, [0] * 8, demand=1))
    assert place(views, request).model_id == "org/c"


def test_no_redundancy_while_the_node_fits_a_gap():
    model = costs(8)
    request = holding(model, LayerRange(0, 8))
    views = [view("org/a", model, [1] * 8), view("org/b", model, [2, 2, 2, 2, 2, 2, 2, 0])]
    assert place(views, request) == Placement("org/b", LayerRange(7, 8), "gap")


# -- redundancy ----------------------------------------------------------------------------


def test_redundancy_covers_the_weakest_layers():
    model = costs(8)
    request = holding(model, LayerRange(0, 3))
    placement = place([view("m", model, [2, 2, 1, 1, 1, 2, 2, 2])], request)
    assert placement == Placement("m", LayerRange(2, 5), "redundancy")


def test_redundancy_prefers_the_window_holding_most_weakest_layers():
    model = costs(8)
    request = holding(model, LayerRange(0, 3))
    capacity = [1, 2, 2, 1, 1, 1, 2, 2]  # weakest runs start at 0 (one layer) and 3 (three)
    assert add_redundancy(view("m", model, capacity), request) == LayerRange(3, 6)


def test_redundancy_goes_to_the_model_with_the_weakest_layer():
    model = costs(8)
    request = holding(model, LayerRange(0, 2))
    views = [
        view("org/a", model, [2] * 8, demand=9),
        view("org/b", model, [3, 3, 3, 1, 3, 3, 3, 3]),
        view("org/c", model, [2] * 8),
    ]
    assert place(views, request) == Placement("org/b", LayerRange(3, 5), "redundancy")


def test_a_node_that_cannot_hold_the_head_still_adds_redundancy():
    model = costs(8, head=EMBED, tail=EMBED)
    request = holding(model, LayerRange(1, 4))
    placement = place([view("m", model, [1] * 8)], request)
    assert placement.reason == "redundancy"
    assert fits(view("m", model, [1] * 8), request, placement.layers)


# -- moves ---------------------------------------------------------------------------------


def candidate(node_id: str, start: int, end: int, memory: int, load: int = 0) -> MoveCandidate:
    return MoveCandidate(node_id, LayerRange(start, end), NodeRequest(memory, kv_tokens=0), load)


def test_choose_move_is_none_without_gaps():
    model = costs(6)
    big = model.shard_bytes(LayerRange(0, 6), BF16, 0)
    cands = [candidate("x", 0, 3, big), candidate("y", 0, 3, big)]
    assert choose_move(view("m", model, [2, 2, 2, 1, 1, 1]), [2, 2, 2, 1, 1, 1], cands) is None


def test_choose_move_only_moves_nodes_whose_layers_others_also_serve():
    model = costs(8)
    big = model.shard_bytes(LayerRange(0, 8), BF16, 0)
    capacity = [1, 1, 2, 2, 1, 1, 0, 0]
    unique = candidate("a-unique", 0, 2, big)
    straddling = candidate("b-straddle", 3, 5, big)  # layer 4 has a single holder
    redundant = candidate("c-redundant", 2, 4, big)
    move = choose_move(view("m", model, capacity), capacity, [unique, straddling, redundant])
    assert move == (redundant, LayerRange(6, 8))
    assert choose_move(view("m", model, capacity), capacity, [unique, straddling]) is None


def test_choose_move_never_returns_more_than_fits():
    model = costs(8, tail=EMBED)
    capacity = [2, 2, 2, 0, 0, 0, 0, 0]
    two = model.shard_bytes(LayerRange(3, 5), BF16, 0)
    cand = candidate("x", 0, 3, two)
    move = choose_move(view("m", model, capacity), capacity, [cand])
    assert move == (cand, LayerRange(3, 5))


def test_choose_move_prefers_more_layers_then_less_load_then_node_id():
    model = costs(8)
    capacity = [2, 2, 2, 2, 0, 0, 0, 0]
    two = model.shard_bytes(LayerRange(4, 6), BF16, 0)
    four = model.shard_bytes(LayerRange(4, 8), BF16, 0)
    small, busy, idle, idle2 = (
        candidate("a", 0, 2, two),
        candidate("b", 0, 2, four, load=3),
        candidate("d", 2, 4, four, load=1),
        candidate("c", 2, 4, four, load=1),
    )
    move = choose_move(view("m", model, capacity), capacity, [small, busy, idle, idle2])
    assert move == (idle2, LayerRange(4, 8))


def test_choose_move_fills_the_first_gap():
    model = costs(8)
    capacity = [0, 2, 2, 2, 0, 0, 0, 0]
    big = model.shard_bytes(LayerRange(0, 8), BF16, 0)
    cand = candidate("x", 1, 3, big)
    assert choose_move(view("m", model, capacity), capacity, [cand]) == (cand, LayerRange(0, 1))


# -- minimum number of nodes ---------------------------------------------------------------


def min_nodes_to_cover(model_costs: ModelCosts, request: NodeRequest) -> int | None:
    """Fewest equal nodes whose ranges cover the model, by DP over segment ends."""
    n = model_costs.num_layers
    best: list[int | None] = [0] + [None] * n
    for end in range(1, n + 1):
        for start in range(end):
            if best[start] is None:
                continue
            need = request.shard_bytes(model_costs, LayerRange(start, end))
            if (
                need is not None
                and need <= request.memory_bytes
                and (best[end] is None or best[start] + 1 < best[end])
            ):
                best[end] = best[start] + 1
    return best[n]


def joins_to_cover(model_costs: ModelCosts, request: NodeRequest) -> int | None:
    """Equal nodes joining one at a time until the model is covered (None: it never is)."""
    capacity = [0] * model_costs.num_layers
    for joined in range(model_costs.num_layers + 1):
        if all(capacity):
            return joined
        try:
            placement = place([view("m", model_costs, capacity)], request)
        except InsufficientMemory:
            return None
        assert placement.reason == "gap"
        apply(capacity, placement.layers)
    raise AssertionError("more joins than layers")


@pytest.mark.parametrize(
    ("num_layers", "per_node", "head", "tail", "tied", "expected"),
    [
        (32, 4, 0, 0, 0, 8),
        (30, 4, 0, 0, 0, 8),
        (32, 8, EMBED, EMBED, 0, 6),  # the end nodes hold 3 layers each; 26 middle layers
        (32, 8, EMBED, EMBED, EMBED, 6),  # tied embeddings change nothing unless one node
        (2, 8, EMBED, EMBED, EMBED, 1),  # ... holds both ends: then they are counted once
        (2, 8, EMBED, EMBED, 0, 2),
        (12, 12, 0, 0, 0, 1),
    ],
)
def test_equal_nodes_cover_in_the_minimum_count(num_layers, per_node, head, tail, tied, expected):
    model = costs(num_layers, head=head, tail=tail, tied=tied)
    memory = costs(per_node + 2).shard_bytes(LayerRange(1, 1 + per_node), BF16, 0)
    request = NodeRequest(memory, BF16, kv_tokens=0)  # holds ``per_node`` middle layers
    assert min_nodes_to_cover(model, request) == expected
    assert joins_to_cover(model, request) == expected


# -- properties ----------------------------------------------------------------------------

PRECISIONS = [*Precision, "auto"]  # what a node may ask for (fp8/mxfp4: native models only)


@st.composite
def model_costs(draw, max_layers: int = 24) -> ModelCosts:
    n = draw(st.integers(1, max_layers))
    if draw(st.booleans()):
        quantizable = (draw(st.integers(10**6, 10**9)),) * n
    else:
        quantizable = tuple(draw(st.lists(st.integers(10**6, 10**9), min_size=n, max_size=n)))
    head = draw(st.integers(0, 2 * 10**9))
    tail = draw(st.integers(0, 2 * 10**9))
    return ModelCosts(
        num_layers=n,
        layer_quantizable=quantizable,
        layer_other=tuple(draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))),
        head_numel=head,
        tail_numel=tail,
        tied_numel=draw(st.sampled_from([0, min(head, tail)])),
        kv_elements=draw(st.sampled_from([0, 256, 2048, 16384])),
        native=draw(st.sampled_from([None, None, "fp8", "mxfp4"])),
        moe=draw(st.booleans()),
    )


# Log-uniform from 128 MiB to 64 GiB: small nodes are as likely as big ones.
memories = st.floats(27.0, 36.0).map(lambda exponent: int(2**exponent))


@st.composite
def node_requests(draw, model_ids: list[str]) -> NodeRequest:
    return NodeRequest(
        memory_bytes=draw(memories),
        precision=draw(st.sampled_from(PRECISIONS)),
        kv_tokens=draw(st.sampled_from([0, 1024, 32768])),
        held_models=frozenset(draw(st.lists(st.sampled_from(model_ids), max_size=2))),
        dtype=draw(st.sampled_from(["bfloat16", "float32"])),
        group_size=draw(st.sampled_from([32, 64, 128])),
    )


@st.composite
def swarms(draw) -> tuple[list[ModelView], NodeRequest]:
    count = draw(st.integers(1, 4))
    ids = [f"org/m{i}" for i in range(count)]
    views = []
    for model_id in ids:
        mc = draw(model_costs())
        counts = draw(st.sampled_from([(0, 0, 1, 1, 2, 3), (1, 1, 2, 3)]))  # gaps or none
        capacity = draw(
            st.lists(
                st.sampled_from(counts),
                min_size=mc.num_layers,
                max_size=mc.num_layers,
            )
        )
        views.append(view(model_id, mc, capacity, demand=draw(st.integers(0, 3))))
    return views, draw(node_requests(ids))


def covered_fraction(model_view: ModelView) -> float:
    return sum(1 for c in model_view.capacity if c) / len(model_view.capacity)


def try_place(views: list[ModelView], request: NodeRequest) -> Placement | None:
    try:
        return place(views, request)
    except InsufficientMemory:
        return None


@settings(max_examples=300, deadline=None)
@given(swarms())
def test_property_assignment_fits_and_coverage_comes_first(swarm):
    views, request = swarm
    placement = try_place(views, request)
    event(placement.reason if placement else "refused")
    fillable = [
        v for v in views if any(one_layer_fits(v, request, g) for gap in v.gaps() for g in gap)
    ]
    if placement is None:
        assert not fillable  # refused only when no gap layer of any model fits
        return
    chosen = next(v for v in views if v.model_id == placement.model_id)
    placement.layers.check_within(chosen.costs.num_layers)
    assert fits(chosen, request, placement.layers)  # never more layers than fit
    if fillable:
        assert placement.reason == "gap"  # no redundancy while a gap the node fits exists
        assert all(chosen.capacity[layer] == 0 for layer in placement.layers)
        assert covered_fraction(chosen) == max(covered_fraction(v) for v in fillable)
    else:
        assert placement.reason == "redundancy"
        assert not chosen.gaps()
        weakest = min(chosen.capacity)
        weak_fits = any(
            fits(chosen, request, LayerRange(layer, layer + 1))
            for layer, count in enumerate(chosen.capacity)
            if count == weakest
        )
        if weak_fits:  # the weakest layers get the node whenever it can hold one of them
            assert any(chosen.capacity[layer] == weakest for layer in placement.layers)


@settings(max_examples=300, deadline=None)
@given(swarms())
def test_property_gap_fill_is_the_largest_run_from_a_gap_start(swarm):
    views, request = swarm
    placement = try_place(views, request)
    assume(placement is not None and placement.reason == "gap")
    chosen = next(v for v in views if v.model_id == placement.model_id)
    gap = next(g for g in chosen.gaps() if placement.layers.start in g)
    layers = placement.layers
    assert layers.end <= gap.end
    if layers.end < gap.end:  # one more layer of the gap would not fit
        assert not fits(chosen, request, LayerRange(layers.start, layers.end + 1))
    if one_layer_fits(chosen, request, gap.start):
        assert layers.start == gap.start
    else:
        assert not any(one_layer_fits(chosen, request, s) for s in range(gap.start, layers.start))
    for other in chosen.gaps():  # no gap's start-anchored run is longer
        k = request.max_layers_from(chosen.costs, other.start, len(other))
        assert k <= len(layers)


@settings(max_examples=200, deadline=None)
@given(swarms(), st.randoms(use_true_random=False))
def test_property_place_is_deterministic(swarm, rng):
    views, request = swarm
    first = try_place(views, request)
    assert try_place(views, request) == first
    shuffled = list(views)
    rng.shuffle(shuffled)
    assert try_place(shuffled, request) == first  # the order of the snapshot does not matter


@settings(max_examples=150, deadline=None)
@given(model_costs(max_layers=30), st.data())
def test_property_equal_nodes_cover_in_the_minimum_count(mc, data):
    # At least every single layer fits, so some number of these nodes covers the model.
    one_layer = max(mc.shard_bytes(LayerRange(i, i + 1), BF16, 0) for i in range(mc.num_layers))
    whole = mc.shard_bytes(LayerRange(0, mc.num_layers), BF16, 0)
    memory = data.draw(st.integers(one_layer, max(one_layer, whole)), label="memory")
    request = NodeRequest(memory, BF16, kv_tokens=0)
    assert joins_to_cover(mc, request) == min_nodes_to_cover(mc, request)


@st.composite
def move_cases(draw):
    mc = draw(model_costs())
    n = mc.num_layers
    serving = draw(st.lists(st.sampled_from([0, 0, 1, 2, 2, 3]), min_size=n, max_size=n))
    pending = draw(st.lists(st.sampled_from([0, 0, 0, 1]), min_size=n, max_size=n))
    capacity = [s + p for s, p in zip(serving, pending, strict=True)]
    served = [i for i in range(n) if serving[i]]
    candidates = []
    for i in range(draw(st.integers(0, 6))):
        if not served:
            break
        start = draw(st.sampled_from(served))
        end = start + 1
        while end < n and serving[end] and draw(st.booleans()):
            end += 1
        memory = draw(memories)
        candidates.append(
            MoveCandidate(
                f"n{i}",
                LayerRange(start, end),
                NodeRequest(
                    memory,
                    draw(st.sampled_from(PRECISIONS)),
                    draw(st.sampled_from([0, 1024, 32768])),
                ),
                draw(st.integers(0, 3)),
            )
        )
    return view("m", mc, capacity), serving, candidates


@settings(max_examples=300, deadline=None)
@given(move_cases(), st.randoms(use_true_random=False))
def test_property_choose_move(case, rng):
    model_view, serving, candidates = case
    move = choose_move(model_view, serving, candidates)
    event("moved" if move else "no move")
    shuffled = list(candidates)
    rng.shuffle(shuffled)
    assert choose_move(model_view, serving, shuffled) == move  # deterministic
    gaps = model_view.gaps()
    if not gaps:
        assert move is None
        return
    if move is None:
        return
    cand, layers = move
    assert all(serving[layer] >= 2 for layer in cand.layers)  # moving it opens no gap
    assert layers.start == gaps[0].start and layers.end <= gaps[0].end
    need = cand.request.shard_bytes(model_view.costs, layers)
    assert need is not None and need <= cand.request.memory_bytes  # never more than fits


def test_repeated_joins_over_a_random_swarm_respect_memory_and_fill_gaps_first():
    """A seeded mini-simulation: joins and leaves keep every invariant after each step."""
    rng = random.Random(7)
    models = {
        f"org/m{i}": costs(
            rng.randint(8, 40),
            layer=rng.choice([50, 100, 200]) * 10**6,
            head=rng.choice([0, EMBED]),
            tail=rng.choice([0, EMBED]),
            kv_elements=rng.choice([0, 2048]),
        )
        for i in range(6)
    }
    capacity = {m: [0] * mc.num_layers for m, mc in models.items()}
    nodes: dict[int, tuple[str, LayerRange]] = {}
    for node_id in range(400):
        if nodes and node_id < 350 and rng.random() < 0.2:  # the last 50 only join
            model_id, layers = nodes.pop(rng.choice(sorted(nodes)))
            apply(capacity[model_id], layers, -1)
        views = [view(m, models[m], capacity[m]) for m in sorted(models)]
        request = NodeRequest(
            rng.choice([1, 2, 4, 8]) * GIB, rng.choice(PRECISIONS), rng.choice([0, 4096])
        )
        placement = try_place(views, request)
        if placement is None:
            continue
        chosen = next(v for v in views if v.model_id == placement.model_id)
        assert fits(chosen, request, placement.layers)
        if placement.reason == "redundancy":
            for v in views:
                assert not any(one_layer_fits(v, request, g) for gap in v.gaps() for g in gap)
        nodes[node_id] = (placement.model_id, placement.layers)
        apply(capacity[placement.model_id], placement.layers)
    assert all(all(c) for c in capacity.values())  # 400 joins of 1-8 GiB cover six models

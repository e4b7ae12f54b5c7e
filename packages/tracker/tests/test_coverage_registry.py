"""The coverage map as pure data, and the registry's heartbeat expiry under a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import Heartbeat, NodeAnnouncement, NodeState, ShardSpec
from meshnet_tracker.coverage import ModelCoverage, ServingNode, build_coverage
from meshnet_tracker.registry import MISSED_HEARTBEATS, Registry

MODEL = "org/model"
INTERVAL = 2.0


def node(node_id: str, start: int, end: int, *, model: str = MODEL, state: str = "serving"):
    return ServingNode(
        node_id, f"http://{node_id}.test", model, LayerRange(start, end), state=state
    )


def coverage(num_layers: int, *ranges: tuple[int, int]) -> ModelCoverage:
    nodes = tuple(node(f"n{i}", a, b) for i, (a, b) in enumerate(ranges))
    return ModelCoverage(MODEL, num_layers, nodes)


# -- ModelCoverage -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranges", "counts", "gaps"),
    [
        ([], [0] * 6, [(0, 6)]),
        ([(0, 6)], [1] * 6, []),
        ([(0, 2), (2, 4), (4, 6)], [1] * 6, []),
        ([(0, 3), (2, 6)], [1, 1, 2, 1, 1, 1], []),
        ([(0, 2)], [1, 1, 0, 0, 0, 0], [(2, 6)]),
        ([(4, 6)], [0, 0, 0, 0, 1, 1], [(0, 4)]),
        ([(1, 2), (4, 5)], [0, 1, 0, 0, 1, 0], [(0, 1), (2, 4), (5, 6)]),
        ([(0, 6), (0, 6), (3, 4)], [2, 2, 2, 3, 2, 2], []),
        ([(2, 9)], [0, 0, 1, 1, 1, 1], [(0, 2)]),  # reaches past the end: clamped
    ],
)
def test_layer_counts_and_gaps(ranges, counts, gaps):
    model = coverage(6, *ranges)
    assert model.layer_counts() == counts
    assert model.gaps() == [LayerRange(a, b) for a, b in gaps]
    assert model.covered is (not gaps)


def test_only_serving_nodes_count():
    model = ModelCoverage(
        MODEL,
        4,
        (node("a", 0, 2), node("b", 2, 4, state="joining"), node("c", 2, 4, state="leaving")),
    )
    assert [n.node_id for n in model.serving] == ["a"]
    assert model.layer_counts() == [1, 1, 0, 0]
    assert model.gaps() == [LayerRange(2, 4)]
    assert not model.covered


@settings(max_examples=300, deadline=None)
@given(
    num_layers=st.integers(1, 16),
    ranges=st.lists(st.tuples(st.integers(0, 15), st.integers(1, 16)), max_size=6),
)
def test_gaps_are_exactly_the_maximal_unheld_runs(num_layers, ranges):
    ranges = [(a, b) for a, b in ranges if a < b and a < num_layers]
    model = coverage(num_layers, *ranges)
    counts = model.layer_counts()
    gaps = model.gaps()
    held = [any(a <= layer < b for a, b in ranges) for layer in range(num_layers)]
    assert counts == [sum(a <= layer < b for a, b in ranges) for layer in range(num_layers)]
    in_gap = [any(layer in g for g in gaps) for layer in range(num_layers)]
    assert in_gap == [not h for h in held]
    for before, after in zip(gaps, gaps[1:], strict=False):
        assert before.end < after.start  # sorted, disjoint, and never adjacent (maximal)
    assert model.covered is all(held)


def test_build_coverage_groups_sorts_and_lists_unserved_models():
    nodes = [
        node("z", 3, 6),
        node("y", 0, 3),
        node("x", 0, 3),
        node("q", 0, 2, model="org/other"),
        node("u", 0, 5, model="org/unknown"),
    ]
    models = build_coverage(nodes, {MODEL: 6, "org/other": 4, "org/idle": 8})
    assert list(models) == ["org/idle", "org/model", "org/other", "org/unknown"]
    assert [n.node_id for n in models[MODEL].nodes] == ["x", "y", "z"]
    assert models[MODEL].covered
    assert models["org/idle"].nodes == ()
    assert models["org/idle"].gaps() == [LayerRange(0, 8)]
    assert models["org/other"].gaps() == [LayerRange(2, 4)]
    # A model nobody declared a size for: its layer count is the furthest end served.
    assert models["org/unknown"].num_layers == 5
    assert build_coverage([], {}) == {}


# -- Registry ------------------------------------------------------------------------------


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def announcement(node_id: str, start: int = 0, end: int = 6, *, model: str = MODEL):
    return NodeAnnouncement(
        node_id=node_id,
        url=f"http://{node_id}.test:8000",
        shard=ShardSpec(model_id=model, shard_start=start, shard_end=end),
        num_layers=6,
        quantization=Precision.FLOAT32,
        device="cpu",
        memory_declared_bytes=1 << 30,
        memory_free_bytes=1 << 29,
    )


def beat(node_id: str, **fields) -> Heartbeat:
    values = {"state": NodeState.SERVING, "active_sessions": 0, "kv_tokens": 0}
    values["memory_free_bytes"] = 1 << 28
    return Heartbeat(node_id=node_id, **{**values, **fields})


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock) -> Registry:
    return Registry(INTERVAL, clock=clock)


def ids(registry: Registry) -> set[str]:
    return {r.node_id for r in registry.records()}


def test_register_shows_in_coverage(registry):
    record = registry.register(announcement("a", 0, 3), called_back=True)
    assert record.node_id == "a" and record.state is NodeState.SERVING and not record.local
    registry.register(announcement("b", 3, 6), called_back=True)
    model = registry.coverage()[MODEL]
    assert model.num_layers == 6
    assert [n.node_id for n in model.nodes] == ["a", "b"]
    assert model.covered
    served = model.nodes[0]
    assert served.url == "http://a.test:8000"
    assert served.layers == LayerRange(0, 3)
    assert served.quantization == "float32"


def test_register_again_replaces_the_record(registry):
    first = registry.register(announcement("a", 0, 3), called_back=True)
    registry.register(announcement("a", 2, 6), proof=first.secret)  # its own secret
    model = registry.coverage()[MODEL]
    assert [(n.node_id, n.layers) for n in model.nodes] == [("a", LayerRange(2, 6))]


def test_heartbeat_known_and_unknown(registry):
    registry.register(announcement("a"), called_back=True)
    assert registry.heartbeat(beat("a", active_sessions=3, kv_tokens=120, tokens_generated=9))
    record = registry.get("a")
    assert (record.active_sessions, record.kv_tokens, record.tokens_generated) == (3, 120, 9)
    assert registry.coverage()[MODEL].nodes[0].load == 3
    assert registry.heartbeat(beat("ghost")) is False
    assert registry.get("ghost") is None
    assert ids(registry) == {"a"}


def test_heartbeat_state_leaving_takes_node_out_of_serving(registry):
    registry.register(announcement("a"), called_back=True)
    registry.heartbeat(beat("a", state=NodeState.LEAVING))
    model = registry.coverage()[MODEL]
    assert model.serving == ()
    assert model.gaps() == [LayerRange(0, 6)]


def test_silent_node_is_pruned_after_three_missed_intervals_not_before(registry, clock):
    assert MISSED_HEARTBEATS == 3
    registry.register(announcement("a"), called_back=True)
    clock.advance(MISSED_HEARTBEATS * INTERVAL - 0.25)  # binary fractions: exact arithmetic
    assert registry.prune() == []
    clock.advance(0.25)  # exactly three intervals: still within the grace period
    assert ids(registry) == {"a"}
    clock.advance(0.25)
    assert registry.prune() == ["a"]
    assert ids(registry) == set()
    assert registry.coverage()[MODEL].gaps() == [LayerRange(0, 6)]  # the model stays known
    assert registry.heartbeat(beat("a")) is False  # it must register again


def test_heartbeats_keep_a_node_alive(registry, clock):
    registry.register(announcement("a"), called_back=True)
    registry.register(announcement("b"), called_back=True)
    for _ in range(10):
        clock.advance(INTERVAL * 2.5)
        assert registry.heartbeat(beat("a"))
    assert ids(registry) == {"a"}


def test_local_records_never_expire(registry, clock):
    registry.register(announcement("tracker", 0, 2), local=True)
    registry.register(announcement("remote", 2, 6), called_back=True)
    clock.advance(INTERVAL * 1000)
    assert registry.prune() == ["remote"]
    assert ids(registry) == {"tracker"}
    assert registry.get("tracker").local


def test_remove(registry):
    registry.register(announcement("a"), called_back=True)
    assert registry.remove("a") is True
    assert registry.remove("a") is False
    assert registry.remove("never") is False
    assert ids(registry) == set()


def test_note_model_makes_an_unserved_model_known(registry):
    registry.note_model("org/idle", 12)
    model = registry.coverage()["org/idle"]
    assert model.num_layers == 12
    assert model.gaps() == [LayerRange(0, 12)]


def test_coverage_reads_prune_first(registry, clock):
    registry.register(announcement("a"), called_back=True)
    clock.advance(INTERVAL * (MISSED_HEARTBEATS + 1))
    assert registry.coverage()[MODEL].nodes == ()

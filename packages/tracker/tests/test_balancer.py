"""Balancer: pending assignments spread simultaneous joins; moves close gaps, rate-limited."""

from __future__ import annotations

from collections import Counter

from meshnet_common.layers import LayerRange
from meshnet_common.memory import ModelCosts
from meshnet_common.precision import Precision
from meshnet_common.protocol import (
    AssignRequest,
    DirectiveKind,
    Heartbeat,
    NodeAnnouncement,
    NodeState,
    ShardSpec,
)
from meshnet_tracker.balancer import Balancer
from meshnet_tracker.registry import Registry

MODEL = "org/model"
MIB = 1024**2
# 12 layers of 1M params each, small embeddings; a 1.2 GiB-ish node holds 6 layers at bf16.
COSTS = ModelCosts(12, (1_000_000,) * 12, (0,) * 12, 1000, 1000, 1000, 64)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def node_memory(layers: int) -> int:
    """Declared bytes that hold exactly ``layers`` middle layers (KV 16 tokens)."""
    from meshnet_common.layers import LayerRange

    return (
        COSTS.shard_bytes(LayerRange(3, 3 + layers), Precision.BFLOAT16, 16) + 10_000
    )  # room for embeddings


def setup(clock: Clock, grace_s: float = 0.0) -> tuple[Registry, Balancer]:
    registry = Registry(1.0, clock=clock)
    registry.note_model(MODEL, 12)
    balancer = Balancer(
        registry, {MODEL: COSTS}, Counter(), clock=clock, move_cooldown_s=30, move_grace_s=grace_s,
        joining_ttl_s=600,
    )  # fmt: skip
    return registry, balancer


def ask(node_id: str, layers: int) -> AssignRequest:
    return AssignRequest(node_id=node_id, memory_bytes=node_memory(layers), device="cpu",
                         kv_tokens=16)  # fmt: skip


def announce(
    registry: Registry, node_id: str, start: int, end: int, layers_memory: int,
    *, movable: bool = True, state: NodeState = NodeState.SERVING,
) -> None:  # fmt: skip
    registry.register(
        NodeAnnouncement(
            node_id=node_id, url=f"http://127.0.0.1:{9000 + len(node_id)}",
            shard=ShardSpec(model_id=MODEL, shard_start=start, shard_end=end), num_layers=12,
            quantization=Precision.BFLOAT16, device="cpu",
            memory_declared_bytes=node_memory(layers_memory), memory_free_bytes=0,
            kv_budget_tokens=16, state=state, movable=movable,
        )
    )  # fmt: skip


def beat(registry: Registry, *node_ids: str, state: NodeState = NodeState.SERVING) -> None:
    for node_id in node_ids:
        registry.heartbeat(Heartbeat(node_id=node_id, state=state, active_sessions=0,
                                     kv_tokens=0, memory_free_bytes=0))  # fmt: skip


def test_simultaneous_joins_take_different_gaps():
    clock = Clock()
    _registry, balancer = setup(clock)
    first = balancer.assign(ask("a", 6))
    second = balancer.assign(ask("b", 6))  # "a" is not serving yet: its range is pending
    assert (first.layers.start, first.layers.end) == (0, 6)
    assert (second.layers.start, second.layers.end) == (6, 12)
    clock.now += 1000  # pending assignments expire if the node never shows up
    assert balancer.assign(ask("c", 6)).layers.start == 0


def test_gap_is_closed_by_moving_a_redundant_node_once():
    clock = Clock()
    registry, balancer = setup(clock)
    announce(registry, "head", 0, 6, 6)
    announce(registry, "tail", 6, 12, 6)
    announce(registry, "spare", 0, 6, 6)  # redundant: "head" holds the same layers
    assert balancer.plan_moves() == 0  # no gap: nobody moves
    registry.remove("tail")
    assert balancer.plan_moves() == 1
    movers = [n for n in ("head", "spare") if balancer.peek_directives(n)]
    assert movers == ["head"]  # both are redundant: equal load, so the lower id moves
    load, drop = balancer.directives_for("head")
    assert load.kind is DirectiveKind.LOAD_SHARD and (
        load.shard.shard_start,
        load.shard.shard_end,
    ) == (6, 12)
    assert drop.kind is DirectiveKind.DROP_SHARD and (
        drop.shard.shard_start,
        drop.shard.shard_end,
    ) == (0, 6)
    assert balancer.directives_for("head") == ()  # delivered once
    assert balancer.plan_moves() == 0  # the gap counts as covered while the move is pending
    clock.now += 1000  # the move never completed: once it expires the gap is retried
    registry.heartbeat(Heartbeat(node_id="spare", state=NodeState.SERVING, active_sessions=0,
                                 kv_tokens=0, memory_free_bytes=0))  # fmt: skip
    registry.heartbeat(Heartbeat(node_id="head", state=NodeState.SERVING, active_sessions=0,
                                 kv_tokens=0, memory_free_bytes=0))  # fmt: skip
    assert balancer.plan_moves() == 1
    assert balancer.peek_directives("head")  # its cool-down has passed


def test_a_range_given_by_hand_is_never_moved():
    clock = Clock()
    registry, balancer = setup(clock)
    announce(registry, "head", 0, 6, 6, movable=False)
    announce(registry, "spare", 0, 6, 6, movable=False)  # redundant, but placed by an operator
    assert balancer.plan_moves() == 0  # [6, 12) is a gap, and nobody may close it
    clock.now += 100
    beat(registry, "head", "spare")
    assert balancer.plan_moves() == 0
    assert balancer.peek_directives("head") == balancer.peek_directives("spare") == ()
    assert balancer.move_counts == Counter()


def test_a_node_still_loading_is_no_gap_to_close():
    """The order that churned ranges: [0, 6) twice serving, [6, 12) still loading."""
    clock = Clock()
    registry, balancer = setup(clock)
    announce(registry, "head", 0, 6, 6)
    announce(registry, "spare", 0, 6, 6)
    announce(registry, "tail", 6, 12, 6, state=NodeState.JOINING)
    for _ in range(20):  # it loads for a long while, heartbeating as joining
        clock.now += 0.5
        beat(registry, "head", "spare")
        beat(registry, "tail", state=NodeState.JOINING)
        assert balancer.plan_moves() == 0
    # placement sees [6, 12) as on its way: a new node gets redundancy, not that range
    assert [v.capacity for v in balancer.views()] == [(2,) * 6 + (1,) * 6]


def test_a_node_loading_past_its_ttl_no_longer_holds_the_range():
    clock = Clock()
    registry, balancer = setup(clock)
    announce(registry, "head", 0, 6, 6)
    announce(registry, "spare", 0, 6, 6)
    announce(registry, "tail", 6, 12, 6, state=NodeState.JOINING)
    clock.now += 601  # joining for longer than the TTL (heartbeating all along)
    beat(registry, "head", "spare")
    beat(registry, "tail", state=NodeState.JOINING)
    assert balancer.plan_moves() == 1


def test_a_gap_shorter_than_the_grace_period_moves_nobody():
    clock = Clock()
    registry, balancer = setup(clock, grace_s=10.0)
    announce(registry, "head", 0, 6, 6)
    announce(registry, "tail", 6, 12, 6)
    announce(registry, "spare", 0, 6, 6)
    registry.remove("tail")
    assert balancer.plan_moves() == 0  # the gap just opened
    clock.now += 5
    beat(registry, "head", "spare")
    assert balancer.plan_moves() == 0
    announce(registry, "tail", 6, 12, 6)  # the tail came back (a restart): no move at all
    clock.now += 6
    beat(registry, "head", "spare", "tail")
    assert balancer.plan_moves() == 0
    registry.remove("tail")  # gone again: the grace period starts over
    clock.now += 1
    beat(registry, "head", "spare")
    assert balancer.plan_moves() == 0
    clock.now += 10
    beat(registry, "head", "spare")
    assert balancer.plan_moves() == 1
    assert balancer.move_counts == Counter({(MODEL, "gap"): 1})


def test_requests_wait_for_a_lost_node_longer_than_moves_do():
    """A node dropped for missed heartbeats may be restarting: its layers count as on their
    way for requests (they wait) for --restart-grace, well past --move-grace; after that a
    request for them fails at once."""
    clock = Clock()
    registry = Registry(1.0, clock=clock)
    registry.note_model(MODEL, 12)
    balancer = Balancer(registry, {MODEL: COSTS}, Counter(), clock=clock, move_grace_s=10.0,
                        restart_grace_s=60.0)  # fmt: skip
    announce(registry, "head", 0, 6, 6)
    announce(registry, "tail", 6, 12, 6)
    assert balancer.coverage_on_its_way(MODEL)
    clock.now += 5  # the tail misses its heartbeats and is dropped
    beat(registry, "head")
    registry.records()
    assert "tail" not in {r.node_id for r in registry.records()}
    clock.now += 20  # past the move grace: still expected back (a slow restart)
    beat(registry, "head")
    assert balancer.coverage_on_its_way(MODEL)
    clock.now += 41  # past the restart grace: no prospect left
    beat(registry, "head")
    assert not balancer.coverage_on_its_way(MODEL)
    assert Balancer(registry, {MODEL: COSTS}, Counter(), move_grace_s=90.0,
                    restart_grace_s=5.0).restart_grace_s == 90.0  # fmt: skip


def test_an_assignment_resolves_the_requested_precision_for_the_model():
    """A node asking for auto, int4 or fp8 is priced at what it would serve the model at."""
    clock = Clock()
    registry = Registry(1.0, clock=clock)
    registry.note_model(MODEL, 12)
    fp8 = ModelCosts(12, (1_000_000,) * 12, (0,) * 12, 1000, 1000, 1000, 64, native="fp8",
                     layer_packed=(1_000_000,) * 12, layer_packed_bytes=(1_000_100,) * 12)  # fmt: skip
    balancer = Balancer(registry, {MODEL: fp8}, Counter(), clock=clock)
    memory = node_memory(4)  # four layers at bfloat16
    auto = balancer.assign(AssignRequest(node_id="a", memory_bytes=memory, device="cpu",
                                         kv_tokens=16, quantization="auto"))  # fmt: skip
    assert auto.precision is Precision.FP8 and len(auto.layers) > 4
    int4 = balancer.assign(AssignRequest(node_id="b", memory_bytes=memory, device="cpu",
                                         kv_tokens=16, quantization="int4",
                                         quant_group_size=32))  # fmt: skip
    assert int4.precision is Precision.INT4 and int4.layers == LayerRange(auto.layers.end, 12)

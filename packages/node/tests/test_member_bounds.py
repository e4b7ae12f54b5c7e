"""Work a member may ask of a node is bounded per caller (issue 52 item 9): promises of
cached prefixes under ever fresh session ids, and audit recomputations (each a prefill).
Counted in objects held and requests admitted; the token window runs on an injected clock."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from meshnet_common import wire
from meshnet_common.errors import RateLimited
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import H_START_LAYER
from meshnet_node.caching.blocks import block_hashes, seed_of
from meshnet_node.caching.store import MAX_PINS, MAX_PINS_PER_PEER, PIN_S, PrefixCache
from meshnet_node.runtime import build_runtime, create_app
from meshnet_node.settings import NodeSettings
from meshnet_node.verification.admission import PeerAdmission
from meshnet_node.verification.audit import RECOMPUTE_PATH, RECOMPUTES_PER_CALLER

SEED = seed_of("meshnet-tiny/any")
IDS = list(range(256))
HASHES = block_hashes(SEED, IDS)


async def no_route(_model_id, _exclude=frozenset()):
    return ()


def cache_with_an_entry(clock=lambda: 0.0) -> PrefixCache:
    cache = PrefixCache(clock=clock)
    cache.save(HASHES, IDS, object(), 0)  # the entry's cache is never read here
    return cache


# -- promises of cached prefixes -----------------------------------------------------------


def test_a_member_probing_under_fresh_session_ids_holds_a_bounded_number_of_promises():
    cache = cache_with_an_entry()
    for i in range(10 * MAX_PINS_PER_PEER):
        assert cache.pin(f"fresh-{i}", HASHES, peer="node:m") == 2
    assert cache.promises("node:m") == MAX_PINS_PER_PEER  # the oldest were taken back
    assert cache.pin("honest", HASHES, peer="node:h") == 2
    assert cache.promises("node:h") == 1 and cache.promises() == MAX_PINS_PER_PEER + 1
    last = f"fresh-{10 * MAX_PINS_PER_PEER - 1}"
    assert cache.take(last, tuple(HASHES), 0) is not None  # the newest still holds
    assert cache.promises("node:m") == MAX_PINS_PER_PEER - 1
    for i in range(2 * MAX_PINS_PER_PEER):  # the head's own, one per session it opens
        cache.pin(f"own-{i}", HASHES)
    assert cache.promises("") == 2 * MAX_PINS_PER_PEER


def test_all_callers_together_hold_a_bounded_number_of_promises():
    clock = [0.0]
    cache = cache_with_an_entry(lambda: clock[0])
    peers = 2 * MAX_PINS // MAX_PINS_PER_PEER
    for p in range(peers):
        for i in range(MAX_PINS_PER_PEER):
            cache.pin(f"{p}-{i}", HASHES, peer=f"node:{p}")
    assert cache.promises() == MAX_PINS
    assert cache.evict(10_000) == 0  # promised: it stays
    clock[0] += PIN_S + 1  # every promise lapses: the entry's count of them is back to 0
    assert cache.evict(10_000) == 256 and cache.promises() == 0


def test_the_probe_route_bounds_a_callers_promises(tiny_snapshot):
    settings = NodeSettings(model_id="meshnet-tiny/llama", model_path=tiny_snapshot("llama"),
                            layers=LayerRange(0, 2), quantization=Precision.FLOAT32,
                            prefix_cache=True)  # fmt: skip
    runtime = build_runtime(settings, route_provider=no_route)
    cache = runtime.service.stage.sessions.prefix
    cache.save(HASHES, IDS, object(), 0)
    with TestClient(create_app(runtime)) as client:
        for i in range(3 * MAX_PINS_PER_PEER):
            resp = client.post(f"/v1/node/prefix/{i:032x}", json={"blocks": HASHES})
            assert resp.json() == {"held": 2}
    assert cache.promises() == MAX_PINS_PER_PEER
    assert cache.promises("addr:testclient") == MAX_PINS_PER_PEER  # no certificates: by address


# -- audit recomputations --------------------------------------------------------------------


def test_recomputations_are_bounded_per_caller_running_and_per_window():
    clock = [0.0]
    admission = PeerAdmission(max_running=2, max_total=3, window_s=60.0, clock=lambda: clock[0])
    first, second = admission.admit("a", 10, 100), admission.admit("a", 10, 100)
    with pytest.raises(RateLimited):  # a third at once
        admission.admit("a", 10, 100)
    third = admission.admit("b", 10, 100)  # another caller's share is its own
    with pytest.raises(RateLimited):  # all callers together
        admission.admit("c", 10, 100)
    assert admission.running == 3
    for release in (first, second, third, first):  # a second release changes nothing
        release()
    assert admission.running == 0
    admission.admit("a", 70, 100)()  # 90 of 100 spent in this window
    with pytest.raises(RateLimited) as info:
        admission.admit("a", 20, 100)
    assert info.value.status == 429 and info.value.headers["retry-after"] == "6"
    clock[0] += 6.0  # 10 tokens back
    admission.admit("a", 20, 100)()
    clock[0] += 60.0  # idle for a window: forgotten
    admission.admit("b", 1, 100)()
    assert admission.callers() == 1


def test_the_recompute_route_refuses_a_caller_beyond_its_share(tiny_snapshot):
    settings = NodeSettings(model_id="meshnet-tiny/llama", model_path=tiny_snapshot("llama"),
                            layers=LayerRange(0, 2), quantization=Precision.FLOAT32,
                            kv_budget_tokens=64)  # fmt: skip
    runtime = build_runtime(settings, route_provider=no_route)
    frame = wire.encode_tensor(torch.arange(1, 61, dtype=torch.int64).reshape(1, 60))
    answers = []
    with TestClient(create_app(runtime)) as client:
        for _ in range(3):  # 60 tokens each; 2 KV budgets (128 tokens) a window
            resp = client.post(RECOMPUTE_PATH, content=frame, headers={H_START_LAYER: "0"})
            answers.append(resp.status_code)
        error = resp.json()["error"]
    assert answers == [200, 200, 429], answers
    assert error["code"] == "rate_limit_exceeded" and int(resp.headers["retry-after"]) >= 1
    assert RECOMPUTES_PER_CALLER >= 1

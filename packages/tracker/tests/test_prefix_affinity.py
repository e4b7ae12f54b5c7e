"""Cache-aware routing on the tracker (docs/adr/0035): a request whose prompt starts like an
earlier one goes down the chain that computed it, while that chain still serves; made-up
swarms registered in-process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from meshnet_tracker.app import create_app
from meshnet_tracker.routing import PrefixAffinity, prefix_key
from meshnet_tracker.settings import TrackerSettings

MODEL = "org/affinity"
LAYERS = 8
SYSTEM = {"role": "system", "content": "a long system prompt"}


def chat(*turns: str, **extra) -> dict:
    return {"model": MODEL, "messages": [SYSTEM, *({"role": "user", "content": t}
                                                   for t in turns)], **extra}  # fmt: skip


def test_the_turns_of_a_chat_share_a_prefix_and_salts_or_keys_part_them():
    first = prefix_key(MODEL, chat("hello"))
    assert first is not None
    assert prefix_key(MODEL, chat("hello", "and then?")) == first  # a later turn
    assert prefix_key(MODEL, chat("another conversation")) != first
    assert prefix_key(MODEL, chat("hello", cache_salt="tenant-b")) != first
    assert prefix_key("org/other", chat("hello")) != first
    keyed = prefix_key(MODEL, chat("x", prompt_cache_key="agent-7"))
    assert keyed == prefix_key(MODEL, chat("y", prompt_cache_key="agent-7")) != first
    text = prefix_key(MODEL, {"prompt": "a" * 5000})
    assert text == prefix_key(MODEL, {"prompt": "a" * 5000 + "b"}) is not None
    assert prefix_key(MODEL, {"prompt": ["one", "two"]}) is None  # several prompts


def test_affinity_forgets_the_least_recently_used():
    affinity = PrefixAffinity(size=2)
    affinity.remember("a", (1,))
    affinity.remember("b", (2,))
    assert affinity.chain("a") == (1,)  # a is now the most recent
    affinity.remember("c", (3,))
    assert affinity.chain("b") is None and affinity.chain("a") == (1,)
    assert affinity.chain(None) is None


@pytest.fixture
def tracker() -> Iterator[TestClient]:
    settings = TrackerSettings(models_dir=None, verify_nodes=False)
    with TestClient(create_app(settings, node=None)) as client:
        yield client


def register(client: TestClient, node_id: str, start: int, end: int) -> dict:
    body = {
        "node_id": node_id, "url": f"http://{node_id}.test:8000", "url_explicit": True,
        "shard": {"model_id": MODEL, "shard_start": start, "shard_end": end},
        "num_layers": LAYERS, "quantization": "float32", "device": "cpu",
        "memory_declared_bytes": 1 << 30, "memory_free_bytes": 1 << 29,
    }  # fmt: skip
    resp = client.post("/v1/nodes/register", json=body)
    assert resp.status_code == 200, resp.text
    beat = {"node_id": node_id, "state": "serving", "active_sessions": 0, "kv_tokens": 0,
            "memory_free_bytes": 1}  # fmt: skip
    secret = {"x-meshnet-node-secret": resp.json()["node_secret"]}
    assert client.post("/v1/nodes/heartbeat", json=beat, headers=secret).status_code == 200
    return secret


def ids(hops) -> list[str]:
    return [h.node.node_id for h in hops]


def test_a_prefix_goes_down_the_chain_it_went_before_while_that_chain_serves(tracker):
    secrets = {n: register(tracker, n, s, e)
               for n, s, e in (("a1", 0, 4), ("a2", 4, 8), ("b1", 0, 4), ("b2", 4, 8))}  # fmt: skip
    state = tracker.app.state.tracker
    key = prefix_key(MODEL, chat("hello"))
    usual = ids(state.route(MODEL))
    other = [n for n in ("a1", "a2", "b1", "b2") if n[0] != usual[0][0]]  # the other replicas
    nodes = {n.node_id: n for n in state.model(MODEL).serving}
    state.affinity.remember(key, tuple((n, nodes[n].layers, nodes[n].layers.start) for n in other))
    assert all(ids(state.route(MODEL, prefix=key)) == other for _ in range(20))
    assert ids(state.route(MODEL, prefix=prefix_key(MODEL, chat("new")))) == usual
    # A hop to avoid (it failed) or gone from the map: routing as before.
    avoid = frozenset({nodes[other[1]].url})
    assert other[1] not in ids(state.route(MODEL, prefix=key, exclude_urls=avoid))
    gone = tracker.delete(f"/v1/nodes/{other[0]}", headers=secrets[other[0]])  # it leaves
    assert gone.status_code in (200, 204), gone.text
    assert ids(state.route(MODEL, prefix=key)) == usual

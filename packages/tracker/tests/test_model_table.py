"""The tracker's model table against a member (docs/adr/0032): a layer count comes from the
models dir or from a called-back serving node, never from a joining registration, and a
called-back node that disagrees is refused; models nothing holds expire; the models one
source address introduces are bounded. In-process, no sockets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from meshnet_common.protocol import Heartbeat, NodeAnnouncement
from meshnet_tracker.app import create_app
from meshnet_tracker.coverage import UNHELD_MODEL_TTL_S
from meshnet_tracker.registry import Registry
from meshnet_tracker.settings import TrackerSettings

MODEL = "org/table"
SECRET = "x-meshnet-node-secret"


def announcement(node_id: str, num_layers: int = 4, model: str = MODEL, **changes) -> dict:
    return {
        "node_id": node_id, "url": f"http://{node_id}.test:8000",
        "shard": {"model_id": model, "shard_start": 0, "shard_end": 4},
        "num_layers": num_layers, "quantization": "float32", "device": "cpu",
        "memory_declared_bytes": 1 << 30, "memory_free_bytes": 1 << 29, **changes,
    }  # fmt: skip


def tracker(**settings) -> Iterator[TestClient]:
    config = TrackerSettings(models_dir=None, verify_nodes=False, **settings)
    with TestClient(create_app(config, node=None)) as client:
        yield client


@pytest.fixture
def client() -> Iterator[TestClient]:
    yield from tracker()


def layers_of(client: TestClient, model: str) -> int | None:
    models = {m["id"]: m for m in client.get("/v1/coverage").json()["models"]}
    return models[model]["num_layers"] if model in models else None


def test_a_joining_registration_does_not_set_a_models_layer_count(client):
    """The first registration's count used to be kept for ever: a member announcing 40
    layers while joining locked out every honest node of the model."""
    poison = client.post("/v1/nodes/register", json=announcement("poison", 40, state="joining"))
    assert poison.status_code == 200
    honest = client.post("/v1/nodes/register", json=announcement("honest", 4))
    assert honest.status_code == 200, honest.text
    assert client.app.state.tracker.registry.num_layers(MODEL) == 4


def test_a_called_back_node_that_disagrees_is_refused_not_adopted(client):
    assert client.post("/v1/nodes/register", json=announcement("first", 4)).status_code == 200
    for state in ("serving", "joining"):
        other = client.post("/v1/nodes/register", json=announcement("other", 8, state=state))
        assert other.status_code == 400 and other.json()["error"]["param"] == "num_layers"
    assert client.app.state.tracker.registry.num_layers(MODEL) == 4 == layers_of(client, MODEL)


def test_models_one_source_introduces_are_bounded():
    for client in tracker(max_models_per_source=2):
        for node_id, model in (("a", "org/a"), ("b", "org/b"), ("b2", "org/b")):
            resp = client.post("/v1/nodes/register", json=announcement(node_id, model=model))
            assert resp.status_code == 200, resp.text
        refused = client.post("/v1/nodes/register", json=announcement("c", model="org/c"))
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "too_many_models"
        assert client.app.state.tracker.registry.num_layers("org/c") is None


def beat(node_id: str) -> Heartbeat:
    return Heartbeat(node_id=node_id, state="serving", active_sessions=0, kv_tokens=0,
                     memory_free_bytes=1)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_models_no_node_holds_expire_unless_the_models_dir_lists_them():
    clock = Clock()
    registry = Registry(2.0, clock=clock)
    registry.note_model("org/listed", 6)  # the models dir's
    for node_id, model in (("gone", "org/fake"), ("stays", MODEL)):
        ann = NodeAnnouncement.model_validate(announcement(node_id, model=model))
        registry.register(ann, called_back=True, source="10.0.0.9")
    registry.remove("gone")
    for _ in range(int(UNHELD_MODEL_TTL_S)):  # one heartbeat a second: "stays" stays
        clock.now += 1.0
        registry.heartbeat(beat("stays"))
    assert set(registry.coverage()) == {"org/listed", "org/fake", MODEL}  # not yet
    clock.now += 2.0
    registry.heartbeat(beat("stays"))
    assert set(registry.coverage()) == {"org/listed", MODEL}
    assert registry.num_layers("org/fake") is None
    assert registry.models.introduced_by("10.0.0.9") == 1  # the source may introduce again

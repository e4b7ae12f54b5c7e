"""Graceful drain (docs/adr/0024) in-process: LEAVING, no new sessions, exit 0 once idle."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from meshnet_common.errors import Draining, HopError
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import NodeState
from meshnet_node.runtime import build_runtime, create_app
from meshnet_node.settings import NodeSettings
from meshnet_node.swarm import drain as drain_module
from meshnet_node.swarm.drain import Drain, busy

MODEL_ID = "meshnet-tiny/llama"


async def no_route(_model_id, _exclude=frozenset()):
    return ()


def runtime_for(snapshot: Path, **overrides):
    settings = NodeSettings(model_id=MODEL_ID, model_path=snapshot, layers=LayerRange(0, 6),
                            quantization=Precision.FLOAT32, **overrides)  # fmt: skip
    return build_runtime(settings, route_provider=no_route)


@pytest.fixture(scope="module")
def snapshot(tiny_snapshot) -> Path:
    return tiny_snapshot("llama")


def test_a_drain_waits_for_held_sessions_then_exits_0(snapshot, monkeypatch):
    monkeypatch.setattr(drain_module, "POLL_S", 0.01)
    runtime = runtime_for(snapshot)
    exits: list[int] = []

    async def main():
        stage = runtime.service.stage
        stage.open_session("held", owner="k")
        drain = Drain(runtime, timeout_s=5.0, exit_with=exits.append)
        drain.start()
        drain.start()  # a second request changes nothing
        assert runtime.state == NodeState.LEAVING and runtime.announcement().state == "leaving"
        assert runtime.heartbeat().state == "leaving" and busy(runtime) == 1
        while drain.checks < 3:  # it has looked three times and found the session held
            await asyncio.sleep(0.01)
        assert exits == []  # a session is still held
        stage.close_session("held")
        await asyncio.wait_for(drain.task, 2.0)

    asyncio.run(main())
    assert exits == [0]


def test_a_drain_that_times_out_exits_0_anyway(snapshot, monkeypatch):
    monkeypatch.setattr(drain_module, "POLL_S", 0.01)
    runtime = runtime_for(snapshot)
    exits: list[int] = []

    async def main():
        runtime.service.stage.open_session("stuck", owner="k")
        drain = Drain(runtime, timeout_s=0.1, exit_with=exits.append)
        drain.start()
        await asyncio.wait_for(drain.task, 2.0)

    asyncio.run(main())
    assert exits == [0]


def test_a_draining_node_opens_no_session_and_names_itself(snapshot):
    runtime = runtime_for(snapshot)
    runtime.service.draining = "http://me.test:1"
    with TestClient(create_app(runtime)) as client:
        resp = client.post("/v1/completions", json={"model": MODEL_ID, "prompt": "hi"})
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "draining" and error["param"] == "http://me.test:1"
    relayed = HopError("hop failed", status=503, hop="http://first.test",
                       body=Draining("http://me.test:1").to_openai())  # fmt: skip
    assert relayed.failed_url == "http://me.test:1"  # the head avoids the draining node


def test_drain_on_request_needs_the_operator_token_not_the_swarm_token(snapshot):
    runtime = runtime_for(snapshot, swarm_token="s3cret", operator_token="op-secret")
    swarm = {"x-meshnet-swarm-token": "s3cret"}
    operator = {**swarm, "x-meshnet-operator-token": "op-secret"}
    with TestClient(create_app(runtime)) as client:
        assert client.post("/v1/node/drain").status_code == 401
        # Every node holds the swarm token: it drains nothing (docs/adr/0032).
        resp = client.post("/v1/node/drain", headers=swarm)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "operator_only"
        wrong = {**swarm, "x-meshnet-operator-token": "guess"}
        assert client.post("/v1/node/drain", headers=wrong).status_code == 401
        resp = client.post("/v1/node/drain", headers=operator)
        assert resp.status_code == 400  # built in-process: nothing here can exit
        runtime.drain = Drain(runtime, timeout_s=1.0, exit_with=lambda code: None)
        resp = client.post("/v1/node/drain", headers=operator)
        assert resp.status_code == 202 and resp.json()["state"] == "leaving"
        assert client.get("/v1/node", headers=swarm).json()["state"] == "leaving"


def test_without_an_operator_token_no_request_drains_a_node(snapshot):
    runtime = runtime_for(snapshot)
    runtime.drain = Drain(runtime, timeout_s=1.0, exit_with=lambda code: None)
    with TestClient(create_app(runtime)) as client:
        resp = client.post("/v1/node/drain", headers={"x-meshnet-operator-token": "anything"})
        assert resp.status_code == 401 and "--operator-token" in resp.json()["error"]["message"]
        assert client.get("/v1/node").json()["state"] != "leaving"

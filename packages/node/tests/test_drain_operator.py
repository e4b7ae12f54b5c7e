"""Draining a node over HTTP is an operator action (docs/adr/0032, issue 35): it takes the
node's --operator-token, never the swarm token alone. In-process, no sockets."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.cli import build_parser
from meshnet_node.runtime import build_runtime, create_app
from meshnet_node.settings import NodeSettings
from meshnet_node.swarm import drain as drain_module
from meshnet_node.swarm.drain import Drain

MODEL_ID = "meshnet-tiny/llama"
SWARM = {"x-meshnet-swarm-token": "swarm-s3cret"}
OPERATOR_TOKEN = "op-xyzzy-35"


async def no_route(_model_id, _exclude=frozenset()):
    return ()


@pytest.fixture(scope="module")
def snapshot(tiny_snapshot) -> Path:
    return tiny_snapshot("llama")


def runtime_for(snapshot: Path, exits: list[int], **overrides):
    settings = NodeSettings(model_id=MODEL_ID, model_path=snapshot, layers=LayerRange(0, 6),
                            quantization=Precision.FLOAT32, **overrides)  # fmt: skip
    runtime = build_runtime(settings, route_provider=no_route)
    runtime.drain = Drain(runtime, timeout_s=5.0, exit_with=exits.append)  # as meshnet-node
    return runtime


def wait_until(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_operator_token_comes_from_its_flag_or_the_env_and_is_never_shown(monkeypatch):
    monkeypatch.delenv("MESHNET_OPERATOR_TOKEN", raising=False)
    parser = build_parser()
    assert "--operator-token" in parser.format_help()
    assert "MESHNET_OPERATOR_TOKEN" in parser.format_help()
    assert NodeSettings.from_args(parser.parse_args([])).operator_token is None

    settings = NodeSettings.from_args(parser.parse_args(["--operator-token", OPERATOR_TOKEN]))
    assert settings.operator_token == OPERATOR_TOKEN
    assert OPERATOR_TOKEN not in repr(settings) and OPERATOR_TOKEN not in str(settings)

    monkeypatch.setenv("MESHNET_OPERATOR_TOKEN", "op-from-env")
    assert NodeSettings.from_args(parser.parse_args([])).operator_token == "op-from-env"
    flagged = NodeSettings.from_args(parser.parse_args(["--operator-token", OPERATOR_TOKEN]))
    assert flagged.operator_token == OPERATOR_TOKEN  # the flag wins over the env


def test_only_the_operator_token_drains_and_the_node_then_finishes_and_exits_0(
    snapshot, monkeypatch
):
    monkeypatch.setattr(drain_module, "POLL_S", 0.01)
    exits: list[int] = []
    runtime = runtime_for(snapshot, exits, swarm_token="swarm-s3cret",
                          operator_token=OPERATOR_TOKEN)  # fmt: skip
    stage = runtime.service.stage
    stage.open_session("held", owner="k")
    operator = {"x-meshnet-operator-token": OPERATOR_TOKEN}
    with TestClient(create_app(runtime)) as client:

        def state() -> str:
            return client.get("/v1/node", headers=SWARM).json()["state"]

        refusals = [
            ({}, 401),
            (SWARM, 401),  # every node holds the swarm token: it drains nothing
            ({**SWARM, "x-meshnet-operator-token": "op-guess"}, 401),
            ({**SWARM, "x-meshnet-operator-token": OPERATOR_TOKEN[:-1]}, 401),
            ({**SWARM, "x-meshnet-operator-token": ""}, 401),
            (operator, 401),  # the swarm token still guards /v1/node: both are needed
        ]
        for headers, status in refusals:
            resp = client.post("/v1/node/drain", headers=headers)
            assert resp.status_code == status, headers
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        refused = client.post("/v1/node/drain", headers=SWARM).json()["error"]
        assert refused["code"] == "operator_only" and refused["type"] == "authentication_error"
        assert "--operator-token" in refused["message"]
        assert "start it with one" not in refused["message"]  # it has one: the caller lacks it
        assert state() == "serving" and not runtime.drain.draining and not runtime.service.draining

        resp = client.post("/v1/node/drain", headers={**SWARM, **operator})
        assert resp.status_code == 202
        assert resp.json() == {"state": "leaving", "open": 1, "timeout_s": 5.0}
        assert state() == "leaving" and runtime.service.draining == runtime.url
        # It opens no new session while it finishes the one it holds.
        body = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 1}
        busy = client.post("/v1/completions", json=body, headers=SWARM)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "draining"
        wait_until(lambda: runtime.drain.checks >= 3)  # it looked three times
        assert exits == []  # the held session keeps it up
        stage.close_session("held")
        wait_until(lambda: exits == [0])
        # A second request changes nothing (the drain is under way or done).
        assert client.post("/v1/node/drain", headers={**SWARM, **operator}).status_code == 202
    assert exits == [0]


@pytest.mark.parametrize("configured", [None, ""])
def test_a_node_without_an_operator_token_refuses_every_drain_request(snapshot, configured):
    exits: list[int] = []
    runtime = runtime_for(snapshot, exits, operator_token=configured)
    with TestClient(create_app(runtime)) as client:
        for offered in (None, "", "anything", "None"):
            headers = {} if offered is None else {"x-meshnet-operator-token": offered}
            resp = client.post("/v1/node/drain", headers=headers)
            assert resp.status_code == 401
            error = resp.json()["error"]
            assert error["code"] == "operator_only"
            # The answer says how: start the node with --operator-token; SIGTERM is local.
            assert "--operator-token" in error["message"] and "SIGTERM" in error["message"]
        assert client.get("/v1/node").json()["state"] == "serving"
    assert not runtime.drain.draining and exits == []

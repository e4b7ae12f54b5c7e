"""A client-supplied route (``x-meshnet-route``) steers a head's activations to other hosts
(issue #52, docs/adr/0032): with a swarm token it needs the token; without one (a loopback
swarm) it may only name loopback hops, unless --insecure opened the swarm. Nor does a head
answer a page whose Host name was rebound to its loopback address (421)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import H_ROUTE, H_SWARM_TOKEN
from meshnet_node.runtime import build_runtime, create_app
from meshnet_node.settings import NodeSettings

MODEL_ID = "meshnet-tiny/llama"
BODY = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def head_for(tiny_snapshot):
    def build(**overrides) -> Iterator[TestClient]:
        settings = NodeSettings(
            model_id=MODEL_ID, model_path=tiny_snapshot("llama"), layers=LayerRange(0, 6),
            quantization=Precision.FLOAT32, **overrides,
        )  # fmt: skip

        async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
            return ()

        app = create_app(build_runtime(settings, route_provider=no_route))
        return TestClient(app, raise_server_exceptions=False)

    return build


def test_without_a_token_a_route_off_loopback_is_refused(head_for):
    with head_for() as head:
        resp = head.post("/v1/completions", json=BODY, headers={H_ROUTE: "http://10.9.8.7:9000"})
        assert resp.status_code == 401, resp.text
        assert "--swarm-token" in resp.json()["error"]["message"]
        mixed = "http://127.0.0.1:9,http://attacker.example:80"
        assert head.post("/v1/completions", json=BODY, headers={H_ROUTE: mixed}).status_code == 401
        # a loopback route passes this check (what comes after is not this test's)
        local = head.post("/v1/completions", json=BODY, headers={H_ROUTE: "http://127.0.0.1:9"})
        assert local.status_code != 401, local.text


def test_with_a_token_a_route_needs_it_and_may_name_any_member(head_for):
    with head_for(swarm_token="swarm-1", host="127.0.0.1") as head:
        route = {H_ROUTE: "http://10.9.8.7:9000"}
        assert head.post("/v1/completions", json=BODY, headers=route).status_code == 401
        with_token = head.post(
            "/v1/completions", json=BODY, headers={**route, H_SWARM_TOKEN: "swarm-1"}
        )
        assert with_token.status_code != 401, with_token.text


def test_a_rebound_host_name_reaches_no_head(head_for):
    with head_for() as head:
        resp = head.post("/v1/completions", json=BODY, headers={"host": "rebind.example:8000"})
        assert resp.status_code == 421 and resp.json()["error"]["code"] == "host_not_allowed"

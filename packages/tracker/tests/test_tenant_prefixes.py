"""Tenants keep their cached prompts apart (docs/adr/0035, issue 52): with several API keys, a
prompt's blocks are named from the key it came with, so that a second key asking for the
first key's prompt reports no cached tokens (nor gains its time to first token). Through the
tracker node in-process, and through a tracker proxying to a head that never sees the key:
the tracker names the key's tenant beside the swarm token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request
from test_tracker_api import LLAMA, AppsTransport, register

from meshnet_common.errors import InvalidRequest
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import H_CLIENT_TENANT, H_SWARM_TOKEN
from meshnet_common.web.auth import key_tenant, swarm_headers, tenant_of
from meshnet_node.runtime import build_runtime
from meshnet_node.runtime import create_app as create_node_app
from meshnet_node.settings import NodeSettings
from meshnet_tracker.app import create_app
from meshnet_tracker.heads import RemoteHead
from meshnet_tracker.settings import TrackerSettings
from meshnet_tracker.tracker_node import TrackerNode

TOKEN = "swarm-secret"
PROMPT = " ".join(f"clause {i} of the first tenant's private contract" for i in range(12))


async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
    return ()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def cached(client: TestClient, headers: dict[str, str]) -> int:
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    resp = client.post("/v1/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] > 256  # two blocks at least
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "keys"
    path.write_text("key-one\nkey-two\n")
    return path


@pytest.fixture(scope="module")
def llama_snapshot(tiny_snapshot) -> Path:
    return tiny_snapshot("llama")


def test_a_second_key_sees_no_cached_tokens_of_the_firsts_prompt(models_dir, llama_snapshot,
                                                                 key_file):  # fmt: skip
    """The tracker node answers in-process: the head sees the key itself."""
    settings = TrackerSettings(
        models_dir=models_dir, model_id=LLAMA, shard_start=0, shard_end=6,
        quantization="float32", verify_nodes=False, api_key_file=key_file, prefix_cache=True,
    )  # fmt: skip
    node = TrackerNode.build(settings, llama_snapshot, "http://127.0.0.1:8080")
    with TestClient(create_app(settings, node)) as tracker:
        assert cached(tracker, bearer("key-one")) == 0
        assert cached(tracker, bearer("key-one")) > 0  # the key's own repeat
        assert cached(tracker, bearer("key-two")) == 0  # another key: nothing of it
        assert cached(tracker, bearer("key-two")) > 0


def test_a_head_behind_the_tracker_keeps_keys_apart_without_seeing_them(
    models_dir, llama_snapshot, key_file
):
    """The tracker checks the keys and names each one's tenant to the head beside the swarm
    token; the head holds no key (and would need none of the client's Authorization)."""
    settings = NodeSettings(model_id=LLAMA, model_path=llama_snapshot, layers=LayerRange(0, 6),
                            quantization=Precision.FLOAT32, swarm_token=TOKEN,
                            prefix_cache=True)  # fmt: skip
    runtime = build_runtime(settings, route_provider=no_route)
    tracker_settings = TrackerSettings(
        models_dir=models_dir, verify_nodes=False, swarm_token=TOKEN, api_key_file=key_file
    )
    with (
        TestClient(create_node_app(runtime)) as head,
        TestClient(create_app(tracker_settings, node=None)) as tracker,
    ):
        tracker.headers[H_SWARM_TOKEN] = TOKEN  # as a node registers
        register(tracker, node_id="node", start=0, end=6)
        del tracker.headers[H_SWARM_TOKEN]
        state = tracker.app.state.tracker
        unused = state.client
        state.client = httpx.AsyncClient(transport=AppsTransport({"node.test": head.app}),
                                         headers=swarm_headers(TOKEN))  # fmt: skip
        asyncio.run(unused.aclose())
        assert cached(tracker, bearer("key-one")) == 0
        assert cached(tracker, bearer("key-one")) > 0
        assert cached(tracker, bearer("key-two")) == 0
        # Without the client's Authorization, the tenant the tracker names is what counts
        # (docs/adr/0032: the tracker need not forward the client's key).
        one = {H_SWARM_TOKEN: TOKEN, H_CLIENT_TENANT: key_tenant("key-one")}
        assert cached(head, one) > 0
        # A caller without the swarm token names no tenant: the shared cache, not key-one's.
        assert cached(head, {H_CLIENT_TENANT: key_tenant("key-one")}) == 0


def test_who_names_the_tenant():
    tenant = key_tenant("key-one")
    assert len(tenant) == 32 and "key-one" not in tenant
    trusted = {H_SWARM_TOKEN: TOKEN, H_CLIENT_TENANT: tenant, **bearer("key-two")}
    assert tenant_of(trusted, keyed=True, swarm_token=TOKEN) == tenant  # the tracker's word
    forged = {H_CLIENT_TENANT: tenant, **bearer("key-two")}
    assert tenant_of(forged, keyed=True, swarm_token=TOKEN) == key_tenant("key-two")
    assert tenant_of({H_CLIENT_TENANT: tenant}, keyed=False, swarm_token=TOKEN) is None
    assert tenant_of(bearer("key-two"), keyed=False, swarm_token=None) is None  # keys unchecked
    assert tenant_of({H_CLIENT_TENANT: tenant}, keyed=False, swarm_token=None) == tenant  # open
    with pytest.raises(InvalidRequest) as info:
        tenant_of({H_SWARM_TOKEN: TOKEN, H_CLIENT_TENANT: "key-one"}, keyed=False,
                  swarm_token=TOKEN)  # fmt: skip
    assert info.value.status == 400


def test_the_proxied_request_names_the_tenant_not_the_key():
    seen: list[httpx.Headers] = []

    def head(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={"ok": True})

    async def run() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(head))
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
                 "client": ("203.0.113.9", 51000), "query_string": b""}  # fmt: skip
        try:
            await RemoteHead(client, "http://head.test", tenant=key_tenant("k")).answer(
                "/v1/completions", Request(scope), (), b"{}"
            )
        finally:
            await client.aclose()

    asyncio.run(run())
    assert seen[0][H_CLIENT_TENANT] == key_tenant("k")

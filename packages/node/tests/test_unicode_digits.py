"""Numbers a client or a peer writes as text (a ``logit_bias`` key, a position or layer
header) are ASCII digits: ``"²".isdigit()`` is true but ``int("²")`` raises, which used to
answer 500. Each such value is a 400 naming it, and the node keeps serving (issue 52)."""

from __future__ import annotations

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from meshnet_common import wire
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import H_POSITION, H_START_LAYER
from meshnet_node.runtime import build_runtime, create_app
from meshnet_node.settings import NodeSettings

MODEL_ID = "meshnet-tiny/llama"
BASE = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
SUPERSCRIPT = "²".encode("latin-1")  # a header as a server reads it: "²"


@pytest.fixture(scope="module")
def client(tiny_snapshot):
    settings = NodeSettings(model_id=MODEL_ID, model_path=tiny_snapshot("llama"),
                            layers=LayerRange(0, 6), quantization=Precision.FLOAT32)  # fmt: skip

    async def no_route(_model_id, _exclude=frozenset()):
        return ()

    with TestClient(create_app(build_runtime(settings, route_provider=no_route))) as client:
        yield client


def _raw_post(client: TestClient, path: str, content: bytes, headers: dict[str, bytes]):
    """A POST whose header bytes reach the app as they are (``TestClient`` re-encodes
    them as UTF-8, so "²" would arrive as "Â²"), on the app's own event loop."""

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as raw:
            return await raw.post(path, content=content, headers=headers)

    return client.portal.call(post)


def _refused(resp, param: str) -> None:
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def _still_serving(client) -> None:
    assert client.post("/v1/completions", json=BASE).status_code == 200


@pytest.mark.parametrize("key", ["²", "٣", "1²"])
def test_a_logit_bias_key_of_unicode_digits_is_a_400(client, key):
    _refused(client.post("/v1/completions", json={**BASE, "logit_bias": {key: 5}}), "logit_bias")
    _still_serving(client)


def test_a_position_or_layer_header_of_unicode_digits_is_a_400(client):
    answer = _raw_post(client, "/v1/answers/abcdef0123", b"{}", {H_POSITION: SUPERSCRIPT})
    _refused(answer, H_POSITION)
    frame = wire.encode_tensor(torch.tensor([[1, 5, 9]]))
    audit = _raw_post(client, "/v1/node/audit/recompute", frame, {H_START_LAYER: SUPERSCRIPT})
    _refused(audit, H_START_LAYER)
    _still_serving(client)

"""The request bounds (issue #35) are a head's knobs: the tracker offers them for its own
tracker node, and judges no body it proxies (the head it routes to applies its own), so
the two never disagree on a request."""

from __future__ import annotations

import asyncio

import httpx
from fastapi.testclient import TestClient
from test_tracker_api import LLAMA, AppsTransport, assert_error, register

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.runtime import build_runtime
from meshnet_node.runtime import create_app as create_node_app
from meshnet_node.settings import NodeSettings
from meshnet_tracker.app import create_app
from meshnet_tracker.cli import build_parser
from meshnet_tracker.settings import TrackerSettings

BOUNDS = ("max_prompts", "max_choices", "max_stop_chars", "max_schema_chars", "prepare_timeout_s")


def test_the_tracker_nodes_bounds_are_the_trackers_flags():
    flags = ["--max-prompts", "2", "--max-choices", "3", "--max-stop-chars", "4",
             "--max-schema-chars", "40", "--prepare-timeout", "0.5"]  # fmt: skip
    tracker = TrackerSettings.from_args(build_parser().parse_args(flags))
    node = NodeSettings.exactly(**tracker.shard_values())  # as TrackerNode.build does
    assert [getattr(node, name) for name in BOUNDS] == [2, 3, 4, 40, 0.5]


def test_a_proxied_request_is_judged_by_its_heads_bounds_not_the_trackers(
    models_dir, tiny_snapshot
):
    snapshot = tiny_snapshot("llama")

    async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
        raise AssertionError("the tracker must send the route")

    head = NodeSettings(
        model_id=LLAMA, model_path=snapshot, layers=LayerRange(0, 6),
        quantization=Precision.FLOAT32, max_prompts=2,
    )  # fmt: skip
    # --max-prompts 1 on the tracker bounds its own tracker node only (it has none here)
    settings = TrackerSettings(models_dir=models_dir, verify_nodes=False, max_prompts=1)
    with (
        TestClient(create_node_app(build_runtime(head, route_provider=no_route))) as node,
        TestClient(create_app(settings, node=None)) as tracker,
    ):
        register(tracker, node_id="node", start=0, end=6)
        state = tracker.app.state.tracker
        unused = state.client
        state.client = httpx.AsyncClient(transport=AppsTransport({"node.test": node.app}))
        asyncio.run(unused.aclose())
        body = {"model": LLAMA, "max_tokens": 2, "temperature": 0}
        three = tracker.post("/v1/completions", json={**body, "prompt": ["a", "b", "c"]})
        error = assert_error(three, 400, "invalid_request_error")
        assert error["code"] == "too_many_prompts" and "at most 2" in error["message"]
        two = tracker.post("/v1/completions", json={**body, "prompt": ["a", "b"]})
        assert two.status_code == 200 and len(two.json()["choices"]) == 2, two.text

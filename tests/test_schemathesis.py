"""Property tests of the HTTP surface of a tracker and of a (head + tail) node, in-process.

* schemathesis generates requests from each app's own OpenAPI schema (paths, path and query
  parameters, in positive and negative mode);
* hypothesis posts JSON-ish and raw bodies to the routes that parse bodies by hand (the
  schema does not describe them), fuzzes the forward data path's headers and tensor frames,
  and reads shard files with random query parameters and ``Range`` headers.

The contract everywhere: no server error except the deliberate ones (502 a hop is
unreachable, 503 the model is not covered or the node is full, 507 a joining node is too
small); every error is an OpenAI-style ``{"error": {...}}`` body; the app still answers
``/health`` afterwards and its background tasks are still running.

Apps run under a ``TestClient`` used as a context manager (lifespans and background tasks
run; no sockets). The outbound clients of both apps are replaced by ones that refuse every
connection, so fuzzed registrations or routes never send a request off the machine.

The inputs these tests first found to be 500s (integers too long to parse, deep nesting,
seeds outside 64 bits, tiny temperatures, non-string content parts, lone surrogates) are in
the strategies and pinned by the regression tests at the end of the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import schemathesis
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from inprocess_hops import HttpxHops
from schemathesis import GenerationMode

from meshnet_common import wire
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import (
    H_CHUNK,
    H_OPEN,
    H_POSITION,
    H_ROUTE,
    H_SAMPLE,
    H_SESSION,
    H_SESSION_KEY,
)
from meshnet_common.web.shards import ShardServer
from meshnet_node.runtime import NodeRuntime, build_runtime
from meshnet_node.runtime import create_app as create_node_app
from meshnet_node.settings import NodeSettings
from meshnet_tracker.app import create_app as create_tracker_app
from meshnet_tracker.settings import TrackerSettings

MODEL = "meshnet-tiny/llama"  # 6 layers, vocabulary of 512, context of 1024
VOCAB = 512
ERROR_KEYS = {"message", "type", "param", "code"}
# Server errors that are part of the API, by status: anything else >= 500 is a bug.
DELIBERATE_5XX = {
    502: {"upstream_error"},
    503: {"service_unavailable", "server_overloaded"},
    507: {"insufficient_memory"},
}

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCHEMA_FUZZ = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=list(HealthCheck),  # negative mode filters a lot on tiny schemas
)


# -- the apps ------------------------------------------------------------------------------


@dataclass
class Service:
    """One in-process app: its client, and a check that it is still alive."""

    name: str
    client: TestClient
    background: Callable[[], list]  # tasks that must still be running
    runtime: NodeRuntime | None = None

    def assert_alive(self) -> None:
        resp = self.client.get("/health")
        assert resp.status_code == 200, f"{self.name} /health: {resp.status_code} {resp.text}"
        assert resp.json()["status"] == "ok"
        dead = [task for task in self.background() if task.done()]
        assert not dead, f"{self.name}: background tasks died: {dead}"


def _refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("tests reach no network", request=request)


@pytest.fixture(scope="module")
def tracker(models_dir: Path, tiny_snapshot) -> Iterator[Service]:
    tiny_snapshot("llama")  # in the models dir before the tracker indexes it
    app = create_tracker_app(TrackerSettings(models_dir=models_dir, verify_nodes=False), node=None)
    app.state.tracker.client = app.state.tracker.callback = httpx.AsyncClient(
        transport=httpx.MockTransport(_refuse)
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        yield Service("tracker", client, list)


@pytest.fixture(scope="module")
def node(tiny_snapshot) -> Iterator[Service]:
    async def whole_model_here(model_id: str, exclude: frozenset[str] = frozenset()) -> tuple:
        return ()

    runtime: NodeRuntime = build_runtime(
        NodeSettings(
            model_id=MODEL,
            model_path=tiny_snapshot("llama"),
            layers=LayerRange(0, 6),
            quantization=Precision.FLOAT32,
        ),
        route_provider=whole_model_here,
    )
    refusing = httpx.AsyncClient(transport=httpx.MockTransport(_refuse))
    runtime.service.links.hops = HttpxHops(refusing)
    app = create_node_app(runtime)
    app.state.shards = ShardServer(runtime.own_snapshot)  # what meshnet-node's CLI does
    with TestClient(app, raise_server_exceptions=False) as client:
        yield Service("node", client, lambda: list(runtime.tasks), runtime)


@pytest.fixture
def service(request: pytest.FixtureRequest) -> Service:
    return request.getfixturevalue(request.param)


# -- the contract --------------------------------------------------------------------------


def check_response(resp: httpx.Response, what: str) -> None:
    """No unexpected server error; every error is an OpenAI-style body; JSON is JSON."""
    status = resp.status_code
    content_type = resp.headers.get("content-type", "")
    if status < 400:
        if content_type.startswith("application/json"):
            resp.json()
        return
    try:
        body = resp.json()
    except ValueError:
        pytest.fail(f"{what}: {status} with a body that is not JSON: {resp.text[:300]!r}")
    assert isinstance(body, dict) and set(body) == {"error"}, f"{what}: {status} {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, f"{what}: {status} {body!r}"
    assert isinstance(error["message"], str) and error["message"], f"{what}: {body!r}"
    if status >= 500:
        assert error["type"] in DELIBERATE_5XX.get(status, ()), (
            f"{what}: server error {status}: {body!r}"
        )


def _describe(method: str, path: str, headers=None, body: bytes | None = None, **extra) -> str:
    parts = [f"{method} {path}"]
    if headers:
        parts.append(f"headers={headers!r}")
    if body is not None:
        parts.append(f"body={body[:300]!r}{'...' if len(body) > 300 else ''}")
    parts.extend(f"{k}={v!r}" for k, v in extra.items() if v)
    return " ".join(parts)


# -- schemathesis: the OpenAPI schemas -----------------------------------------------------


def _send_case(client: TestClient, case) -> httpx.Response:
    kwargs = case.as_transport_kwargs(base_url=str(client.base_url))
    headers = dict(kwargs.get("headers") or {})
    if kwargs.get("cookies"):
        headers["cookie"] = "; ".join(f"{k}={v}" for k, v in kwargs["cookies"].items())
    body = {}
    if "json" in kwargs:
        body["json"] = kwargs["json"]
    elif isinstance(kwargs.get("data"), bytes | str):
        body["content"] = kwargs["data"]
    return client.request(
        kwargs["method"], kwargs["url"], headers=headers, params=kwargs.get("params"), **body
    )


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("service", ["tracker", "node"], indirect=True)
def test_openapi_schema(service: Service, mode: GenerationMode) -> None:
    """Every operation of the app's own schema, with generated path and query parameters."""
    schema = schemathesis.openapi.from_dict(service.client.get("/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 5, [op.label for op in operations]
    failures: list[str] = []
    fuzzed: list[str] = []
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not any(operation.iter_parameters()):
            continue  # nothing to make invalid

        @SCHEMA_FUZZ
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case) -> None:
            resp = _send_case(service.client, case)
            check_response(resp, f"{case.operation.label}: {case.as_curl_command()}")

        try:
            run()
        except Unsatisfiable:
            # e.g. a free-form string query parameter has no invalid values
            assert mode is GenerationMode.NEGATIVE, operation.label
            continue
        except AssertionError as exc:
            failures.append(str(exc))
        fuzzed.append(operation.label)
    assert fuzzed, "no operation could be fuzzed"
    service.assert_alive()
    assert not failures, "\n\n".join(failures)


# -- JSON-ish values -----------------------------------------------------------------------

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "n", "seed", "stop", "stream", "temperature",
    "top_p", "top_k", "logprobs", "echo", "user", "node_id", "url", "shard", "num_layers",
    "quantization", "dtype", "quant_group_size", "device", "memory_bytes", "memory_declared_bytes", "memory_free_bytes",
    "kv_tokens", "kv_budget_tokens", "state", "held_models", "active_sessions", "version",
]  # fmt: skip
BIG_INTS = [2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**300, -(10**300)]
# Never MODEL itself: a random object naming the served model and a prompt, without
# max_tokens, would generate 256 tokens.
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.sampled_from(BIG_INTS),
    st.floats(allow_nan=True, allow_infinity=True),  # json.dumps writes NaN / Infinity
    st.text(max_size=20),
    st.sampled_from(["\ud800", "a\udfffb"]),  # lone surrogates (json.dumps escapes them)
    st.sampled_from(FIELDS + ["", "user", "text", "serving", "float32", "http://x.test"]),
)
json_keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=10))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(json_keys, inner, max_size=5)
    ),
    max_leaves=16,
)
DROP = object()  # an override that removes the field


def dumps(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def near_valid(
    required: dict[str, st.SearchStrategy],
    optional: dict[str, st.SearchStrategy],
    broken: dict[str, st.SearchStrategy],
    extra: st.SearchStrategy[tuple] | None = None,
) -> st.SearchStrategy[dict]:
    """Valid messages, and valid messages with one field broken (``broken[field]`` draws
    the bad value, or DROP) or one unknown field added (``extra`` draws key and value)."""
    valid = st.fixed_dictionaries(required, optional=optional)
    change = st.one_of(
        st.sampled_from(sorted(broken)).flatmap(lambda key: st.tuples(st.just(key), broken[key])),
        extra if extra is not None else st.tuples(st.text(min_size=1, max_size=8), json_values),
    )

    def apply(pair) -> dict:
        body, (key, value) = pair
        body = dict(body)
        if value is DROP:
            body.pop(key, None)
        else:
            body[key] = value
        return body

    return st.one_of(valid, valid, st.tuples(valid, change).map(apply))


def junk(*values) -> st.SearchStrategy:
    """Bad values for a field: the given ones, any JSON value, or leaving the field out."""
    return st.one_of(st.sampled_from(values or [None]), json_values, st.just(DROP))


# -- OpenAI bodies -------------------------------------------------------------------------

# Valid max_tokens stay tiny (the tiny model generates fast); broken ones are rejected before
# any generation. max_tokens is never dropped or random: the default is 256 tokens.
bad_max_tokens = st.sampled_from([0, -1, 5000, 2**70, 1.5, "2", [1]])
SAMPLING_VALID = {
    "n": st.integers(1, 3),
    "temperature": st.one_of(
        st.just(0.0), st.floats(1e-3, 2.0), st.sampled_from([1e-300, 5e-324, 1e-40])
    ),
    "top_p": st.one_of(st.floats(1e-3, 1.0), st.sampled_from([1e-300, 5e-324])),
    "top_k": st.one_of(st.integers(0, VOCAB + 2), st.just(2**70)),
    "seed": st.integers(-(2**63), 2**63 - 16),
    "stop": st.one_of(
        st.none(), st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3))
    ),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=5),
}
SAMPLING_BROKEN = {
    "model": junk("meshnet-tiny/nope", "", "nope"),
    "max_tokens": bad_max_tokens,
    "n": junk(0, 9, -1, 2**64, 1.0, "1", True),
    "temperature": junk(-0.5, 2.5, math.nan, math.inf, -math.inf, "1"),
    "top_p": junk(0, -1, 1.5, math.nan, "0.5"),
    "top_k": junk(-1, 1.5, "3"),
    "seed": junk(1.5, "7", True, 2**64, -(2**63) - 1, 10**100),
    "stop": junk("", ["a", "b", "c", "d", "e"], [""], [1]),
    "stream": junk("yes"),
    "stream_options": junk({"include_usage": "x"}),
}
completion_bodies = near_valid(
    {
        "model": st.just(MODEL),
        "prompt": st.one_of(
            st.text(min_size=1, max_size=30),
            st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
        ),
        "max_tokens": st.integers(1, 3),
    },
    {**SAMPLING_VALID, "logprobs": st.integers(0, 5), "echo": st.booleans()},
    {
        **SAMPLING_BROKEN,
        "prompt": junk("", [], [-1], [VOCAB], [2**70], ["a", 1], [[1]], "\ud800", ["\udfff"]),
        "logprobs": junk(-1, 6, 1.5, "x"),
        "echo": junk("x"),
    },
)
content_parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "text", "image_url"])},
        optional={"text": st.text(max_size=10)},
    ),
    max_size=3,
)
ROLES = ["system", "user", "assistant", "tool", "developer"]
chat_bodies = near_valid(
    {
        "model": st.just(MODEL),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(ROLES)},
                optional={"content": st.one_of(st.none(), st.text(max_size=30), content_parts)},
            ),
            min_size=1,
            max_size=3,
        ),
        "max_tokens": st.integers(1, 3),
    },
    {
        **SAMPLING_VALID,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 20),
        "max_completion_tokens": st.integers(1, 3),
    },
    {
        **SAMPLING_BROKEN,
        "messages": junk(
            [],
            [{"role": "bot", "content": "x"}],
            [{"content": "x"}],
            "hi",
            [1],
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            [{"role": "user", "content": "\ud800"}],
        ),
        "logprobs": junk("x"),
        "top_logprobs": junk(-1, 21, "x"),
        "max_completion_tokens": junk(0, -1, "x"),
    },
)

# -- node messages (tracker) ---------------------------------------------------------------

node_ids = st.from_regex(r"[A-Za-z0-9._-]{1,12}", fullmatch=True)
bad_node_ids = junk("", "a" * 65, "a b", "ü", "../x")
sizes = st.one_of(st.integers(0, 2**40), st.just(2**2000))
bad_sizes = junk(-1, 1.5, "1")
precisions = st.sampled_from([p.value for p in Precision])
quantizations = st.sampled_from(["auto", *(p.value for p in Precision)])  # what a node asks
dtypes = st.sampled_from(["bfloat16", "float32"])
group_sizes = st.sampled_from([32, 64, 128])
states = st.sampled_from(["joining", "serving", "leaving"])


@st.composite
def shard_specs(draw) -> dict:
    start = draw(st.integers(0, 5))
    end = draw(st.integers(start + 1, 6))
    return {"model_id": MODEL, "shard_start": start, "shard_end": end}


announcements = near_valid(
    {
        "node_id": node_ids,
        "url": st.sampled_from(
            ["http://fuzz-a.test:8000", "https://fuzz-b.test", "http://c.test/"]
        ),
        "shard": shard_specs(),
        "num_layers": st.just(6),
        "quantization": precisions,
        "device": st.text(max_size=32),
        "memory_declared_bytes": sizes,
        "memory_free_bytes": sizes,
    },
    {
        "kv_budget_tokens": st.integers(1, 2**40),
        "state": states,
        "version": st.just(1),
        "dtype": dtypes,
        "quant_group_size": group_sizes,
    },
    {
        "node_id": bad_node_ids,
        "url": junk("ftp://x.test", "http://a b", "http://x.test/path", "x" * 301),
        "shard": junk(
            {"model_id": MODEL, "shard_start": 3, "shard_end": 3},
            {"model_id": MODEL, "shard_start": 0, "shard_end": 7},
            {"model_id": "bad", "shard_start": 0, "shard_end": 1},
            {"model_id": "other/model", "shard_start": 0, "shard_end": 2},
        ),
        "num_layers": junk(0, 5, 7, -1, 2**64),
        "quantization": junk("auto", "int3", ""),  # announced precisions are resolved
        "dtype": junk("float16", ""),
        "quant_group_size": junk(48, 0, "64"),
        "device": junk("x" * 33),
        "memory_declared_bytes": bad_sizes,
        "memory_free_bytes": bad_sizes,
        "kv_budget_tokens": junk(0, -1),
        "state": junk("dead"),
        "version": junk(2, "1"),
    },
)
heartbeats = near_valid(
    {
        "node_id": node_ids,
        "state": states,
        "active_sessions": sizes,
        "kv_tokens": sizes,
        "memory_free_bytes": sizes,
    },
    {"tokens_generated": sizes},
    {
        "node_id": bad_node_ids,
        "state": junk("dead"),
        "active_sessions": bad_sizes,
        "kv_tokens": bad_sizes,
        "memory_free_bytes": bad_sizes,
    },
)
assign_requests = near_valid(
    {
        "node_id": node_ids,
        "memory_bytes": st.one_of(st.integers(1, 2**40), st.just(2**2000)),
        "device": st.text(max_size=32),
        "kv_tokens": st.integers(1, 1 << 24),
    },
    {
        "quantization": quantizations,
        "dtype": dtypes,
        "quant_group_size": group_sizes,
        "held_models": st.lists(st.sampled_from([MODEL, "meshnet-tiny/gpt2", "x/y"]), max_size=3),
    },
    {
        "node_id": bad_node_ids,
        "memory_bytes": junk(0, -1, "1"),
        "device": junk("x" * 33),
        "kv_tokens": junk(0, (1 << 24) + 1),
        "quantization": junk("int3", "AUTO"),
        "dtype": junk("float16"),
        "quant_group_size": junk(16, "64"),
        "held_models": junk(["bad"], "x/y"),
    },
)

NEAR_VALID = {
    "/v1/completions": completion_bodies,
    "/v1/chat/completions": chat_bodies,
    "/v1/nodes/register": announcements,
    "/v1/nodes/heartbeat": heartbeats,
    "/v1/nodes/assign": assign_requests,
}


# Bodies json.dumps cannot write: json.loads raises ValueError or RecursionError on them.
UNPARSABLE = [
    b'{"model": ' + b"1" * 5000 + b"}",
    b'{"n": -' + b"9" * 4301 + b"}",
    b"[" * 5000,
    b'{"a": ' * 3000,
]


def bodies_for(path: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.sampled_from(UNPARSABLE),
        NEAR_VALID[path].map(dumps),
        NEAR_VALID[path].map(dumps),
        NEAR_VALID[path].map(dumps),
        st.dictionaries(json_keys, json_values, max_size=6).map(dumps),
        json_values.map(dumps),
        st.binary(max_size=200),
    )


content_types = st.sampled_from(
    ["application/json"] * 6 + ["application/json; charset=utf-8", None, "text/plain",
     wire.CONTENT_TYPE]
)  # fmt: skip

JSON_ROUTES = [
    ("node", "/v1/completions"),
    ("node", "/v1/chat/completions"),
    ("tracker", "/v1/completions"),
    ("tracker", "/v1/chat/completions"),
    ("tracker", "/v1/nodes/register"),
    ("tracker", "/v1/nodes/heartbeat"),
    ("tracker", "/v1/nodes/assign"),
]
JSON_ROUTE_IDS = [f"{s}{p}" for s, p in JSON_ROUTES]


@pytest.mark.parametrize(("service", "path"), JSON_ROUTES, indirect=["service"], ids=JSON_ROUTE_IDS)
def test_json_bodies(service: Service, path: str) -> None:
    """Near-valid and arbitrary JSON bodies, and raw bytes, to the hand-parsed routes."""

    @FUZZ
    @given(body=bodies_for(path), content_type=content_types)
    def run(body: bytes, content_type: str | None) -> None:
        headers = {"content-type": content_type} if content_type else {}
        resp = service.client.post(path, content=body, headers=headers)
        check_response(resp, _describe("POST", path, headers, body))
        service.assert_alive()

    run()


# -- the forward data path -----------------------------------------------------------------

printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=24)
sampling_specs = st.fixed_dictionaries(
    {},
    optional={
        "temperature": SAMPLING_VALID["temperature"],
        "top_k": st.integers(0, VOCAB + 2),
        "top_p": SAMPLING_VALID["top_p"],
        "seed": SAMPLING_VALID["seed"],
        "logprobs": st.integers(0, 20),
    },
)
bad_open = st.one_of(
    st.tuples(sampling_specs, st.sampled_from(sorted(SAMPLING_BROKEN)), json_scalars).map(
        lambda t: {**t[0], t[1]: t[2]}
    ),
    sampling_specs.map(lambda spec: {**spec, "start_layer": 3}),
    sampling_specs.map(lambda spec: {**spec, "start_layer": "0"}),
    json_values,
)


def ascii_json(value) -> str:
    return json.dumps(value)  # ensure_ascii: always a valid header value


forward_headers = near_valid(
    {
        "content-type": st.just(wire.CONTENT_TYPE),
        H_SESSION: st.from_regex(r"[A-Za-z0-9_-]{1,16}", fullmatch=True),
        H_POSITION: st.just("0"),
        H_OPEN: sampling_specs.map(ascii_json),
        H_SAMPLE: st.sampled_from(["1", "0"]),
    },
    {H_SESSION_KEY: printable, H_CHUNK: st.just("0")},
    {
        "content-type": st.sampled_from(["application/json", "text/plain", ""]),
        H_SESSION: st.one_of(printable, st.just("a" * 200), st.just(DROP)),
        H_POSITION: st.one_of(st.integers(-2, 1100).map(str), printable, st.just(DROP)),
        H_OPEN: st.one_of(bad_open.map(ascii_json), printable, st.just(DROP)),
        H_SAMPLE: printable,
        # test_forward_steps shortens the wait of a chunk whose turn never comes
        H_CHUNK: st.one_of(st.integers(-1, 3).map(str), st.sampled_from(["x", ""]), printable),
        H_ROUTE: st.one_of(st.sampled_from(["", ",", "http://next.test", "ftp://x"]), printable),
        H_SESSION_KEY: printable,
    },
    extra=st.tuples(st.from_regex(r"x-meshnet-[a-z-]{1,8}", fullmatch=True), printable),
).map(lambda headers: {k: v for k, v in headers.items() if isinstance(v, str)})


@st.composite
def token_frames(draw) -> bytes:
    """What a head node expects: (1, T) int64 token ids."""
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4))
    options = wire.WireOptions(zstd_level=draw(st.sampled_from([0, 1])))
    return wire.encode_tensor(torch.tensor([ids]), options)


@st.composite
def odd_frames(draw) -> bytes:
    """Well-formed frames of other dtypes and shapes, and damaged frames."""
    dtype = draw(st.sampled_from([torch.int64, torch.float32, torch.bfloat16, torch.float16]))
    tokens = draw(st.integers(0, 4))
    shape = draw(st.sampled_from([(1, tokens), (tokens,), (1, tokens, 64), (2, tokens), ()]))
    if dtype is torch.int64:
        values = draw(st.lists(st.integers(-2, VOCAB + 2), min_size=math.prod(shape),
                               max_size=math.prod(shape)))  # fmt: skip
        tensor = torch.tensor(values, dtype=dtype).reshape(shape)
    else:
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        tensor = torch.randn(shape, generator=generator).to(dtype)
    options = wire.WireOptions(zstd_level=draw(st.sampled_from([0, 1])))
    frame = wire.encode_tensor(tensor, options)
    damage = draw(st.sampled_from(["none", "truncate", "flip", "append"]))
    if damage == "truncate":
        frame = frame[: draw(st.integers(0, len(frame) - 1))]
    elif damage == "flip":
        i = draw(st.integers(0, len(frame) - 1))
        frame = frame[:i] + bytes([frame[i] ^ draw(st.integers(1, 255))]) + frame[i + 1 :]
    elif damage == "append":
        frame += draw(st.binary(min_size=1, max_size=8))
    return frame


frames = st.one_of(token_frames(), token_frames(), odd_frames(), st.binary(max_size=128))


def test_forward_steps(node: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    """Near-valid and broken step headers with valid, odd, damaged and random tensor frames.
    A step that opened a session is followed by a valid one-token decode step (200), and the
    session is closed again."""
    # a later chunk of a session that is not there yet waits for its turn: not for long here
    service = node.runtime.service
    quick = service.settings.replace(turn_timeout_s=0.05, open_timeout_s=0.05)
    monkeypatch.setattr(service, "settings", quick)
    monkeypatch.setattr(service.order, "settings", quick)

    @FUZZ
    @given(headers=forward_headers, body=frames, next_token=st.integers(0, VOCAB - 1))
    def run(headers: dict, body: bytes, next_token: int) -> None:
        resp = node.client.post("/v1/forward", content=body, headers=headers)
        what = _describe("POST", "/v1/forward", headers, body)
        check_response(resp, what)
        node.assert_alive()
        if resp.status_code != 200 or H_OPEN not in headers:
            return
        session = headers[H_SESSION]
        key = {H_SESSION_KEY: headers[H_SESSION_KEY]} if H_SESSION_KEY in headers else {}
        step = {
            "content-type": wire.CONTENT_TYPE,
            H_SESSION: session,
            H_POSITION: str(len(wire.decode_tensor(body).reshape(-1))),
            H_SAMPLE: "1",
            **key,
        }
        frame = wire.encode_tensor(torch.tensor([[next_token]]))
        resp = node.client.post("/v1/forward", content=frame, headers=step)
        assert resp.status_code == 200, f"decode step after {what}: {resp.text}"
        assert 0 <= resp.json()["token_id"] < VOCAB, what
        path = "/v1/sessions/" + quote(session, safe="")
        closed = node.client.delete(path, headers=key)
        assert closed.status_code == 200, f"close after {what}: {closed.text}"

    run()


def test_forward_opens_and_steps(node: Service) -> None:
    """Control: a well-formed opening step of the head + tail node answers with a token."""
    frame = wire.encode_tensor(torch.tensor([[1, 2, 3]]))
    headers = {
        "content-type": wire.CONTENT_TYPE,
        H_SESSION: "fuzz-control",
        H_POSITION: "0",
        H_OPEN: json.dumps({"temperature": 0.0}),
        H_SAMPLE: "1",
    }
    resp = node.client.post("/v1/forward", content=frame, headers=headers)
    assert resp.status_code == 200, resp.text
    assert 0 <= resp.json()["token_id"] < VOCAB
    assert node.client.delete("/v1/sessions/fuzz-control").status_code == 200


# -- shard files ---------------------------------------------------------------------------

FILES = ["model.safetensors", "model.safetensors.index.json", "config.json", "tokenizer.json"]
bad_layer = st.one_of(
    st.integers(-2, 8).map(str),
    st.sampled_from(["", "1.0", "9" * 30, "9" * 5000, "0x2", " 1", "-0"]),
    printable,
    st.just(DROP),
)


@st.composite
def layer_window(draw) -> dict:
    start = draw(st.integers(0, 5))
    return {"start": str(start), "end": str(draw(st.integers(start + 1, 6)))}


shard_params = near_valid(
    {"model": st.just(MODEL), "file": st.sampled_from(FILES)},
    {},
    {
        "model": st.one_of(
            st.sampled_from(["meshnet-tiny/nope", "bad", "../x/y", "a/b/c", "a/.."]),
            printable,
            st.just(DROP),
        ),
        "start": bad_layer,
        "end": bad_layer,
        "file": st.one_of(
            st.sampled_from(["../config.json", "meshnet-manifest.json", "", "/etc/passwd"]),
            printable,
            st.just(DROP),
        ),
    },
    extra=st.tuples(printable, printable),
)
shard_queries = st.tuples(layer_window(), shard_params).map(
    lambda pair: {k: v for k, v in {**pair[0], **pair[1]}.items() if isinstance(v, str)}
)
ranges = st.one_of(
    st.none(),
    st.tuples(st.integers(0, 600_000), st.integers(0, 600_000)).map(
        lambda ab: f"bytes={ab[0]}-{ab[1]}"
    ),
    st.integers(0, 600_000).map(lambda a: f"bytes={a}-"),
    st.integers(0, 1000).map(lambda a: f"bytes={a}-{a + 20}"),
    st.sampled_from(["bytes=-5", "bytes=0-1,2-3", "items=0-1", "bytes=", "bytes=a-b"]),
    printable,
)


@pytest.mark.parametrize("service", ["node", "tracker"], indirect=True)
def test_shard_routes(service: Service) -> None:
    """Manifests and file downloads with near-valid and broken query parameters and random
    ranges; a 206 carries exactly the requested slice of the plain download."""
    full: dict[tuple, bytes] = {}

    @FUZZ
    @given(kind=st.sampled_from(["manifest", "download", "download"]), params=shard_queries,
           byte_range=ranges)  # fmt: skip
    def run(kind: str, params: dict, byte_range: str | None) -> None:
        path = f"/v1/shards/{kind}"
        headers = {"range": byte_range} if byte_range is not None else {}
        resp = service.client.get(path, params=params, headers=headers)
        what = _describe("GET", path, headers, params=params)
        check_response(resp, what)
        service.assert_alive()
        if resp.status_code not in (200, 206):
            return
        if kind == "manifest":
            manifest = resp.json()
            assert manifest["model_id"] == params["model"], what
            window = (manifest["shard_start"], manifest["shard_end"])
            assert window == (int(float(params["start"])), int(float(params["end"]))), what
            return
        key = tuple(sorted(params.items()))
        if key not in full:
            plain = service.client.get(path, params=params)
            assert plain.status_code == 200, what
            full[key] = plain.content
        data = full[key]
        assert int(resp.headers["content-length"]) == len(resp.content), what
        if resp.status_code == 200:
            assert resp.content == data, what
        else:
            unit, _, spec = resp.headers["content-range"].partition(" ")
            span, _, size = spec.partition("/")
            lo, _, hi = span.partition("-")
            assert unit == "bytes" and int(size) == len(data), what
            assert resp.content == data[int(lo) : int(hi) + 1], what

    run()


# -- regressions: inputs that were server errors ----------------------------------------

HUGE_INT = b"1" * 5000  # more digits than Python's int-from-string limit (4300)
DEEP = b"[" * 5000  # deeper than the recursion limit of json.loads


@pytest.mark.parametrize(("service", "path"), JSON_ROUTES, indirect=["service"], ids=JSON_ROUTE_IDS)
@pytest.mark.parametrize("body", [b'{"model": ' + HUGE_INT + b"}", DEEP], ids=["huge-int", "deep"])
def test_unparsable_json_is_400(service: Service, path: str, body: bytes) -> None:
    """json.loads raises a bare ValueError (integer over 4300 digits) or RecursionError
    (deep nesting): both were 500s."""
    resp = service.client.post(path, content=body, headers={"content-type": "application/json"})
    check_response(resp, path)
    assert resp.status_code == 400, resp.text


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**100])
def test_seed_outside_64_bits_is_400(node: Service, seed: int) -> None:
    """torch.Generator.manual_seed raised ValueError for it: was a 500."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "seed": seed}
    resp = node.client.post("/v1/completions", json=body)
    check_response(resp, "completions")
    assert resp.status_code == 400, resp.text


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_open_header_seed_outside_64_bits_is_400(node: Service, seed: int) -> None:
    headers = {
        "content-type": wire.CONTENT_TYPE,
        H_SESSION: "huge-seed",
        H_POSITION: "0",
        H_OPEN: json.dumps({"temperature": 1.0, "seed": seed}),
        H_SAMPLE: "1",
    }
    resp = node.client.post(
        "/v1/forward", content=wire.encode_tensor(torch.tensor([[1, 2]])), headers=headers
    )
    check_response(resp, "forward")
    assert resp.status_code == 400, resp.text
    assert node.runtime.service.stage.sessions.peek("huge-seed") is None


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 1e-300}, {"temperature": 5e-324}, {"temperature": 1.0, "top_p": 1e-300}],
    ids=["temperature", "denormal-temperature", "top_p"],
)
def test_tiny_temperature_or_top_p_still_samples(node: Service, sampling: dict) -> None:
    """Scores overflowed float32 and torch.multinomial raised RuntimeError: was a 500."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **sampling}
    resp = node.client.post("/v1/completions", json=body)
    check_response(resp, "completions")
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("text", [5, None, ["a"], {"t": "a"}])
def test_content_part_text_must_be_a_string(node: Service, text) -> None:
    """str.join over a non-string part raised TypeError: was a 500."""
    part = {"type": "text", "text": text}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    resp = node.client.post("/v1/chat/completions", json=body)
    check_response(resp, "chat")
    assert resp.status_code == 400, resp.text


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {"prompt": "\ud800"}),
        ("/v1/completions", {"prompt": ["ok", "a\udfffb"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]},
        ),
    ],
    ids=["prompt", "prompt-list", "chat", "chat-part"],
)
def test_lone_surrogates_are_400(node: Service, path: str, fields: dict) -> None:
    """JSON escapes of lone surrogates decode to str the tokenizer cannot encode (TypeError):
    was a 500."""
    body = dumps({"model": MODEL, "max_tokens": 1, **fields})  # ASCII: escapes the surrogates
    resp = node.client.post(path, content=body, headers={"content-type": "application/json"})
    check_response(resp, path)
    assert resp.status_code == 400, resp.text


def test_chunk_of_unknown_session_is_404_and_forgotten(
    node: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later chunk of a session that never opens waited the whole turn timeout (60 s),
    then 409, and left its turn condition in the node's chunk order for good."""
    service = node.runtime.service
    quick = service.settings.replace(turn_timeout_s=0.05, open_timeout_s=0.05)
    monkeypatch.setattr(service, "settings", quick)
    monkeypatch.setattr(service.order, "settings", quick)
    headers = {
        "content-type": wire.CONTENT_TYPE,
        H_SESSION: "never-opened",
        H_POSITION: "5",
        H_CHUNK: "1",
    }
    frame = wire.encode_tensor(torch.tensor([[1]]))
    resp = node.client.post("/v1/forward", content=frame, headers=headers)
    check_response(resp, "chunk 1 of a session that does not exist")
    assert resp.status_code in (404, 409), resp.text
    assert not node.runtime.service.order.watched("never-opened")

"""The tracker's operational endpoints and access knobs (issue 39): /version, /ready apart
from /health, vLLM's /tokenize and /detokenize passed on to a head (or answered by the
tracker node in-process), --api-key-file and --allowed-origins (CORS)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from test_tracker_api import LLAMA, AppsTransport, announcement, assert_error, register

from meshnet_common.config.cli import package_version
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.protocol import NodeState
from meshnet_node.cli import main as node_main
from meshnet_node.runtime import build_runtime
from meshnet_node.runtime import create_app as create_node_app
from meshnet_node.settings import NodeSettings
from meshnet_node.swarm.membership import Membership
from meshnet_tracker.app import create_app
from meshnet_tracker.cli import build_parser
from meshnet_tracker.cli import main as tracker_main
from meshnet_tracker.settings import TrackerSettings
from meshnet_tracker.tracker_node import TrackerNode

UI = "http://ui.test:3000"
PREFLIGHT = {"access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}  # fmt: skip
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
    return ()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def llama_snapshot(tiny_snapshot) -> Path:
    return tiny_snapshot("llama")  # also makes sure the models dir holds it


@pytest.fixture(scope="module")
def head(llama_snapshot) -> Iterator[TestClient]:
    """An in-process node serving all of llama: the head the tracker passes requests to."""
    settings = NodeSettings(model_id=LLAMA, model_path=llama_snapshot, layers=LayerRange(0, 6),
                            quantization=Precision.FLOAT32)  # fmt: skip
    with TestClient(create_node_app(build_runtime(settings, route_provider=no_route))) as client:
        yield client


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "keys"
    path.write_text("# the team's keys\nkey-one\n\n   key-two  \n# key-three is revoked\n")
    return path


def tracker_with(models_dir, **settings) -> TestClient:
    return TestClient(create_app(TrackerSettings(models_dir=models_dir, verify_nodes=False,
                                                 **settings), node=None))  # fmt: skip


def proxy_to(tracker: TestClient, head: TestClient) -> None:
    """The tracker reaches node.test (the registered head) in-process."""
    register(tracker, node_id="node", start=0, end=6)
    state = tracker.app.state.tracker
    unused = state.client
    state.client = httpx.AsyncClient(transport=AppsTransport({"node.test": head.app}))
    asyncio.run(unused.aclose())


# -- /version and /ready ----------------------------------------------------------------------


def test_version_is_the_installed_one(models_dir, llama_snapshot):
    with tracker_with(models_dir) as tracker:
        assert tracker.get("/version").json() == {"version": package_version("meshnet-tracker")}


def test_ready_once_a_model_is_covered_end_to_end(models_dir, llama_snapshot):
    with tracker_with(models_dir) as tracker:
        assert tracker.get("/health").status_code == 200  # alive from the start
        error = assert_error(tracker.get("/ready"), 503, "service_unavailable")
        assert error["code"] == "not_ready"
        loading = {**announcement(node_id="loading"), "state": "joining"}
        assert tracker.post("/v1/nodes/register", json=loading).status_code == 200
        assert_error(tracker.get("/ready"), 503)  # on its way is not covered
        register(tracker, node_id="a", start=0, end=3)
        assert_error(tracker.get("/ready"), 503)  # layers [3, 6) missing
        register(tracker, node_id="b", start=3, end=6)
        assert tracker.get("/ready").json() == {"ready": True, "models": [LLAMA]}


def test_a_node_is_ready_once_the_tracker_has_it_serving(models_dir, llama_snapshot):
    """Loading (joining), a node is alive but not ready; once the tracker accepted its
    serving announcement (meshnet-node sends it when its server listens), it is."""
    with tracker_with(models_dir) as tracker:
        settings = NodeSettings(
            model_id=LLAMA, model_path=llama_snapshot, layers=LayerRange(0, 6),
            quantization=Precision.FLOAT32, tracker_url="http://tracker.test",
            heartbeat_interval_s=60.0,
        )  # fmt: skip
        runtime = build_runtime(settings, route_provider=no_route)
        runtime.listening_at_start = False  # as meshnet-node: serving once it listens

        def joining():
            return runtime.announcement().model_copy(update={"state": NodeState.JOINING})

        membership = Membership("http://tracker.test", joining, runtime.heartbeat, 60.0,
                                identity=runtime.identity, peers=runtime.peers)  # fmt: skip
        membership._client = tracker  # the in-process tracker answers its calls
        membership.register_once()  # as meshnet-node announces itself while it loads
        accepted = threading.Event()
        membership.on_registered = lambda a: a.state == NodeState.SERVING and accepted.set()
        runtime.membership = membership
        with TestClient(create_node_app(runtime)) as node:
            assert node.get("/health").status_code == 200
            error = assert_error(node.get("/ready"), 503)
            assert error["code"] == "not_ready" and "map" in error["message"]
            assert_error(tracker.get("/ready"), 503)
            runtime.serving()  # its server listens: it registers as serving
            assert accepted.wait(10), "the tracker never accepted the serving node"
            assert node.get("/ready").json() == {"ready": True}
            assert tracker.get("/ready").json() == {"ready": True, "models": [LLAMA]}
            runtime.quarantine("replicas disagree")
            assert "quarantined" in assert_error(node.get("/ready"), 503)["message"]
            runtime.quarantine(None)


# -- /tokenize and /detokenize through the tracker ------------------------------------------


def test_tokenizer_endpoints_are_passed_to_a_head(models_dir, head):
    tokenizer = head.app.state.runtime.openai.tokenizer
    with tracker_with(models_dir) as tracker:
        proxy_to(tracker, head)
        # lm-evaluation-harness's remote tokenizer: no model named
        probe = tracker.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
        assert probe.status_code == 200, probe.text
        assert probe.json()["tokens"] == tokenizer("test", add_special_tokens=False).input_ids
        prompt = "The capital of France is"
        text = tracker.post("/tokenize", json={"model": LLAMA, "prompt": prompt,
                                               "return_token_strs": True})  # fmt: skip
        direct = head.post("/tokenize", json={"model": LLAMA, "prompt": prompt,
                                              "return_token_strs": True})  # fmt: skip
        assert text.json() == direct.json()
        assert text.json()["tokens"] == tokenizer(prompt).input_ids
        back = tracker.post("/detokenize", json={"model": LLAMA, "tokens": text.json()["tokens"]})
        assert back.json() == {"prompt": prompt}
        chat = tracker.post("/tokenize", json={"model": LLAMA, "messages": CHAT})
        assert chat.json()["tokens"] == list(tokenizer.apply_chat_template(
            CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))  # fmt: skip
        # the head's refusals come back as they are
        error = assert_error(tracker.post("/tokenize", json={"prompt": "x", "top_k": 1}), 400)
        assert error["param"] == "top_k" and error["code"] == "unsupported_parameter"
        assert assert_error(tracker.post("/detokenize", json={"tokens": [10**6]}), 400)[
            "param"] == "tokens"  # fmt: skip
        assert_error(tracker.post("/tokenize", json={"model": 5, "prompt": "x"}), 400)
        state = tracker.app.state.tracker
        assert state.demand[LLAMA] == 0  # tokenizing is no demand for the model


def test_with_several_models_the_tokenizer_endpoints_need_one_named(models_dir, head):
    with tracker_with(models_dir) as tracker:
        proxy_to(tracker, head)
        register(tracker, node_id="other", model="meshnet-tiny/other", start=0, end=4,
                 num_layers=4)  # fmt: skip
        error = assert_error(tracker.post("/tokenize", json={"prompt": "hi"}), 400)
        assert error["param"] == "model" and "meshnet-tiny/other" in error["message"]
        named = tracker.post("/tokenize", json={"model": LLAMA, "prompt": "hi"})
        assert named.status_code == 200, named.text
        error = assert_error(tracker.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)
        assert error["code"] == "model_not_found"


def test_the_tracker_node_tokenizes_in_process_behind_its_keys(models_dir, llama_snapshot,
                                                                key_file):  # fmt: skip
    settings = TrackerSettings(
        models_dir=models_dir, model_id=LLAMA, shard_start=0, shard_end=6,
        quantization="float32", verify_nodes=False, api_key="key-zero", api_key_file=key_file,
        allowed_origins=("*",),
    )  # fmt: skip
    node = TrackerNode.build(settings, llama_snapshot, "http://127.0.0.1:8080")
    assert node.runtime.openai.keyed_clients  # the wait queue takes turns by key
    tokenizer = node.runtime.openai.tokenizer
    with TestClient(create_app(settings, node)) as tracker:
        for key in ("key-zero", "key-one", "key-two"):
            resp = tracker.post("/tokenize", json={"prompt": "Paris"}, headers=bearer(key))
            assert resp.status_code == 200, resp.text
            assert resp.json()["tokens"] == tokenizer("Paris").input_ids
        ids = resp.json()["tokens"]
        back = tracker.post("/detokenize", json={"tokens": ids}, headers=bearer("key-one"))
        assert back.json() == {"prompt": "Paris"}
        for wrong in ({}, bearer("key-three"), bearer("key-on"), bearer("# the team's keys")):
            error = assert_error(tracker.post("/tokenize", json={"prompt": "x"}, headers=wrong),
                                 401, "authentication_error")  # fmt: skip
            assert error["code"] == "invalid_api_key"
        # the probes need no key
        assert tracker.get("/ready").json() == {"ready": True, "models": [LLAMA]}
        assert tracker.get("/version").status_code == 200
        # *: any origin; its preflight is answered before any key is asked for
        preflight = tracker.options("/tokenize", headers={"origin": "http://any.test", **PREFLIGHT})
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == "*"


# -- --api-key-file ---------------------------------------------------------------------------


def test_every_key_of_the_file_and_the_api_key_are_accepted(models_dir, llama_snapshot, key_file):
    with tracker_with(models_dir, api_key="key-zero", api_key_file=key_file) as tracker:
        for key in ("key-zero", "key-one", "key-two"):
            assert tracker.get("/v1/models", headers=bearer(key)).status_code == 200
        for wrong in ({}, bearer("key-three"), bearer("key-one key-two"), bearer("")):
            assert_error(tracker.get("/v1/models", headers=wrong), 401, "authentication_error")
        assert tracker.get("/health").status_code == 200  # liveness needs no key


def test_a_key_file_alone_is_enough(models_dir, llama_snapshot, key_file):
    with tracker_with(models_dir, api_key_file=key_file) as tracker:
        assert tracker.get("/v1/models", headers=bearer("key-two")).status_code == 200
        assert_error(tracker.get("/v1/models"), 401)


@pytest.mark.parametrize("main", [tracker_main, node_main], ids=["tracker", "node"])
def test_a_key_file_of_no_use_fails_the_cli_in_one_line(main, tmp_path, capsys):
    tracker = ["--tracker", "http://127.0.0.1:9"] if main is node_main else []
    comments = tmp_path / "comments"
    comments.write_text("# secret-looking comment\n\n")
    cases = [(tmp_path / "missing", "no such file"), (comments, "holds no key"),
             (tmp_path, "cannot be read")]  # fmt: skip
    for path, why in cases:
        with pytest.raises(SystemExit) as exit_info:
            main([*tracker, "--api-key-file", str(path)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error: --api-key-file" in err and why in err, err
        assert "secret-looking" not in err


def test_keys_stay_out_of_help_and_settings_read_the_env(monkeypatch, key_file):
    monkeypatch.setenv("MESHNET_API_KEY", "sk-very-secret")
    monkeypatch.setenv("MESHNET_API_KEY_FILE", str(key_file))
    monkeypatch.setenv("MESHNET_ALLOWED_ORIGINS", f"{UI}, https://chat.example.org/")
    help_text = build_parser().format_help()
    assert "sk-very-secret" not in help_text and "key-one" not in help_text
    assert "--api-key-file" in help_text and "--allowed-origins" in help_text
    settings = TrackerSettings.from_args(build_parser().parse_args([]))
    assert settings.api_key_file == key_file
    assert settings.allowed_origins == (UI, "https://chat.example.org")
    assert "sk-very-secret" not in repr(settings)
    flags = ["--allowed-origins", UI, "--allowed-origins", "*"]
    assert TrackerSettings.from_args(build_parser().parse_args(flags)).allowed_origins == (UI, "*")
    with pytest.raises(ValueError, match="--allowed-origins"):
        TrackerSettings.from_args(build_parser().parse_args(["--allowed-origins", "ui.test"]))


# -- --allowed-origins (CORS) -----------------------------------------------------------------


def test_an_allowed_origins_preflight_passes_the_key_check(models_dir, llama_snapshot):
    with tracker_with(models_dir, api_key="key-zero", allowed_origins=(UI,)) as tracker:
        for path in ("/v1/chat/completions", "/v1/models", "/tokenize"):
            resp = tracker.options(path, headers={"origin": UI, **PREFLIGHT})
            assert resp.status_code == 200, (path, resp.text)
            assert resp.headers["access-control-allow-origin"] == UI
            assert "authorization" in resp.headers["access-control-allow-headers"].lower()
        # another origin: no CORS headers (and no preflight answer: the key is asked for)
        other = tracker.options("/v1/models", headers={"origin": "http://evil.test", **PREFLIGHT})
        assert other.status_code == 401
        assert not [h for h in other.headers if h.startswith("access-control-")]
        # answers, refusals included, are readable by the allowed origin's pages
        ok = tracker.get("/v1/models", headers={"origin": UI, **bearer("key-zero")})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == UI
        refused = tracker.get("/v1/models", headers={"origin": UI})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == UI
        theirs = tracker.get("/v1/models", headers={"origin": "http://evil.test",
                                                    **bearer("key-zero")})  # fmt: skip
        assert theirs.status_code == 200 and "access-control-allow-origin" not in theirs.headers


def test_without_allowed_origins_no_cors_headers(models_dir, llama_snapshot):
    with tracker_with(models_dir) as tracker:
        resp = tracker.options("/v1/models", headers={"origin": UI, **PREFLIGHT})
        assert resp.status_code == 405
        assert not [h for h in resp.headers if h.startswith("access-control-")]

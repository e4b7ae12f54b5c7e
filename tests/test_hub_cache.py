"""Starting from a hub id (issue 39): a model in the standard HF cache (``HF_HUB_CACHE``, as
``hf download`` and vLLM leave it) is served by ``--model-id ORG/NAME[@REV]`` with no models
dir, at the revision asked for; ``meshnet-models download`` fetches a model, or a layer
range's files, into that cache. Everything runs offline, on a cache this file writes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from swarm_harness import Proc, Swarm, covered, wait_for

from meshnet_common.errors import InvalidRequest, ModelError, NotFound
from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import INDEX_FILE, CheckpointIndex
from meshnet_common.models.hub import download as hub_download
from meshnet_common.models.hub.cache import (
    cached_snapshot,
    layer_files,
    missing_files,
    split_model_ref,
)
from meshnet_common.models.hub.download import SMALL_FILE_PATTERNS, download, hub_snapshot
from meshnet_common.protocol import ShardSpec

MODEL = "meshnet-hub/llama"
TINY = "meshnet-tiny/llama"  # the same weights, from the models dir
MAIN = hashlib.sha1(b"main", usedforsecurity=False).hexdigest()
V1 = hashlib.sha1(b"v1", usedforsecurity=False).hexdigest()
PART = hashlib.sha1(b"part", usedforsecurity=False).hexdigest()
KV = ("--kv-budget-tokens", "2048")


def write_snapshot(
    cache: Path, model_id: str, commit: str, source: Path, names=None, refs=()
) -> Path:
    """A snapshot as huggingface_hub writes one: blobs named by content, the snapshot's files
    relative links to them, and ``refs/NAME`` holding the commit (no newline)."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        if names is not None and file.name not in names:
            continue
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def tiny(tiny_snapshot) -> Path:
    return tiny_snapshot("llama")


@pytest.fixture
def hub(tiny, tmp_path) -> Path:
    """An HF cache holding MODEL: ``main`` and ``v1`` (two commits), and a commit no ref
    names that holds only the files of layers [0, 2)."""
    cache = tmp_path / "hf-hub"
    write_snapshot(cache, MODEL, MAIN, tiny, refs=("main",))
    write_snapshot(cache, MODEL, V1, tiny, refs=("v1",))
    weights = json.loads((tiny / INDEX_FILE).read_text())["weight_map"]
    config = json.loads((tiny / "config.json").read_text())
    part = layer_files(weights, config, LayerRange(0, 2))
    small = {p.name for p in tiny.iterdir() if p.suffix in (".json", ".jinja")}
    write_snapshot(cache, MODEL, PART, tiny, names={*part, *small})
    return cache


@pytest.fixture
def offline_hub(hub, monkeypatch) -> Path:
    """``hub`` as the process's HF cache, offline (huggingface_hub read its env already)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def snapshots(hub: Path) -> Path:
    return hub / f"models--{MODEL.replace('/', '--')}" / "snapshots"


# -- (a) resolving ORG/NAME[@REV] ---------------------------------------------------------


def test_a_model_ref_is_an_id_and_a_revision():
    assert split_model_ref("o/n") == ("o/n", None)
    assert split_model_ref("o/n@v1") == ("o/n", "v1")
    assert split_model_ref("o/n", "refs/pr/1") == ("o/n", "refs/pr/1")
    assert split_model_ref("o/n@v1", "v1") == ("o/n", "v1")
    for ref, revision in (
        ("o/n@v1", "v2"),
        ("o/n@", None),
        ("../n@v1", None),
        ("o/n@a/../b", None),
    ):
        with pytest.raises(InvalidRequest):
            split_model_ref(ref, revision)


def test_main_a_commit_and_a_branch_resolve_through_the_cache(offline_hub):
    assert cached_snapshot(MODEL) == snapshots(offline_hub) / MAIN
    assert hub_snapshot(MODEL) == snapshots(offline_hub) / MAIN
    assert hub_snapshot(MODEL, MAIN) == snapshots(offline_hub) / MAIN
    assert hub_snapshot(MODEL, "v1") == snapshots(offline_hub) / V1
    assert hub_snapshot(MODEL, V1) == snapshots(offline_hub) / V1
    assert CheckpointIndex.load(hub_snapshot(MODEL, "v1")).num_layers == 6


def test_an_unknown_model_or_revision_is_one_clear_line(offline_hub):
    with pytest.raises(NotFound) as unknown:
        hub_snapshot("nope/none")
    message = unknown.value.message
    assert "'nope/none' is not in the HF cache" in message and str(offline_hub) in message
    assert "meshnet-models download nope/none" in message and "\n" not in message
    with pytest.raises(NotFound) as revision:
        hub_snapshot(MODEL, "v9")
    message = revision.value.message
    assert "revision 'v9' of meshnet-hub/llama is not in the HF cache" in message
    assert f"main={MAIN[:12]}" in message and f"v1={V1[:12]}" in message and "\n" not in message


def test_a_partial_snapshot_serves_only_the_layers_it_holds(offline_hub, tmp_path):
    part = snapshots(offline_hub) / PART
    assert missing_files(part) and missing_files(part, LayerRange(0, 2)) == []
    assert hub_snapshot(MODEL, PART, layers=LayerRange(0, 2)) == part
    with pytest.raises(ModelError, match="holds only part of meshnet-hub/llama@"):
        hub_snapshot(MODEL, PART)  # the whole model: offline, the rest cannot come


def test_a_node_without_a_models_dir_looks_in_the_hf_cache(offline_hub, tmp_path):
    from meshnet_node.settings import NodeSettings
    from meshnet_node.swarm.joining import local_snapshot

    settings = NodeSettings.exactly(model_id=MODEL, cache_dir=tmp_path / "cache")
    assert local_snapshot(settings, MODEL, LayerRange(3, 6)) == snapshots(offline_hub) / MAIN
    at_v1 = settings.replace(revision="v1")
    assert local_snapshot(at_v1, MODEL, LayerRange(0, 6)) == snapshots(offline_hub) / V1
    partial = settings.replace(revision=PART)
    view = local_snapshot(partial, MODEL, LayerRange(0, 2))  # a view of the files it holds
    assert view is not None and tmp_path / "cache" in view.parents
    assert CheckpointIndex.load(view).files_for(LayerRange(0, 2))
    assert local_snapshot(partial, MODEL, LayerRange(3, 6)) is None  # fetched instead
    assert local_snapshot(settings, "nope/none", LayerRange(0, 2)) is None


def test_a_node_takes_the_revision_the_tracker_serves(offline_hub, tiny, tmp_path, monkeypatch):
    from meshnet_common.models.shardfiles import ShardSource
    from meshnet_node.settings import NodeSettings
    from meshnet_node.swarm import joining

    served: dict = {"revision": V1}
    monkeypatch.setattr(joining, "_tracker_manifest", lambda *_args: served)
    settings = NodeSettings.exactly(model_id=MODEL, cache_dir=tmp_path / "cache")
    layers = LayerRange(3, 6)
    # main is another commit: the one the tracker's manifest names is taken
    assert joining.local_snapshot(settings, MODEL, layers) == snapshots(offline_hub) / V1
    with pytest.raises(ValueError, match=f"the swarm serves commit {V1}"):
        joining.local_snapshot(settings.replace(revision="main"), MODEL, layers)
    # downloaded by its commit (no ref names it): found through the tracker's commit
    write_snapshot(offline_hub, "meshnet-hub/pinned", V1, tiny)
    assert joining.local_snapshot(settings, "meshnet-hub/pinned", layers) is not None
    served["revision"] = PART  # a commit this cache lacks: fetched instead
    assert joining.local_snapshot(settings, MODEL, layers) is None
    # a tracker serving a models dir (no commit): the same bytes are taken, others are not
    served.clear()
    served.update(ShardSource(CheckpointIndex.load(tiny), MODEL, layers, "fp").manifest())
    assert joining.local_snapshot(settings, MODEL, layers) == snapshots(offline_hub) / MAIN
    served["tensors"][0]["sha256"] = "0" * 64
    assert joining.local_snapshot(settings, MODEL, layers) is None


def test_a_node_moved_to_another_range_finds_it_as_at_start_up(offline_hub, tmp_path, monkeypatch):
    """LOAD_SHARD: layers the node's snapshot lacks come from the HF cache at the swarm's
    revision, else are fetched into that revision's folder of --cache-dir."""
    from types import SimpleNamespace

    from meshnet_common.metrics import Metrics
    from meshnet_node import runtime as runtime_module
    from meshnet_node.settings import NodeSettings
    from meshnet_node.swarm import joining

    alone = NodeSettings.exactly(model_id=MODEL, revision=PART, cache_dir=tmp_path / "cache")
    held = joining.local_snapshot(alone, MODEL, LayerRange(0, 2))  # a view of [0, 2)'s files
    serving = alone.replace(model_path=held, layers=LayerRange(0, 2), revision=None,
                            tracker_url="http://127.0.0.1:9")  # fmt: skip
    node = SimpleNamespace(settings=serving, service=SimpleNamespace(metrics=Metrics()),
                           identity=None, tracker=None)  # fmt: skip
    served: dict = {"revision": V1}
    monkeypatch.setattr(joining, "_tracker_manifest", lambda *_args: served)
    move = ShardSpec(model_id=MODEL, shard_start=3, shard_end=6)
    assert runtime_module._locate_shard(node, move) == snapshots(offline_hub) / V1
    fetched = []
    monkeypatch.setattr(joining, "fetch_shard_counted",
                        lambda *args, **kwargs: fetched.append((args, kwargs)) or tmp_path)  # fmt: skip
    served["revision"] = "f" * 40  # a commit this HF cache lacks
    assert runtime_module._locate_shard(node, move) == tmp_path
    [(args, kwargs)] = fetched
    assert args[3] == tmp_path / "cache" / "revisions" / ("f" * 40)
    assert args[:2] == (MODEL, LayerRange(3, 6)) and kwargs["revision"] is None


# -- the tracker: the model is known, its files are served at its commit ----------------


def test_the_tracker_knows_the_hf_cache_model_and_serves_its_commit(offline_hub):
    from fastapi.testclient import TestClient

    from meshnet_common.web.shards import ShardServer, one_model
    from meshnet_tracker.app import create_app
    from meshnet_tracker.settings import TrackerSettings

    settings = TrackerSettings(models_dir=None, model_id=MODEL, revision=V1, verify_nodes=False)
    with TestClient(create_app(settings, node=None)) as client:
        state = client.app.state.tracker
        assert state.registry.num_layers(MODEL) == 6 and MODEL in state.costs
    server = ShardServer(one_model(MODEL, snapshots(offline_hub) / V1))
    assert server.source(MODEL, 0, 2, V1).manifest()["revision"] == V1
    with pytest.raises(NotFound, match=f"at revision {V1}, not {MAIN}"):
        server.source(MODEL, 0, 2, MAIN)  # a caller of another revision gets nothing
    with pytest.raises(NotFound):
        server.source(TINY, 0, 2)


def run(module: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model-id", "nope/none"], "model 'nope/none' is not in the HF cache"),
        (["--model-id", f"{MODEL}@v9"], "revision 'v9' of meshnet-hub/llama is not in the HF"),
        (["--model-id", f"{MODEL}@v1", "--revision", "v2"], "names revision 'v1' but --revisi"),
        (["--model-id", MODEL, "--revision", PART], "the HF cache holds only part of meshnet-"),
    ],
    ids=["model", "revision", "two-revisions", "partial"],
)
def test_the_tracker_refuses_what_the_hf_cache_lacks_in_one_line(hub, args, needle):
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    out = run("meshnet_tracker.cli", "--port", "0", *args, "--shard-start", "0",
              "--shard-end", "2", env=env)  # fmt: skip
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1, out.stderr
    assert len(lines) == 1 and lines[0].startswith("meshnet-tracker: error: "), out.stderr
    assert needle in lines[0]
    assert "listening" not in out.stdout


# -- (c) meshnet-models download ----------------------------------------------------------


def test_download_offline_is_one_clear_line(hub):
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    out = run("meshnet_common.models.cli", "download", f"{MODEL}@v1", "--layers", "0:2", env=env)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and out.stdout == ""
    assert lines == [
        "meshnet-models: error: cannot download meshnet-hub/llama@v1: HF_HUB_OFFLINE is set "
        f"(unset it to reach the hub, or put the model into the HF cache {hub} another way)"
    ]


def test_layer_files_are_chosen_from_the_index():
    weights = {
        "model.embed_tokens.weight": "a", "model.layers.0.q.weight": "a",
        "model.layers.0.k.weight": "b", "model.layers.1.q.weight": "b",
        "model.layers.2.q.weight": "c", "model.layers.3.q.weight": "d",
        "model.norm.weight": "d", "lm_head.weight": "e",
    }  # fmt: skip
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}
    assert layer_files(weights, config, LayerRange(0, 1)) == ["a", "b"]  # + embeddings
    assert layer_files(weights, config, LayerRange(1, 3)) == ["b", "c"]
    assert layer_files(weights, config, LayerRange(3, 4)) == ["d", "e"]  # + norm and head
    del weights["lm_head.weight"]  # tied: the head is the embeddings
    assert layer_files(weights, {**config, "tie_word_embeddings": True}, LayerRange(3, 4)) == [
        "a", "d",
    ]  # fmt: skip
    with pytest.raises(InvalidRequest, match="layers"):
        layer_files(weights, config, LayerRange(2, 5))


class FakeHub:
    """hf_hub_download / snapshot_download over a local snapshot, recording the calls."""

    def __init__(self, snapshot: Path, indexed: bool = True) -> None:
        self.snapshot, self.indexed = snapshot, indexed
        self.calls: list[tuple[str, dict]] = []

    def hf_hub_download(self, model_id, filename, **kwargs):
        from huggingface_hub.errors import EntryNotFoundError

        self.calls.append((filename, kwargs))
        if filename == INDEX_FILE and not self.indexed:
            raise EntryNotFoundError(f"{filename} not in {model_id}")
        return str(self.snapshot / filename)

    def snapshot_download(self, model_id, **kwargs):
        self.calls.append(("snapshot", kwargs))
        return str(self.snapshot)


@pytest.mark.parametrize("indexed", [True, False], ids=["index", "single-file"])
def test_download_layers_fetches_only_their_files(offline_hub, monkeypatch, tiny, indexed):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    fake = FakeHub(snapshots(offline_hub) / MAIN, indexed)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    assert download(MODEL, "main", LayerRange(3, 6)) == snapshots(offline_hub) / MAIN
    filename, kwargs = fake.calls[-1]
    assert filename == "snapshot"
    if indexed:
        index = CheckpointIndex.load(tiny)
        assert kwargs["allow_patterns"] == [
            *index.files_for(LayerRange(3, 6)), *SMALL_FILE_PATTERNS
        ]  # fmt: skip
        assert "model-00002-of-00006.safetensors" not in kwargs["allow_patterns"]
        assert [kw["revision"] for _, kw in fake.calls] == ["main", MAIN, MAIN]  # pinned
    else:
        assert kwargs["allow_patterns"] == list(hub_download.SNAPSHOT_PATTERNS)
        assert kwargs["revision"] == "main"


# -- (b) a swarm from the HF cache serves what a models-dir swarm serves ----------------


def start(swarm: Swarm, name: str, args: list[str], env: dict) -> Proc:
    """A process of ``swarm`` (closed with it) with its own environment."""
    proc = Proc(name, args, swarm.log_dir / f"{name}.log", env=env)
    swarm.procs.append(proc.start())
    return proc


def complete(tracker: Proc, model: str) -> str:
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.integration
@pytest.mark.slow
def test_a_swarm_from_the_hf_cache_answers_as_a_models_dir_swarm(models_dir, tiny, hub, tmp_path):
    reference = Swarm(models_dir, tmp_path / "reference-logs", heartbeat_s=0.5)
    (tmp_path / "reference-logs").mkdir()
    try:
        tracker = reference.tracker("--model-id", TINY, "--shard-start", "0", "--shard-end", "3",
                                    *KV).wait_healthy()  # fmt: skip
        reference.node(tracker, TINY, 3, 6, *KV).wait_healthy()
        wait_for(lambda: covered(tracker, TINY), timeout=60)
        expected = complete(tracker, TINY)
    finally:
        reference.close()

    logs = tmp_path / "hub-logs"
    logs.mkdir()
    swarm = Swarm(tmp_path / "no-models-dir", logs, heartbeat_s=0.5)
    common = ["--port", "0", "--threads", "1", "--heartbeat-interval", "0.5", *KV]
    cached = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    empty = {"HF_HUB_CACHE": str(tmp_path / "empty-hf-hub"), "HF_HUB_OFFLINE": "1"}
    try:
        tracker = start(
            swarm,
            "tracker",
            [
                "meshnet_tracker.cli",
                *common,
                "--model-id",
                MODEL,
                "--shard-start",
                "0",
                "--shard-end",
                "3",
            ],
            cached,
        )
        tracker.wait_healthy()  # fmt: skip
        assert f"at revision {MAIN} from the HF cache" in tracker.log()
        # A node with no files at all: assigned [3, 6), it fetches them from the tracker.
        fetched = tmp_path / "cache-b"
        bare = start(swarm, "node-b", ["meshnet_node.cli", "--tracker", tracker.url, *common,
                                       "--node-id", "node-b", "--memory-gb", "0.5",
                                       "--cache-dir", str(fetched)], empty)  # fmt: skip
        bare.wait_healthy()
        wait_for(lambda: covered(tracker, MODEL), timeout=60)
        assert complete(tracker, MODEL) == expected
        shard = next(fetched.rglob("layers-3-6"))
        assert MAIN in shard.parts  # kept apart from the shards of other revisions
        assert json.loads((shard / "meshnet-manifest.json").read_text())["revision"] == MAIN

        # A node with --model-id and no models dir takes the range from its HF cache.
        unused = tmp_path / "cache-c"
        own = start(swarm, "node-c", ["meshnet_node.cli", "--tracker", tracker.url, *common,
                                      "--model-id", MODEL, "--shard-start", "3", "--shard-end",
                                      "6", "--cache-dir", str(unused)], cached)  # fmt: skip
        own.wait_healthy()
        bare.stop()
        wait_for(lambda: covered(tracker, MODEL) and "node-b" not in nodes(tracker), timeout=60)
        assert complete(tracker, MODEL) == expected
        assert "from the HF cache" in own.log()
        assert not list(unused.rglob("layers-3-6"))  # nothing fetched
    finally:
        swarm.close()


def nodes(tracker: Proc) -> set[str]:
    models = httpx.get(f"{tracker.url}/v1/coverage", timeout=5).json()["models"]
    return {n["node_id"] for m in models for n in m.get("nodes", [])}

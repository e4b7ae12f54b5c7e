"""The HF hub fallback: the standard HF cache, a revision, and only the files a node loads.

``huggingface_hub`` is replaced by a fake that serves a folder as a hub repo (with files no
node loads beside the weights), records every call's kwargs, and lays downloads out as the
HF cache does (snapshot files are links into ``blobs/``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import save_file

from meshnet_common.errors import ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.metrics import Metrics
from meshnet_common.models.checkpoint import INDEX_FILE, CheckpointIndex
from meshnet_common.models.hub.download import IGNORE_PATTERNS as HUB_IGNORE_PATTERNS
from meshnet_common.models.hub.download import SNAPSHOT_PATTERNS as HUB_SNAPSHOT_PATTERNS
from meshnet_node.swarm import FetchError
from meshnet_node.swarm.fetch import fetch_shard, fetch_shard_counted
from meshnet_node.swarm.hub import check_against, fetch_from_hub

MODEL = "acme/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# What real repos carry beside the safetensors weights, none of which a node loads.
UNWANTED = {
    "original/params.json": b"{}",
    "original/consolidated.00.pth": b"pth",
    "original/tokenizer.model": b"sp",
    "model-Q4_K_M.gguf": b"gguf",
    "onnx/model.onnx": b"onnx",
    "onnx/config.json": b"{}",
    "pytorch_model.bin": b"bin",
    "consolidated.safetensors": b"dup",
    "flax_model.msgpack": b"flax",
    "tf_model.h5": b"h5",
    "README.md": b"# card",
}


class FakeHub:
    """``hf_hub_download`` / ``snapshot_download`` over the files of ``repo``."""

    def __init__(self, repo: Path, cache: Path) -> None:
        self.repo, self.cache = repo, cache
        self.calls: list[tuple[str, dict]] = []
        self.fetched: list[list[str]] = []  # what each snapshot_download brought

    def repo_files(self) -> list[str]:
        return sorted(
            p.relative_to(self.repo).as_posix() for p in self.repo.rglob("*") if p.is_file()
        )

    def _snapshot(self, kwargs: dict) -> Path:
        return (
            Path(kwargs.get("cache_dir") or self.cache)
            / "snapshots"
            / (kwargs["revision"] or COMMIT)
        )

    def _place(self, name: str, kwargs: dict) -> Path:
        data = (self.repo / name).read_bytes()
        blob = self._snapshot(kwargs).parent.parent / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = self._snapshot(kwargs) / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(blob)
        return link

    def hf_hub_download(self, repo_id: str, filename: str, **kwargs) -> str:
        assert repo_id == MODEL
        self.calls.append(("hf_hub_download", kwargs))
        if filename not in self.repo_files():
            raise FileNotFoundError(f"404: {filename}")
        return str(self._place(filename, kwargs))

    def snapshot_download(self, repo_id: str, **kwargs) -> str:
        assert repo_id == MODEL
        self.calls.append(("snapshot_download", kwargs))
        chosen = list(
            filter_repo_objects(
                self.repo_files(),
                allow_patterns=kwargs.get("allow_patterns"),
                ignore_patterns=kwargs.get("ignore_patterns"),
            )
        )
        self.fetched.append(chosen)
        for name in chosen:
            self._place(name, kwargs)
        return str(self._snapshot(kwargs))

    def snapshot_kwargs(self) -> dict:
        (kwargs,) = [k for name, k in self.calls if name == "snapshot_download"]
        return kwargs


def _install(monkeypatch, repo: Path, cache: Path) -> FakeHub:
    hub = FakeHub(repo, cache)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    return hub


@pytest.fixture
def sharded_repo(tiny_snapshot, tmp_path) -> Path:
    """A tiny Llama with an index over several weight files, plus files no node loads."""
    repo = tmp_path / "repo"
    shutil.copytree(tiny_snapshot("llama"), repo, ignore=shutil.ignore_patterns(".*"))
    for name, data in UNWANTED.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    assert (repo / INDEX_FILE).exists()
    return repo


@pytest.fixture
def single_file_repo(tmp_path) -> Path:
    """A one-file checkpoint (no index), as small models ship, plus files no node loads."""
    repo = tmp_path / "repo"
    repo.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "model_type": "llama"}
    (repo / "config.json").write_text(json.dumps(config))
    (repo / "tokenizer.json").write_text("{}")
    (repo / "tokenizer.model").write_bytes(b"sentencepiece")
    (repo / "chat_template.jinja").write_text("{{ messages }}")
    (repo / "merges.txt").write_text("")
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, repo / "model.safetensors")
    for name, data in UNWANTED.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    return repo


def _weights(names: list[str]) -> list[str]:
    return sorted(n for n in names if n.endswith(".safetensors"))


def test_the_standard_hf_cache_is_used_unless_overridden(monkeypatch, sharded_repo, tmp_path):
    hub = _install(monkeypatch, sharded_repo, tmp_path / "hf-cache")
    fetch_from_hub(MODEL, LayerRange(0, 2), tmp_path / "meshnet-cache")
    assert len(hub.calls) == 3  # index, config, the subset
    for _name, kwargs in hub.calls:
        assert "cache_dir" not in kwargs  # HF_HUB_CACHE / HF_HOME decide
    # The main branch for the index, then the commit it came from: a branch may move.
    assert [kwargs["revision"] for _name, kwargs in hub.calls] == [None, COMMIT, COMMIT]

    own = tmp_path / "own-hub"
    hub = _install(monkeypatch, sharded_repo, tmp_path / "unused")
    fetch_from_hub(MODEL, LayerRange(0, 2), tmp_path / "meshnet-cache", hub_cache=own)
    assert [kwargs["cache_dir"] for _name, kwargs in hub.calls] == [own] * 3
    assert not (tmp_path / "meshnet-cache" / ".hub").exists()


def test_revision_reaches_every_hub_call(monkeypatch, sharded_repo, tmp_path):
    hub = _install(monkeypatch, sharded_repo, tmp_path / "hf-cache")
    fetch_shard(MODEL, LayerRange(0, 2), (), tmp_path / "cache", revision="v1.0")
    assert len(hub.calls) == 3
    assert all(kwargs["revision"] == "v1.0" for _name, kwargs in hub.calls)

    hub = _install(monkeypatch, sharded_repo, tmp_path / "hf-cache")
    fetch_shard_counted(
        MODEL, LayerRange(2, 4), (), tmp_path / "cache", metrics=Metrics(), revision=COMMIT
    )
    assert all(kwargs["revision"] == COMMIT for _name, kwargs in hub.calls)

    hub = _install(monkeypatch, sharded_repo, tmp_path / "hf-cache")
    fetch_shard(MODEL, LayerRange(0, 2), (), tmp_path / "cache")  # callers that pass none
    assert [kwargs["revision"] for _name, kwargs in hub.calls] == [None, COMMIT, COMMIT]


def test_hub_files_are_checked_against_the_trusted_manifest(monkeypatch, sharded_repo, tmp_path):
    from meshnet_common.models.shardfiles import ShardSource

    layers = LayerRange(2, 4)
    trusted = ShardSource(CheckpointIndex.load(sharded_repo), MODEL, layers, COMMIT).manifest()
    _install(monkeypatch, sharded_repo, tmp_path / "hf-cache")
    view = fetch_from_hub(MODEL, layers, tmp_path / "cache", revision=COMMIT)
    check_against(view, MODEL, layers, trusted)  # the same tensors: accepted
    # The hub's weights are not the tracker's (another revision, a tampered mirror).
    name = CheckpointIndex.load(sharded_repo).tensors_for(layers)[0]
    tampered = {**trusted, "tensors": [
        {**t, "sha256": "0" * 64} if t["name"] == name else t for t in trusted["tensors"]
    ]}  # fmt: skip
    with pytest.raises(FetchError, match="differ from the tracker's"):
        check_against(view, MODEL, layers, tampered)


@pytest.mark.parametrize(("start", "end"), [(0, 1), (0, 2), (2, 4), (3, 6), (5, 6), (0, 6)])
def test_the_subset_asks_only_for_the_ranges_files(monkeypatch, sharded_repo, tmp_path, start, end):
    layers = LayerRange(start, end)
    expected = CheckpointIndex.load(sharded_repo).files_for(layers)
    hub = _install(monkeypatch, sharded_repo, tmp_path / "hf-cache")
    fetch_from_hub(MODEL, layers, tmp_path / "cache")
    kwargs = hub.snapshot_kwargs()
    assert _weights(kwargs["allow_patterns"]) == expected
    assert "*" not in kwargs["allow_patterns"]
    assert {"original/*", "*.gguf"} <= set(kwargs["ignore_patterns"])
    (fetched,) = hub.fetched
    assert _weights(fetched) == expected
    assert not set(fetched) & set(UNWANTED)  # no subfolder, no other format, no duplicate
    assert {"config.json", "tokenizer.json", INDEX_FILE} <= set(fetched)


def test_a_partial_snapshot_is_loadable_through_its_view(monkeypatch, sharded_repo, tmp_path):
    from meshnet_node.engine.loader import load_shard

    full = CheckpointIndex.load(sharded_repo)
    layers = LayerRange(3, full.num_layers)  # the tail: layers, final norm, lm_head
    assert full.files_for(layers) != sorted({t.file for t in full.tensors.values()})
    _install(monkeypatch, sharded_repo, tmp_path / "hf-cache")
    view = fetch_from_hub(MODEL, layers, tmp_path / "cache")
    assert view.is_relative_to(tmp_path / "cache")
    index = CheckpointIndex.load(view)  # would fail on the hub's index: files are missing
    assert index.tensors_for(layers) == full.tensors_for(layers)
    shard = load_shard(view, layers)
    assert shard is not None
    # The HF cache's own files are left as they are: its index still lists every file.
    hub_index = json.loads((tmp_path / "hf-cache" / "snapshots" / COMMIT / INDEX_FILE).read_text())
    assert hub_index == json.loads((sharded_repo / INDEX_FILE).read_text())


def test_no_index_falls_back_to_a_snapshot_of_what_a_node_loads(
    monkeypatch, single_file_repo, tmp_path
):
    hub = _install(monkeypatch, single_file_repo, tmp_path / "hf-cache")
    path = fetch_from_hub(MODEL, LayerRange(0, 2), tmp_path / "cache", revision="main")
    kwargs = hub.snapshot_kwargs()
    assert kwargs["revision"] == "main"
    assert "*" not in kwargs["allow_patterns"]
    assert {"original/*", "*.gguf", "*.bin", "*.pth", "consolidated*"} <= set(
        kwargs["ignore_patterns"]
    )
    (fetched,) = hub.fetched
    assert sorted(fetched) == [
        "chat_template.jinja", "config.json", "merges.txt", "model.safetensors",
        "tokenizer.json", "tokenizer.model",
    ]  # fmt: skip
    assert path == tmp_path / "hf-cache" / "snapshots" / "main"
    assert (path / "model.safetensors").exists() and not (path / "original").exists()


def test_the_pattern_tuples():
    assert "*" not in HUB_SNAPSHOT_PATTERNS
    assert {"*.safetensors", "*.json", "tokenizer*", "*.model"} <= set(HUB_SNAPSHOT_PATTERNS)
    assert {"original/*", "*.gguf", "*.onnx", "*.msgpack", "*.h5", "*.pt"} <= set(
        HUB_IGNORE_PATTERNS
    )


def test_hub_failures_are_a_fetch_error_then_a_model_error(monkeypatch, tmp_path):
    empty = tmp_path / "repo"
    empty.mkdir()
    hub = _install(monkeypatch, empty, tmp_path / "hf-cache")

    def offline(repo_id: str, **kwargs) -> str:
        hub.calls.append(("snapshot_download", kwargs))
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FetchError, match="HF hub: offline"):
        fetch_from_hub(MODEL, LayerRange(0, 2), tmp_path / "cache")
    with pytest.raises(ModelError, match="hub: HF hub: offline"):
        fetch_shard(MODEL, LayerRange(0, 2), (), tmp_path / "cache")

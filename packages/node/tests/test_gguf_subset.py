"""A layer range of a GGUF as a GGUF of its own (``gguf_subset``), as the tracker and peers
send it to a joining node: only the range's tensors (their bytes as in the source), the
metadata kept, the same bytes whoever serves it (a peer serves its subset's subset), and
stages loaded from subsets compute what one stage on the whole file does, bit for bit.
Also: a models dir holds GGUFs in the plain layout ``ORG/NAME/FILE.gguf``."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from baselines import split_greedy

from meshnet_common.errors import ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.gguf_header import read_header
from meshnet_common.models.gguf_import import smollm2_gguf_path
from meshnet_common.models.models_dir import resolve_snapshot, scan_models_dir
from meshnet_common.models.shardfiles import ShardSource
from meshnet_common.precision import Precision
from meshnet_common.tiny.gguf_files import write_gguf
from meshnet_common.tiny.snapshots import make_tiny
from meshnet_common.web.shards import snapshot_revision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage

RANGES = [(0, 10), (10, 20), (20, 30)]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"


@pytest.fixture(scope="module")
def subsets(tmp_path_factory) -> dict[tuple[int, int], Path]:
    source = CheckpointIndex.load(smollm2_gguf_path())
    root = tmp_path_factory.mktemp("subsets")
    out = {}
    for a, b in RANGES:
        folder = root / f"{a}-{b}"
        folder.mkdir()
        served = ShardSource(source, MODEL, LayerRange(a, b), "r")
        assert served.files() == ["model.gguf"]  # config and tokenizer ride in its metadata
        with open(folder / "model.gguf", "wb") as fh:
            for chunk in served.iter_file("model.gguf"):
                fh.write(chunk)
        assert (folder / "model.gguf").stat().st_size == served.size_of("model.gguf")
        out[a, b] = folder
    return out


def test_a_subset_holds_only_its_layers_bytes(subsets):
    path = smollm2_gguf_path()
    whole = read_header(path)
    by_name = {t.name: t for t in whole.tensors}
    for (a, b), folder in subsets.items():
        header = read_header(folder / "model.gguf")
        assert header.metadata == whole.metadata
        blocks = {int(t.name.split(".")[1]) for t in header.tensors if t.name.startswith("blk.")}
        assert blocks == set(range(a, b))
        with open(path, "rb") as src, open(folder / "model.gguf", "rb") as sub:
            for t in header.tensors:
                src.seek(by_name[t.name].offset)
                sub.seek(t.offset)
                assert sub.read(t.nbytes) == src.read(t.nbytes), t.name
    globals_of = lambda ab: {  # noqa: E731
        t.name for t in read_header(subsets[ab] / "model.gguf").tensors if "blk." not in t.name
    }
    assert globals_of((0, 10)) == {"token_embd.weight"}
    assert globals_of((10, 20)) == set()
    assert globals_of((20, 30)) == {"token_embd.weight", "output_norm.weight"}  # tied output
    assert (subsets[10, 20] / "model.gguf").stat().st_size < 0.3 * path.stat().st_size


def test_a_peer_serves_the_same_bytes_and_revision(subsets):
    source = CheckpointIndex.load(smollm2_gguf_path())
    for (a, b), folder in subsets.items():
        held = CheckpointIndex.load(folder)  # a folder holding one GGUF indexes as that GGUF
        assert set(held.tensors_for(LayerRange(a, b))) == set(source.tensors_for(LayerRange(a, b)))
        again = ShardSource(held, MODEL, LayerRange(a, b), "r")
        digest = hashlib.sha256(b"".join(again.iter_file("model.gguf"))).hexdigest()
        assert digest == hashlib.sha256((folder / "model.gguf").read_bytes()).hexdigest()
        assert snapshot_revision(held) == snapshot_revision(source)
        mine = ShardSource(source, MODEL, LayerRange(a, b), "r").manifest()
        assert again.manifest()["files"] == mine["files"]
        assert again.manifest()["tensors"] == mine["tensors"]


def test_stages_from_subsets_equal_one_stage_on_the_file(subsets):
    prompt = list(range(100, 130))
    split = [
        Stage(load_shard(subsets[ab], LayerRange(*ab), Precision.INT4, dtype=torch.float32))
        for ab in RANGES
    ]
    one = [Stage(load_shard(smollm2_gguf_path(), LayerRange(0, 30), Precision.INT4,
                            dtype=torch.float32))]  # fmt: skip
    tokens, logits = split_greedy(split, prompt, 4)
    one_tokens, one_logits = split_greedy(one, prompt, 4)
    assert tokens == one_tokens
    assert all(torch.equal(x, y) for x, y in zip(logits, one_logits, strict=True))


def test_models_dir_lists_a_gguf_in_the_plain_layout(tmp_path):
    folder = tmp_path / MODEL
    folder.mkdir(parents=True)
    (folder / "model.Q4_1.gguf").symlink_to(smollm2_gguf_path())
    scan = scan_models_dir(tmp_path)
    assert [e.model_id for e in scan.entries] == [MODEL] and not scan.problems
    assert scan.entries[0].num_layers == 30
    assert resolve_snapshot(tmp_path, MODEL) == folder
    (folder / "model.Q8_0.gguf").symlink_to(smollm2_gguf_path())
    scan = scan_models_dir(tmp_path)
    assert not scan.entries and "several GGUF files" in scan.problems[0].message
    for p in folder.iterdir():
        p.unlink()
    (folder / "m-00001-of-00002.gguf").symlink_to(smollm2_gguf_path())
    with pytest.raises(ModelError, match="split GGUF file.s. missing: m-00002-of-00002.gguf"):
        CheckpointIndex.load(folder)


def test_llama_cpp_split_files_are_one_model(tmp_path):
    """A split set (``NAME-0000i-of-0000N.gguf``) indexes as the one file it was cut from;
    stages read from it, and from the one GGUF a joining node receives of it, equal one
    stage on the unsplit file bit for bit."""
    snapshot = make_tiny(tmp_path, "qwen3_moe", "tiny/qwen3_moe", layers=4, hidden=256, intermediate=512)  # fmt: skip
    (tmp_path / "whole").mkdir()
    (tmp_path / "split").mkdir()
    whole = write_gguf(snapshot, tmp_path / "whole" / "m.gguf", "Q4_K")
    first = write_gguf(snapshot, tmp_path / "split" / "m.gguf", "Q4_K", split_max_tensors=20)
    assert len(list(first.parent.iterdir())) == 3
    one, cut = CheckpointIndex.load(whole), CheckpointIndex.load(first.parent)
    assert {n: (t.dtype, t.shape) for n, t in one.tensors.items()} == {
        n: (t.dtype, t.shape) for n, t in cut.tensors.items()
    }
    assert len({t.file for t in cut.tensors.values()}) == 3
    served = ShardSource(cut, "tiny/qwen3_moe", LayerRange(2, 4), "r")
    unsplit = ShardSource(one, "tiny/qwen3_moe", LayerRange(2, 4), "r")
    assert served.manifest()["tensors"] == unsplit.manifest()["tensors"]  # the same bytes
    (tmp_path / "received").mkdir()
    (tmp_path / "received" / "model.gguf").write_bytes(b"".join(served.iter_file("model.gguf")))
    prompt = list(range(3, 30))
    stages = [
        Stage(load_shard(first.parent, LayerRange(0, 2), Precision.INT4, dtype=torch.float32)),
        Stage(load_shard(tmp_path / "received", LayerRange(2, 4), Precision.INT4,
                         dtype=torch.float32)),
    ]  # fmt: skip
    ref = [Stage(load_shard(whole, LayerRange(0, 4), Precision.INT4, dtype=torch.float32))]
    tokens, logits = split_greedy(stages, prompt, 4)
    ref_tokens, ref_logits = split_greedy(ref, prompt, 4)
    assert tokens == ref_tokens
    assert all(torch.equal(x, y) for x, y in zip(logits, ref_logits, strict=True))
    (first.parent / first.name.replace("00001", "00002")).unlink()
    with pytest.raises(ModelError, match="missing"):
        CheckpointIndex.load(first.parent)

"""The models directory: both layouts, listing, resolution and how broken snapshots surface."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from meshnet_common.errors import InvalidRequest, ModelError, NotFound
from meshnet_common.models.checkpoint import INDEX_FILE, CheckpointIndex
from meshnet_common.models.models_dir import (
    find_snapshot,
    load_entry,
    resolve_snapshot,
    scan_models_dir,
    snapshot_path_for,
    staged_snapshot,
    validate_model_id,
)

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _plain(models_dir: Path, model_id: str, source: Path) -> Path:
    return shutil.copytree(source, models_dir / model_id)


def _hub(models_dir: Path, model_id: str, source: Path, revision: str = REVISION) -> Path:
    org, name = model_id.split("/")
    repo = models_dir / f"models--{org}--{name}"
    snapshot = shutil.copytree(source, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision + "\n")  # huggingface_hub writes no newline
    return snapshot


@pytest.fixture
def two_layouts(tmp_path, tiny_snapshot) -> Path:
    """A models dir with a plain Llama and a hub-layout GPT-2."""
    _plain(tmp_path, "acme/llama-tiny", tiny_snapshot("llama"))
    _hub(tmp_path, "acme/gpt2-tiny", tiny_snapshot("gpt2"))
    return tmp_path


def test_scan_lists_both_layouts(two_layouts):
    entries, problems = scan_models_dir(two_layouts)
    assert problems == []
    assert [e.model_id for e in entries] == ["acme/gpt2-tiny", "acme/llama-tiny"]
    gpt2, llama = entries

    assert gpt2.layout == "hub"
    assert gpt2.revision == REVISION
    assert gpt2.path == two_layouts / "models--acme--gpt2-tiny" / "snapshots" / REVISION
    assert gpt2.architecture == "GPT2LMHeadModel"

    assert llama.layout == "plain"
    assert llama.revision is None
    assert llama.path == two_layouts / "acme" / "llama-tiny"
    assert llama.architecture == "LlamaForCausalLM"

    for entry in entries:
        index = CheckpointIndex.load(entry.path)
        assert entry.num_layers == 6
        assert entry.dtype == "BF16"
        assert entry.size_bytes == index.total_bytes
        assert list(entry.files) == sorted({t.file for t in index.tensors.values()})
        assert len(entry.files) >= 2
        assert json.loads(json.dumps(entry.to_json()))["path"] == str(entry.path)


def test_hub_snapshot_of_symlinks_into_blobs(tmp_path, tiny_snapshot):
    """What huggingface_hub really leaves: snapshot files are links to ../../blobs/<hash>."""
    repo = tmp_path / "models--acme--linked"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for source in tiny_snapshot("qwen3").iterdir():
        blob = repo / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        shutil.copyfile(source, blob)
        (snapshot / source.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    entries, problems = scan_models_dir(tmp_path)
    assert problems == []
    assert [(e.model_id, e.path, e.architecture) for e in entries] == [
        ("acme/linked", snapshot, "Qwen3ForCausalLM")
    ]


def test_resolve_both_layouts(two_layouts):
    assert resolve_snapshot(two_layouts, "acme/llama-tiny") == two_layouts / "acme" / "llama-tiny"
    hub = resolve_snapshot(str(two_layouts), "acme/gpt2-tiny")
    assert hub == two_layouts / "models--acme--gpt2-tiny" / "snapshots" / REVISION
    assert load_entry(two_layouts, "acme/gpt2-tiny").layout == "hub"


def test_resolve_unknown_lists_known_ids(two_layouts):
    with pytest.raises(NotFound) as info:
        resolve_snapshot(two_layouts, "acme/missing")
    message = str(info.value)
    assert "acme/missing" in message
    assert "acme/gpt2-tiny" in message and "acme/llama-tiny" in message
    assert info.value.status == 404


@pytest.mark.parametrize(
    "bad_id",
    ["../etc", "acme/..", "../../x", "/abs/path", "acme/b/c", "acme", "", "acme/", "/x",
     "ac me/x", "acme/x\x00", "acme/a--b", ".", "./x", "acme/.", "acme\\..\\x"],
)  # fmt: skip
def test_bad_model_ids_are_refused(two_layouts, bad_id):
    with pytest.raises(InvalidRequest):
        validate_model_id(bad_id)
    with pytest.raises(InvalidRequest):
        resolve_snapshot(two_layouts, bad_id)
    with pytest.raises(InvalidRequest):
        snapshot_path_for(two_layouts, bad_id, "plain")


def test_good_model_ids():
    assert validate_model_id("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB",
        "SmolLM2-135M-Instruct",
    )
    assert validate_model_id("a.b/c_d-1.5") == ("a.b", "c_d-1.5")


def test_snapshot_path_for(tmp_path):
    assert snapshot_path_for(tmp_path, "o/n", "plain") == tmp_path / "o" / "n"
    hub = snapshot_path_for(tmp_path, "o/n", "hub", "abc")
    assert hub == tmp_path / "models--o--n" / "snapshots" / "abc"
    with pytest.raises(InvalidRequest):
        snapshot_path_for(tmp_path, "o/n", "hub")  # hub needs a revision
    with pytest.raises(InvalidRequest):
        snapshot_path_for(tmp_path, "o/n", "hub", "../x")
    with pytest.raises(InvalidRequest):
        snapshot_path_for(tmp_path, "o/n", "zip")


def test_corrupt_index_is_a_problem_naming_the_path(two_layouts):
    broken = _plain(two_layouts, "acme/broken", two_layouts / "acme" / "llama-tiny")
    (broken / INDEX_FILE).write_text("{not json")
    entries, problems = scan_models_dir(two_layouts)
    # One bad model does not hide the others.
    assert [e.model_id for e in entries] == ["acme/gpt2-tiny", "acme/llama-tiny"]
    assert len(problems) == 1
    assert problems[0].path == broken
    assert str(broken / INDEX_FILE) in problems[0].message
    with pytest.raises(ModelError, match=str(broken)):
        load_entry(two_layouts, "acme/broken")


def test_unknown_architecture_is_a_problem(two_layouts):
    odd = _hub(two_layouts, "acme/odd", two_layouts / "acme" / "llama-tiny")
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (odd / "config.json").write_text(json.dumps(config))
    _, problems = scan_models_dir(two_layouts)
    assert [p.path for p in problems] == [odd]
    assert "FalconForCausalLM" in problems[0].message
    assert str(odd) in problems[0].message


def test_dangling_hub_ref_is_a_problem(two_layouts):
    repo = two_layouts / "models--acme--gpt2-tiny"
    (repo / "refs" / "main").write_text("feedface")
    entries, problems = scan_models_dir(two_layouts)
    assert [e.model_id for e in entries] == ["acme/llama-tiny"]
    assert len(problems) == 1 and "feedface" in problems[0].message
    assert str(repo / "refs" / "main") in problems[0].message
    with pytest.raises(ModelError, match="feedface"):
        resolve_snapshot(two_layouts, "acme/gpt2-tiny")


def test_hub_without_ref_uses_the_only_snapshot(two_layouts):
    repo = two_layouts / "models--acme--gpt2-tiny"
    (repo / "refs" / "main").unlink()
    assert resolve_snapshot(two_layouts, "acme/gpt2-tiny").name == REVISION
    shutil.copytree(repo / "snapshots" / REVISION, repo / "snapshots" / "other")
    _, problems = scan_models_dir(two_layouts)
    assert len(problems) == 1 and "no refs/main" in problems[0].message


def test_folder_without_config_is_a_problem_but_empty_ones_are_ignored(two_layouts):
    stray = two_layouts / "acme" / "weights-only"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"")
    (two_layouts / "acme" / "empty").mkdir()
    (two_layouts / ".staging-leftover").mkdir()  # hidden: a writer's staging folder
    (two_layouts / "README.txt").write_text("not a model")
    _, problems = scan_models_dir(two_layouts)
    assert [(p.path, p.message) for p in problems] == [(stray, f"{stray}: no config.json")]


def test_same_id_in_both_layouts_prefers_plain(two_layouts):
    _hub(two_layouts, "acme/llama-tiny", two_layouts / "acme" / "llama-tiny")
    entries, problems = scan_models_dir(two_layouts)
    assert [(e.model_id, e.layout) for e in entries] == [
        ("acme/gpt2-tiny", "hub"),
        ("acme/llama-tiny", "plain"),
    ]
    assert len(problems) == 1 and "also present" in problems[0].message
    assert resolve_snapshot(two_layouts, "acme/llama-tiny") == two_layouts / "acme" / "llama-tiny"


def test_missing_or_non_directory_models_dir(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelError, match=str(missing)):
        scan_models_dir(missing)
    with pytest.raises(ModelError, match=str(missing)):
        resolve_snapshot(missing, "a/b")
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ModelError, match=str(a_file)):
        scan_models_dir(a_file)


def test_unreadable_models_dir_names_the_path(tmp_path, monkeypatch):
    real_iterdir = Path.iterdir

    def refuse(self):
        if self == tmp_path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    # Simulated: the tests may run as root, for whom chmod 000 changes nothing.
    monkeypatch.setattr(Path, "iterdir", refuse)
    with pytest.raises(ModelError, match=f"{tmp_path}.*Permission denied"):
        scan_models_dir(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_unreadable_org_folder_is_a_problem(two_layouts):
    org = two_layouts / "acme"
    org.chmod(0)
    try:
        entries, problems = scan_models_dir(two_layouts)
    finally:
        org.chmod(0o755)
    assert [e.model_id for e in entries] == ["acme/gpt2-tiny"]
    assert [p.path for p in problems] == [org]


def test_staged_snapshot_publishes_atomically(tmp_path):
    with staged_snapshot(tmp_path, "o/n", "plain") as staged:
        (staged.folder / "config.json").write_text("{}")
        assert find_snapshot(tmp_path, "o/n", "plain") is None  # invisible until done
    assert staged.path == tmp_path / "o" / "n"
    assert (staged.path / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no staging left behind


def test_staged_snapshot_hub_writes_ref_and_content_revision(tmp_path):
    with staged_snapshot(tmp_path, "o/n", "hub") as staged:
        (staged.folder / "config.json").write_text("{}")
    revision = (tmp_path / "models--o--n" / "refs" / "main").read_text()
    assert len(revision) == 40
    assert staged.path == snapshot_path_for(tmp_path, "o/n", "hub", revision)
    assert find_snapshot(tmp_path, "o/n", "hub") == staged.path


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), staged_snapshot(tmp_path, "o/n", "hub") as staged:
        (staged.folder / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")
    assert list(tmp_path.iterdir()) == []


def test_existing_snapshot_is_kept_unless_replace(tmp_path):
    with staged_snapshot(tmp_path, "o/n", "plain") as staged:
        (staged.folder / "config.json").write_text("1")
    with (
        pytest.raises(ModelError, match="already exists"),
        staged_snapshot(tmp_path, "o/n", "plain") as staged,
    ):
        (staged.folder / "config.json").write_text("2")
    assert (tmp_path / "o" / "n" / "config.json").read_text() == "1"
    with staged_snapshot(tmp_path, "o/n", "plain", replace=True) as staged:
        (staged.folder / "config.json").write_text("3")
    assert (tmp_path / "o" / "n" / "config.json").read_text() == "3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]

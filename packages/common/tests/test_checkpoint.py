"""CheckpointIndex over tiny random snapshots: which tensors and files a layer range needs."""

from __future__ import annotations

import json
import shutil

import pytest

from meshnet_common.errors import ModelError, UnsupportedArchitecture
from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import INDEX_FILE, CheckpointIndex

HEAD, MIDDLE, TAIL = LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 6)


def _layers_of(index: CheckpointIndex, names: list[str]) -> set[int]:
    return {layer for name in names if (layer := index.layer_of(name)) is not None}


def _non_layer(index: CheckpointIndex, names: list[str]) -> set[str]:
    return {name for name in names if index.layer_of(name) is None}


def test_tied_llama_ranges(tiny_snapshot):
    index = CheckpointIndex.load(tiny_snapshot("llama"))
    assert index.architecture == "LlamaForCausalLM"
    assert index.num_layers == 6
    assert index.tied_embeddings
    assert "lm_head.weight" not in index.tensors

    head, middle, tail = (index.tensors_for(r) for r in (HEAD, MIDDLE, TAIL))
    assert _layers_of(index, head) == {0, 1}
    assert _non_layer(index, head) == {"model.embed_tokens.weight"}
    assert _layers_of(index, middle) == {2, 3}
    assert _non_layer(index, middle) == set()
    assert _layers_of(index, tail) == {4, 5}
    # Tied: the tail computes logits with the embedding matrix.
    assert _non_layer(index, tail) == {"model.norm.weight", "model.embed_tokens.weight"}


def test_untied_mistral_tail_gets_lm_head(tiny_snapshot):
    index = CheckpointIndex.load(tiny_snapshot("mistral"))
    assert not index.tied_embeddings
    assert _non_layer(index, index.tensors_for(TAIL)) == {"model.norm.weight", "lm_head.weight"}
    assert _non_layer(index, index.tensors_for(HEAD)) == {"model.embed_tokens.weight"}


def test_gpt2_head_and_tail(tiny_snapshot):
    index = CheckpointIndex.load(tiny_snapshot("gpt2"))
    assert index.architecture == "GPT2LMHeadModel"
    assert index.tied_embeddings
    assert _non_layer(index, index.tensors_for(HEAD)) == {
        "transformer.wte.weight",
        "transformer.wpe.weight",
    }
    assert _non_layer(index, index.tensors_for(MIDDLE)) == set()
    assert _non_layer(index, index.tensors_for(TAIL)) == {
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
        "transformer.wte.weight",
    }


def test_full_range_is_every_tensor(tiny_snapshot):
    index = CheckpointIndex.load(tiny_snapshot("qwen3"))
    assert sorted(index.tensors_for(LayerRange(0, 6))) == sorted(index.tensors)
    assert index.bytes_for(LayerRange(0, 6)) == index.total_bytes


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_bytes_for_sums_tensor_sizes(tiny_snapshot, family):
    index = CheckpointIndex.load(tiny_snapshot(family))
    for layers in (HEAD, MIDDLE, TAIL):
        expected = sum(index.tensors[n].nbytes for n in index.tensors_for(layers))
        assert index.bytes_for(layers) == expected > 0
    split = sum(index.bytes_for(r) for r in (HEAD, MIDDLE, TAIL))
    # A tied embedding is held twice (head and tail); otherwise the split is exact.
    shared = index.tensors[index.naming.tied_embedding].nbytes if index.tied_embeddings else 0
    assert split == index.total_bytes + shared


def test_files_for_covers_tensors_and_layers_straddle(tiny_snapshot):
    index = CheckpointIndex.load(tiny_snapshot("llama"))
    all_files = {t.file for t in index.tensors.values()}
    assert len(all_files) >= 3
    for layers in (HEAD, MIDDLE, TAIL):
        files = index.files_for(layers)
        assert files == sorted({index.tensors[n].file for n in index.tensors_for(layers)})
    assert set().union(*(index.files_for(r) for r in (HEAD, MIDDLE, TAIL))) == all_files
    # The point of the tiny shard size: some single layer spans two files.
    straddling = [i for i in range(6) if len(index.files_for(LayerRange(i, i + 1))) > 1]
    assert straddling


def test_range_beyond_model_is_refused(tiny_snapshot):
    index = CheckpointIndex.load(tiny_snapshot("llama"))
    with pytest.raises(ValueError, match="exceeds"):
        index.tensors_for(LayerRange(4, 7))


def test_dtype_and_auxiliary_files(tiny_snapshot):
    index = CheckpointIndex.load(tiny_snapshot("qwen2"))
    assert index.dtype == "BF16"
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(
        index.auxiliary_files()
    )


def test_missing_shard_names_the_file(tiny_snapshot, tmp_path):
    snapshot = shutil.copytree(tiny_snapshot("llama"), tmp_path / "llama")
    victim = sorted(snapshot.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelError, match=victim.name):
        CheckpointIndex.load(snapshot)


def test_unknown_architecture_names_the_config(tiny_snapshot, tmp_path):
    snapshot = shutil.copytree(tiny_snapshot("llama"), tmp_path / "llama")
    config = json.loads((snapshot / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (snapshot / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture, match=str(snapshot)):
        CheckpointIndex.load(snapshot)


def test_index_file_escaping_the_snapshot_is_refused(tiny_snapshot, tmp_path):
    snapshot = shutil.copytree(tiny_snapshot("llama"), tmp_path / "llama")
    index_path = snapshot / INDEX_FILE
    data = json.loads(index_path.read_text())
    name = next(iter(data["weight_map"]))
    data["weight_map"][name] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(data))
    with pytest.raises(ModelError, match="escapes"):
        CheckpointIndex.load(snapshot)

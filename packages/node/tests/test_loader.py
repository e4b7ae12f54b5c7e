"""Loading only a shard: right modules materialized, nothing left on meta, bad input refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from meshnet_common.errors import (
    InsufficientMemory,
    InvalidRequest,
    ModelError,
    UnsupportedArchitecture,
)
from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.preflight import preflight, resolve_precision_for, weight_bytes
from meshnet_node.engine.quantization import check_nf4_widths


@pytest.mark.parametrize(
    "family", ["llama", "mistral", "gpt2", "gemma3", "phi3", "mixtral", "deepseek_v3", "gpt_oss"]
)
def test_roles_follow_the_range(tiny_snapshot, family):
    snapshot = tiny_snapshot(family)
    head = load_shard(snapshot, LayerRange(0, 2))
    middle = load_shard(snapshot, LayerRange(2, 4))
    tail = load_shard(snapshot, LayerRange(4, 6))
    assert head.modules.embed is not None and head.modules.lm_head is None
    assert (head.modules.position_embed is not None) == (family == "gpt2")
    assert middle.modules.embed is None and middle.modules.norm is None
    assert tail.modules.lm_head is not None and tail.modules.embed is None
    for shard in (head, middle, tail):
        assert len(shard.modules.layers) == 2
        assert not any(p.is_meta for p in shard.modules.parameters())
        assert not any(b.is_meta for b in shard.modules.buffers())
        kept = [n for n, p in shard.modules.named_parameters() if p.dtype != torch.bfloat16]
        assert all(n.endswith("mlp.gate.weight") for n in kept), kept  # fp32 routers only


@pytest.mark.parametrize("family", ["mistral", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_resident_bytes_match_the_checkpoint_subset(tiny_snapshot, family):
    """Per-expert hub tensors stacked into fused experts: exactly the range's bytes resident
    (MoE layers and dense ones differ in size, each priced by its own tensors)."""
    snapshot = tiny_snapshot(family)
    index = CheckpointIndex.load(snapshot)
    for layers in (LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 6)):
        shard = load_shard(snapshot, layers)
        # exact, but for routers transformers keeps in float32 (DeepSeek's gate): < 1 %
        expected = weight_bytes(index, layers, Precision.BFLOAT16)
        assert shard.parameter_bytes() == pytest.approx(expected, rel=0.01)
    full = weight_bytes(index, LayerRange(0, 6), Precision.BFLOAT16)
    assert weight_bytes(index, LayerRange(2, 4), Precision.BFLOAT16) < full / 2


@pytest.mark.parametrize(
    ("family", "precision", "dtype", "group"),
    [
        ("llama", Precision.INT4, "bfloat16", 64),
        ("gpt2", Precision.INT8, "bfloat16", 64),
        ("mixtral", Precision.INT4, "bfloat16", 32),
        ("deepseek_v3", Precision.INT8, "bfloat16", 64),
        ("gpt_oss", Precision.INT8, "float32", 64),
        ("qwen2_moe", Precision.INT4, "float32", 64),
    ],
)
def test_packed_shards_hold_what_memory_accounting_predicts(
    tiny_snapshot, family, precision, dtype, group
):
    """Placement and preflight price a range with ``ModelCosts``; the loader packs the
    tensors ``quantized_tensor`` names: the bytes agree (routers kept float32 aside)."""
    snapshot = tiny_snapshot(family)
    layers = LayerRange(1, 4)
    shard = load_shard(snapshot, layers, precision, dtype=getattr(torch, dtype), group_size=group)
    held = {t.data_ptr(): t.numel() * t.element_size()
            for t in (*shard.modules.parameters(), *shard.modules.buffers())}  # fmt: skip
    index = CheckpointIndex.load(snapshot)
    expected = weight_bytes(index, layers, precision, dtype=dtype, group_size=group)
    assert sum(held.values()) == pytest.approx(expected, rel=0.02)


def test_tied_tail_uses_the_embedding(tiny_snapshot):
    snapshot = tiny_snapshot("llama")  # tiny llama ties embeddings
    index = CheckpointIndex.load(snapshot)
    assert "lm_head.weight" not in index.tensors
    tail = load_shard(snapshot, LayerRange(3, 6))
    with torch.no_grad():
        from safetensors import safe_open

        info = index.tensors["model.embed_tokens.weight"]
        with safe_open(str(snapshot / info.file), "pt") as fh:
            embed = fh.get_tensor("model.embed_tokens.weight")
    assert torch.equal(tail.modules.lm_head.weight, embed)


def test_unsupported_architecture_is_refused(tiny_snapshot, tmp_path):
    copy = tmp_path / "weird"
    shutil.copytree(tiny_snapshot("llama"), copy)
    config = json.loads((copy / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture) as info:
        load_shard(copy, LayerRange(0, 2))
    assert "LlamaForCausalLM" in str(info.value)


def test_missing_tensor_is_refused(tiny_snapshot, tmp_path):
    copy = tmp_path / "broken"
    shutil.copytree(tiny_snapshot("llama"), copy)
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = next(n for n in index["weight_map"] if n.startswith("model.layers.1."))
    # Rewrite the file holding it without that tensor.
    from safetensors.torch import load_file, save_file

    fname = index["weight_map"].pop(victim)
    tensors = load_file(copy / fname)
    tensors.pop(victim)
    save_file(tensors, copy / fname, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelError, match="lacks tensors"):
        load_shard(copy, LayerRange(0, 2))
    load_shard(copy, LayerRange(2, 4))  # other ranges still load


def test_range_outside_the_model_is_refused(tiny_snapshot):
    with pytest.raises(ValueError):
        load_shard(tiny_snapshot("llama"), LayerRange(4, 7))


def test_preflight_refuses_an_oversized_shard(tiny_snapshot):
    index = CheckpointIndex.load(tiny_snapshot("llama"))
    with pytest.raises(InsufficientMemory) as info:
        preflight(index, LayerRange(0, 6), Precision.BFLOAT16, declared_gb=0.0001)
    assert "needs" in str(info.value) and "declared" in str(info.value)
    with pytest.raises(InsufficientMemory):
        preflight(index, LayerRange(0, 6), Precision.BFLOAT16, kv_budget_tokens=10**12)
    ok = preflight(index, LayerRange(0, 6), Precision.BFLOAT16, declared_gb=1.0)
    assert ok.weight_bytes == index.bytes_for(LayerRange(0, 6))
    fp32 = preflight(index, LayerRange(0, 6), Precision.FLOAT32, declared_gb=1.0)
    assert fp32.weight_bytes == 2 * ok.weight_bytes


def test_quantized_estimates_shrink(tiny_snapshot):
    index = CheckpointIndex.load(tiny_snapshot("mistral"))
    layers = LayerRange(1, 5)  # no embeddings: almost all bytes are Linear weights
    bf16 = weight_bytes(index, layers, Precision.BFLOAT16)
    assert weight_bytes(index, layers, Precision.INT8) < 0.6 * bf16
    assert weight_bytes(index, layers, Precision.NF4) < 0.4 * bf16


def test_preflight_prices_the_resolved_precision_dtype_and_group(tiny_snapshot):
    index = CheckpointIndex.load(tiny_snapshot("llama"))
    layers = LayerRange(1, 5)
    bf16 = preflight(index, layers, Precision.BFLOAT16, declared_gb=1.0)
    int4 = preflight(index, layers, Precision.INT4, declared_gb=1.0, group_size=32)
    assert int4.weight_bytes < bf16.weight_bytes / 3 and int4.kv_bytes == bf16.kv_bytes
    wide = preflight(index, layers, Precision.INT4, declared_gb=1.0, group_size=32,
                     dtype="float32")  # fmt: skip
    assert wide.kv_bytes == 2 * int4.kv_bytes and wide.weight_bytes > int4.weight_bytes
    with pytest.raises(InsufficientMemory, match="at int4 g32 · float32 do not fit"):
        preflight(index, layers, Precision.INT4, declared_gb=0.0001, group_size=32,
                  dtype="float32")  # fmt: skip
    with pytest.raises(ModelError, match="fp8 needs a checkpoint that ships it"):
        preflight(index, layers, Precision.FP8, declared_gb=1.0)


def test_a_node_resolves_its_precision_from_the_checkpoint(tiny_snapshot):
    from meshnet_node.launch import expected_precision
    from meshnet_node.settings import NodeSettings

    index = CheckpointIndex.load(tiny_snapshot("llama"))  # plain bfloat16 weights
    auto = NodeSettings.exactly()
    assert resolve_precision_for(auto, index) == (Precision.BFLOAT16, "bfloat16")
    wide = NodeSettings.exactly(quantization="int8", dtype="float32")
    assert resolve_precision_for(wide, index) == (Precision.INT8, "float32")
    assert resolve_precision_for(NodeSettings.exactly(quantization="float32"), index) == (
        Precision.FLOAT32, "float32",
    )  # fmt: skip
    with pytest.raises(InvalidRequest, match="ships plain weights"):
        resolve_precision_for(NodeSettings.exactly(quantization="fp8"), index)
    # before the weights are here: as the tracker resolved it, else as asked
    assert expected_precision(auto, index) is Precision.BFLOAT16
    assert expected_precision(auto, None, Precision.MXFP4) is Precision.MXFP4
    assert expected_precision(NodeSettings.exactly(quantization="fp8"), None) is Precision.FP8
    assert expected_precision(auto, None) is Precision.BFLOAT16


def test_nf4_width_check():
    check_nf4_widths({"a": 64, "b": 4096}, "cpu")
    check_nf4_widths({"a": 50}, "cuda")
    with pytest.raises(ModelError, match="multiple of 32"):
        check_nf4_widths({"model.layers.0.mlp.up_proj.weight": 50}, "cpu")

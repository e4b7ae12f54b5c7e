"""Mixture-of-Experts shards: only the range's experts are read, per-layer costs, the KV
layout of latent attention, and quantization refused rather than pretended."""

from __future__ import annotations

import pytest
import torch

from meshnet_common.errors import InsufficientMemory, ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.memory import ModelCosts
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.preflight import preflight
from meshnet_node.engine.stage import Stage
from meshnet_tracker.placement import ModelView, NodeRequest, place


def test_hub_checkpoints_name_each_expert(tiny_snapshot):
    """The tiny models are saved as hub checkpoints are: one tensor per expert."""
    mixtral = CheckpointIndex.load(tiny_snapshot("mixtral"))
    assert "model.layers.3.block_sparse_moe.experts.2.w1.weight" in mixtral.tensors
    deepseek = CheckpointIndex.load(tiny_snapshot("deepseek_v3"))
    assert "model.layers.3.mlp.experts.1.gate_proj.weight" in deepseek.tensors
    assert "model.layers.3.mlp.shared_experts.up_proj.weight" in deepseek.tensors
    assert "model.layers.0.mlp.gate_proj.weight" in deepseek.tensors  # first_k_dense_replace
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in deepseek.tensors


def test_a_range_reads_only_its_own_experts(tiny_snapshot):
    index = CheckpointIndex.load(tiny_snapshot("qwen3_moe"))
    names = index.tensors_for(LayerRange(2, 4))
    assert names and all(index.layer_of(n) in (2, 3) for n in names)
    experts = [n for n in names if ".experts." in n]
    assert len(experts) == 2 * 4 * 3  # 2 layers x 4 experts x (gate, up, down)
    assert index.bytes_for(LayerRange(2, 4)) == sum(index.tensors[n].nbytes for n in names)


def test_per_layer_costs_follow_dense_and_sparse_layers(tiny_snapshot):
    """DeepSeek's first layer is dense, Qwen2-MoE mixes dense and sparse layers: costs are
    per layer, from each layer's own tensors."""
    costs = ModelCosts.from_index(CheckpointIndex.load(tiny_snapshot("deepseek_v3")))
    per_layer = [a + b for a, b in zip(costs.layer_quantizable, costs.layer_other, strict=True)]
    assert per_layer[0] < per_layer[1] and len(set(per_layer[1:])) == 1
    qwen = ModelCosts.from_index(CheckpointIndex.load(tiny_snapshot("qwen2_moe")))
    sizes = [a + b for a, b in zip(qwen.layer_quantizable, qwen.layer_other, strict=True)]
    assert sizes[0] < sizes[1] and sizes[1] > sizes[2]  # 0 dense, 1 sparse, 2 dense (step 2)


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "gemma3", "qwen3_moe"])
def test_kv_estimate_is_the_cache_actually_held(tiny_snapshot, family):
    """The KV estimate per token and layer equals what the stage's cache holds (MLA: one
    compressed latent plus the rotary key per token, shared by every head)."""
    snapshot = tiny_snapshot(family)
    costs = ModelCosts.from_index(CheckpointIndex.load(snapshot))
    stage = Stage(load_shard(snapshot, LayerRange(0, 3), Precision.FLOAT32))
    stage.open_session("kv")
    tokens = 40  # inside every tiny sliding window (48)
    stage.step("kv", 0, token_ids=torch.arange(3, 3 + tokens).reshape(1, -1))
    cache = stage.sessions.peek("kv").cache
    held = sum(
        layer.keys.numel() + layer.values.numel() for layer in cache.layers if layer.is_initialized
    )
    assert held == costs.kv_elements * tokens * 3
    assert costs.kv_bytes(3, tokens, Precision.FLOAT32) == held * 4


def test_nf4_on_an_moe_is_refused_not_pretended(tiny_snapshot):
    """bitsandbytes' nf4 replaces nn.Linear only: an MoE's experts would stay at 16 bits.
    (int8 and int4 pack experts too: ``test_lowbit.py``.)"""
    precision = Precision.NF4
    index = CheckpointIndex.load(tiny_snapshot("mixtral"))
    with pytest.raises(ModelError, match="not supported for Mixture-of-Experts"):
        preflight(index, LayerRange(0, 3), precision, declared_gb=1.0)
    costs = ModelCosts.from_index(index)
    view = ModelView("meshnet-tiny/mixtral", costs, (0,) * index.num_layers)
    with pytest.raises(InsufficientMemory, match="Mixture-of-Experts"):
        place([view], NodeRequest(memory_bytes=2**30, precision=precision))
    for allowed in (Precision.BFLOAT16, Precision.INT8, Precision.INT4):
        ok = place([view], NodeRequest(memory_bytes=2**30, precision=allowed))
        assert ok.layers == LayerRange(0, index.num_layers)

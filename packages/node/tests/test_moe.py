"""Mixture-of-Experts shards: only the range's experts are read, per-layer costs, the KV
layout of latent attention, and quantization refused rather than pretended."""

from __future__ import annotations

import os
import subprocess
import sys

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
from meshnet_node.kernels.row_stable import TokensAlone
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


MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_moe_block_computes_a_token_at_a_time_outside_prompts(tiny_snapshot, family):
    """Routers and experts are torch's own calls on the tokens a block holds: every MoE
    block of a stage runs them token by token in passes of one-token rows (ADR-0038)."""
    stage = Stage(load_shard(tiny_snapshot(family), LayerRange(0, 6), Precision.BFLOAT16))
    blocks = [m for m in stage.shard.modules.modules() if isinstance(m.forward, TokensAlone)]
    moe = [m for m in stage.shard.modules.modules()
           if any(type(c).__name__.endswith("Experts") for c in m.children())]  # fmt: skip
    assert blocks and blocks == moe


BLOCK_ALONE = r"""
import torch
import transformers
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from meshnet_node.kernels.row_stable import TokensAlone, prompt_rows, route_alone

transformers.logging.set_verbosity_error()
config = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=8,
                        num_experts_per_tok=2, norm_topk_prob=True)
torch.manual_seed(0)
block = Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
for p in block.parameters():
    torch.nn.init.normal_(p, std=0.02)
x = torch.randn(1, 16, 2048, dtype=torch.bfloat16)
with torch.inference_mode():
    alone = torch.cat([block(x[:, i : i + 1]) for i in range(16)], dim=1)
    plain = torch.equal(block(x), alone)
    assert route_alone(torch.nn.ModuleList([block])) == 1
    assert isinstance(block.forward, TokensAlone)
    together = block(x)
    with prompt_rows(128):
        prompt = block(x)
assert torch.equal(together, alone) and prompt.shape == alone.shape
print("ok", "batched-equal-before" if plain else "batched-differed-before")
"""


@pytest.mark.parametrize("isa", [None, "AVX512_CORE_BF16"], ids=["default", "zen4-kernels"])
def test_a_real_sized_moe_block_gives_each_token_its_own_bits_in_any_batch(isa):
    """A Qwen3-MoE block at a real width (2048): a batch of 16 tokens, cut into the
    block's one-token calls, gives every token the bits it gets alone; a prompt chunk stays
    one call. Also with oneDNN held to the kernels of a CPU with AVX-512 bf16 and no AMX
    (AMD Zen 4), where the block's own batched products give a token other bits."""
    env = dict(os.environ)
    if isa is not None:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", BLOCK_ALONE], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]

"""Checkpoints shipped quantized: FP8 e4m3 with block scales (DeepSeek-V3, Kimi K2) and
MXFP4 experts (gpt-oss). Packed tensors and scales are written by
``meshnet_common.models.native_formats``; a node loading a range dequantizes only that
range and must agree with a plain checkpoint of the dequantized weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from baselines import hf_chunked_greedy, load_reference_model, split_greedy

from meshnet_common.errors import InvalidRequest, ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.memory import ModelCosts
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.native_formats import (
    convert_snapshot,
    dequantized_copy,
    fp8_dequantize,
    fp8_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
)
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage

CASES = [("deepseek_v3", "fp8"), ("gpt_oss", "mxfp4")]


@pytest.fixture(scope="module")
def native(tiny_snapshot, tmp_path_factory):
    """family -> (native snapshot, dequantized float32 reference snapshot)."""
    out = {}
    for family, fmt in CASES:
        root = tmp_path_factory.mktemp(f"{family}-{fmt}")
        snapshot = root / "native"
        shutil.copytree(tiny_snapshot(family), snapshot)
        # FP8 tiles of 32: tiny weights span several tiles, with ragged edges (48 rows)
        assert convert_snapshot(snapshot, fmt, fp8_block=32) > 0
        out[family] = (snapshot, dequantized_copy(snapshot, root / "reference"))
    return out


def test_fp8_tiles_and_ragged_edges_round_trip():
    weight = torch.randn(100, 70) * 3
    q, scale = fp8_quantize(weight, 32)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 3)
    back = fp8_dequantize(q, scale, (32, 32))
    assert float((back - weight).abs().max()) <= 0.07 * float(weight.abs().max())
    with pytest.raises(InvalidRequest, match="does not cover"):
        fp8_dequantize(q, scale[:2], (32, 32))


def test_mxfp4_packing_agrees_with_transformers():
    """Our packer's blocks and scales, dequantized by transformers' own gpt-oss code, give
    exactly what our dequantizer gives: the layout (transpose, nibble order, E8M0) is right."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(4, 64, 96)  # (experts, in, out) as the module holds it
    blocks, scales = mxfp4_quantize(weight)
    assert blocks.shape == (4, 96, 2, 16) and scales.shape == (4, 96, 2)
    ours = mxfp4_dequantize(blocks, scales)
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), ours)
    assert float((ours - weight).abs().max()) <= 0.35 * float(weight.abs().max())


@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_checkpoint_holds_packed_tensors_and_scales(native, family, fmt):
    snapshot, _ = native[family]
    index = CheckpointIndex.load(snapshot)
    dtypes = {t.dtype for t in index.tensors.values()}
    if fmt == "fp8":
        assert "F8_E4M3" in dtypes
        assert "model.layers.2.mlp.experts.1.gate_proj.weight_scale_inv" in index.tensors
        assert "model.layers.2.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in index.tensors
    else:
        assert "model.layers.2.mlp.experts.gate_up_proj_blocks" in index.tensors
        assert index.tensors["model.layers.2.mlp.experts.down_proj_scales"].dtype == "U8"
    names = index.tensors_for(LayerRange(2, 4))  # a range carries its scales, nothing else
    assert any(n.endswith(("weight_scale_inv", "_scales")) for n in names)
    assert {index.layer_of(n) for n in names} == {2, 3}


@pytest.mark.parametrize("kept", [True, False], ids=["kept-packed", "dequantized"])
@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_split_native_checkpoint_matches_its_dequantized_reference(native, family, fmt, kept):
    """Kept in its shipped bytes (``--quantization auto``) or dequantized at load
    (``--quantization float32``), split over 3 stages in float32: the dequantized model's
    greedy tokens and logits."""
    snapshot, reference = native[family]
    model = load_reference_model(reference, torch.float32)
    prompt = torch.randint(3, 200, (160,), generator=torch.Generator().manual_seed(5)).tolist()
    ref_tokens, ref_logits = hf_chunked_greedy(model, prompt, 12)
    precision = Precision(fmt) if kept else Precision.FLOAT32
    stages = [
        Stage(load_shard(snapshot, LayerRange(a, b), precision, dtype=torch.float32))
        for a, b in ((0, 2), (2, 4), (4, 6))
    ]
    tokens, logits = split_greedy(stages, prompt, 12)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(ref_logits, logits, strict=True)) < 1e-4
    # resident bytes: what the packed checkpoint prices the range at, at this precision
    costs = ModelCosts.from_index(CheckpointIndex.load(snapshot))
    for stage in stages:
        expected = costs.weight_bytes(stage.shard.layers, precision, dtype="float32")
        assert stage.shard.parameter_bytes() == pytest.approx(expected, rel=0.01)
    if kept:  # the shipped bytes, not a dequantized copy
        held = {b.dtype for s in stages for b in s.shard.modules.buffers()}
        assert torch.uint8 in held


def test_unknown_quantization_is_refused_in_one_line(native, tmp_path):
    snapshot = tmp_path / "awq"
    shutil.copytree(native["deepseek_v3"][0], snapshot)
    config = json.loads((snapshot / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "bits": 4}
    (snapshot / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="quantized as .hqq..*fp8.*mxfp4"):
        load_shard(snapshot, LayerRange(0, 2))

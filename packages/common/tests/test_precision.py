"""Precisions: how --quantization/--dtype resolve against a checkpoint's shipped format,
which tensors each precision quantizes, and what a layer range then costs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshnet_common.errors import InvalidRequest
from meshnet_common.layers import LayerRange
from meshnet_common.memory import OVERHEAD_MIN_BYTES, ModelCosts
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.precision import (
    GROUP_SIZES,
    QUANTIZATION_CHOICES,
    Precision,
    compute_dtype_name,
    describe_precision,
    int4_group,
    quantized_tensor,
    resolve_precision,
)

P = Precision

# -- resolving --quantization and --dtype ---------------------------------------------------

RESOLVED = [
    # quantization, dtype, native -> precision
    ("auto", "bfloat16", None, P.BFLOAT16),
    ("auto", "float32", None, P.FLOAT32),
    ("auto", "bfloat16", "fp8", P.FP8),
    ("auto", "float32", "fp8", P.FP8),  # packed weights, float32 compute
    ("auto", "bfloat16", "mxfp4", P.MXFP4),
    ("bfloat16", "bfloat16", None, P.BFLOAT16),
    ("bfloat16", "float32", None, P.FLOAT32),
    ("bfloat16", "bfloat16", "fp8", P.BFLOAT16),  # a shipped checkpoint dequantized
    ("bfloat16", "bfloat16", "mxfp4", P.BFLOAT16),
    ("float32", "bfloat16", None, P.FLOAT32),  # the alias: weights and compute float32
    ("float32", "float32", "fp8", P.FLOAT32),
    ("int8", "bfloat16", None, P.INT8),
    ("int8", "float32", "fp8", P.INT8),
    ("int4", "bfloat16", "mxfp4", P.INT4),
    ("nf4", "bfloat16", None, P.NF4),
    ("fp8", "bfloat16", "fp8", P.FP8),
    ("mxfp4", "float32", "mxfp4", P.MXFP4),
]


@pytest.mark.parametrize(("quantization", "dtype", "native", "expected"), RESOLVED)
def test_resolve_precision(quantization, dtype, native, expected):
    assert resolve_precision(quantization, dtype, native) is expected


@pytest.mark.parametrize(
    ("quantization", "native"), [("fp8", None), ("fp8", "mxfp4"), ("mxfp4", None), ("mxfp4", "fp8")]
)
def test_a_shipped_format_is_asked_only_of_a_checkpoint_that_ships_it(quantization, native):
    with pytest.raises(InvalidRequest) as info:
        resolve_precision(quantization, "bfloat16", native)
    message = info.value.message
    assert "\n" not in message and f"--quantization {quantization}" in message
    assert (f"ships {native}" if native else "ships plain weights") in message


@pytest.mark.parametrize(
    ("quantization", "dtype"), [("int3", "bfloat16"), ("auto", "float16"), ("AUTO", "bfloat16")]
)
def test_unknown_values_are_refused(quantization, dtype):
    with pytest.raises(InvalidRequest):
        resolve_precision(quantization, dtype, None)


def test_every_choice_but_auto_is_a_precision():
    assert {*QUANTIZATION_CHOICES} - {"auto"} == {p.value for p in Precision}
    quantized = {p for p in Precision if p.is_quantized}
    assert quantized == {P.INT8, P.INT4, P.NF4, P.FP8, P.MXFP4}
    assert {p for p in Precision if p.is_native} == {P.FP8, P.MXFP4}


def test_compute_dtype_names_and_labels():
    assert compute_dtype_name(P.FLOAT32, "bfloat16") == "float32"
    assert compute_dtype_name(P.INT4, "float32") == "float32"
    assert compute_dtype_name(P.INT4) == "bfloat16"
    # auto (--dtype's default): float32 for a GGUF, as llama.cpp computes it (ADR-0046)
    assert compute_dtype_name(P.INT4, "auto") == "bfloat16"
    assert compute_dtype_name(P.INT4, "auto", gguf=True) == "float32"
    assert compute_dtype_name(P.INT8, None, gguf=True) == "float32"
    assert compute_dtype_name(P.INT4, "bfloat16", gguf=True) == "bfloat16"  # as asked
    assert describe_precision(P.INT4, "bfloat16", 64) == "int4 g64"
    assert describe_precision(P.INT8, "bfloat16", 64) == "int8"  # a group only for int4
    assert describe_precision(P.FP8, "float32") == "fp8 · float32"
    assert describe_precision(P.FLOAT32, "float32") == "float32"
    assert describe_precision(P.BFLOAT16) == "bfloat16"


# -- which tensors are quantized ----------------------------------------------------------

H, I = 4096, 11008  # noqa: E741 - hidden and intermediate widths


@pytest.mark.parametrize(
    ("name", "shape", "int8"),
    [
        ("model.layers.3.self_attn.q_proj.weight", (H, H), True),
        ("model.layers.3.mlp.experts.7.gate_proj.weight", (I, H), True),  # per-expert
        ("model.layers.3.block_sparse_moe.experts.7.w1.weight", (I, H), True),
        ("model.layers.3.mlp.experts.gate_up_proj", (8, H, 2 * I), True),  # fused, gpt-oss
        ("model.layers.3.mlp.experts.down_proj", (8, I, H), True),
        ("model.layers.3.mlp.gate.weight", (8, H), False),  # routers
        ("model.layers.3.block_sparse_moe.gate.weight", (8, H), False),
        ("model.layers.3.mlp.router.weight", (8, H), False),
        ("model.layers.3.mlp.shared_expert_gate.weight", (1, H), False),
        ("model.layers.3.input_layernorm.weight", (H,), False),  # norm
        ("model.layers.3.self_attn.q_proj.bias", (H,), False),  # bias
        ("model.layers.3.mlp.experts.gate_up_proj_bias", (8, 2 * I), False),
        ("model.embed_tokens.weight", (32000, H), False),  # outside the layers
        ("lm_head.weight", (32000, H), False),
        ("transformer.h.0.attn.c_attn.weight", (H, 3 * H), True),  # GPT-2 Conv1D
    ],
)
def test_int8_quantizes_the_linears_and_experts_of_the_layers(name, shape, int8):
    gpt2 = name.startswith("transformer.")
    assert quantized_tensor(name, shape, P.INT8, gpt2=gpt2) is int8
    assert quantized_tensor(name, shape, P.INT4, gpt2=gpt2, group_size=64) is int8
    for plain in (P.BFLOAT16, P.FLOAT32):
        assert not quantized_tensor(name, shape, plain, gpt2=gpt2)


def test_int4_needs_whole_tiles_of_outputs_and_whole_groups_of_inputs():
    name = "model.layers.0.mlp.down_proj.weight"
    assert quantized_tensor(name, (64, 96), P.INT4, gpt2=False, group_size=32)
    # in 96: no group of 64 fits, 32 does (a narrower group where the asked one does not)
    assert int4_group(96, 64) == 32 and int4_group(576, 128) == 64 and int4_group(48, 32) is None
    assert quantized_tensor(name, (64, 96), P.INT4, gpt2=False, group_size=64)
    assert not quantized_tensor(name, (64, 48), P.INT4, gpt2=False, group_size=64)  # in 48
    assert not quantized_tensor(name, (40, 128), P.INT4, gpt2=False, group_size=64)  # out 40
    assert quantized_tensor(name, (40, 128), P.INT8, gpt2=False)  # int8 takes any width
    # GPT-2 Conv1D is [in, out]: out 40 is not a multiple of 16
    assert not quantized_tensor("transformer.h.0.mlp.c_fc.weight", (128, 40), P.INT4,
                                gpt2=True, group_size=64)  # fmt: skip
    assert quantized_tensor("transformer.h.0.mlp.c_fc.weight", (128, 48), P.INT4,
                            gpt2=True, group_size=64)  # fmt: skip
    # fused experts are [E, in, out]
    fused = "model.layers.0.mlp.experts.down_proj"
    assert quantized_tensor(fused, (4, 128, 48), P.INT4, gpt2=False, group_size=128)
    assert not quantized_tensor(fused, (4, 48, 128), P.INT4, gpt2=False, group_size=64)  # in 48


def test_fp8_and_mxfp4_are_what_the_checkpoint_stores_packed():
    names = {"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv",
             "model.layers.0.mlp.gate.weight"}  # fmt: skip
    up = "model.layers.0.mlp.up_proj.weight"
    assert quantized_tensor(up, (I, H), P.FP8, gpt2=False, names=names)
    assert not quantized_tensor("model.layers.0.mlp.gate.weight", (8, H), P.FP8, gpt2=False,
                                names=names)  # fmt: skip
    assert not quantized_tensor(up + "_scale_inv", (86, 32), P.FP8, gpt2=False, names=names)
    blocks = "model.layers.0.mlp.experts.down_proj_blocks"
    assert quantized_tensor(blocks, (4, H, I // 32, 16), P.MXFP4, gpt2=False)
    assert not quantized_tensor(blocks[: -len("_blocks")] + "_scales", (4, H, I // 32),
                                P.MXFP4, gpt2=False)  # fmt: skip
    assert not quantized_tensor(up, (I, H), P.MXFP4, gpt2=False)


def test_nf4_keeps_todays_rule():
    assert quantized_tensor("model.layers.0.mlp.up_proj.weight", (I, H), P.NF4, gpt2=False)
    assert not quantized_tensor("model.embed_tokens.weight", (32000, H), P.NF4, gpt2=False)
    assert not quantized_tensor("model.layers.0.input_layernorm.weight", (H,), P.NF4, gpt2=False)


# -- what a range costs -------------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory) -> dict[str, Path]:
    from meshnet_common.tiny.snapshots import make_tiny

    root = tmp_path_factory.mktemp("precision-models")
    made = {}
    for family, fmt in [("llama", "bf16"), ("mixtral", "bf16"), ("gpt_oss", "bf16"),
                        ("gpt_oss", "mxfp4"), ("deepseek_v3", "fp8"), ("gpt2", "bf16")]:  # fmt: skip
        key = family if fmt == "bf16" else f"{family}-{fmt}"
        made[key] = make_tiny(root, family, f"t/{key}", weight_format=fmt)
    return made


def _costs(snapshots, key: str) -> ModelCosts:
    return ModelCosts.from_index(CheckpointIndex.load(snapshots[key]))


MIDDLE = LayerRange(1, 3)


@pytest.mark.parametrize("key", ["llama", "mixtral", "gpt_oss", "gpt2"])
def test_int4_is_smaller_than_int8_smaller_than_bfloat16(snapshots, key):
    costs = _costs(snapshots, key)
    bf16, f32 = costs.weight_bytes(MIDDLE, P.BFLOAT16), costs.weight_bytes(MIDDLE, P.FLOAT32)
    int8, int4 = costs.weight_bytes(MIDDLE, P.INT8), costs.weight_bytes(MIDDLE, P.INT4)
    assert f32 == 2 * bf16
    assert int4 < int8 < bf16
    # the Linear/expert weights are most of a layer: int8 ~1/2, int4 ~1/4 (plus scales,
    # norms, biases and routers at bfloat16; tiny widths make scales weigh more)
    assert 0.5 < int8 / bf16 < 0.56
    assert 0.25 < int4 / bf16 < 0.33
    # exact for the quantized part: values + scales, the rest at 2 bytes
    quantized = costs.layer_int8[1] + costs.layer_int8[2]
    rows = costs.layer_int8_rows[1] + costs.layer_int8_rows[2]
    assert int8 == bf16 - 2 * quantized + quantized + 2 * rows
    g64 = costs.layer_int4[GROUP_SIZES.index(64)]
    q4 = g64[1] + g64[2]
    assert int4 == int(bf16 - 2 * q4 + q4 / 2 + 2 * 2 * q4 / 64)


def test_int4_groups_that_do_not_divide_a_width_fall_back_to_one_that_does(snapshots):
    costs = _costs(snapshots, "llama")  # hidden 64: no group of 128 fits an input of 64
    g32, g64, g128 = (costs.weight_bytes(MIDDLE, P.INT4, group_size=g) for g in GROUP_SIZES)
    assert g64 < g32  # more groups, more scales
    # inputs of 64 pack in groups of 64 when 128 is asked; wider inputs in groups of 128
    assert g128 <= g64 < costs.weight_bytes(MIDDLE, P.INT8)
    with pytest.raises(InvalidRequest):
        costs.weight_bytes(MIDDLE, P.INT4, group_size=48)


def test_a_float32_compute_dtype_widens_what_is_not_quantized_and_the_kv_cache(snapshots):
    costs = _costs(snapshots, "llama")
    int8 = costs.weight_bytes(MIDDLE, P.INT8)
    int8_f32 = costs.weight_bytes(MIDDLE, P.INT8, dtype="float32")
    unquantized = costs.layer_quantizable[1] + costs.layer_other[1] - costs.layer_int8[1]
    unquantized += costs.layer_quantizable[2] + costs.layer_other[2] - costs.layer_int8[2]
    rows = costs.layer_int8_rows[1] + costs.layer_int8_rows[2]
    assert int8_f32 - int8 == 2 * (unquantized + rows)
    assert costs.kv_bytes(2, 100, P.INT8, dtype="float32") == 2 * costs.kv_bytes(2, 100, P.INT8)
    assert costs.kv_bytes(2, 100, P.FLOAT32) == costs.kv_bytes(2, 100, P.BFLOAT16, dtype="float32")


def test_auto_prices_a_gguf_in_float32_and_anything_else_in_bfloat16(snapshots):
    """--dtype auto (the default): a GGUF computes in float32 (ADR-0046), so the tracker
    and the node price its unquantized tensors and KV cache at 4 bytes."""
    costs = _costs(snapshots, "llama")
    assert not costs.gguf
    gguf = dataclasses.replace(costs, gguf=True)
    for precision in (P.INT4, P.INT8):
        auto = gguf.weight_bytes(MIDDLE, precision, dtype="auto")
        assert auto == costs.weight_bytes(MIDDLE, precision, dtype="float32")
        assert costs.weight_bytes(MIDDLE, precision, dtype="auto") == costs.weight_bytes(
            MIDDLE, precision, dtype="bfloat16"
        )
        assert gguf.weight_bytes(MIDDLE, precision, dtype="bfloat16") < auto  # as asked
    assert gguf.kv_bytes(2, 100, P.INT4, dtype="auto") == 2 * costs.kv_bytes(2, 100, P.INT4)


@pytest.mark.parametrize("key", ["mixtral", "gpt_oss", "gpt_oss-mxfp4", "deepseek_v3-fp8"])
def test_moe_models_take_int8_and_int4_but_not_nf4(snapshots, key):
    costs = _costs(snapshots, key)
    assert costs.moe
    for precision in (P.INT8, P.INT4):
        assert costs.refusal(precision) is None
        assert costs.max_layers_from(0, 6, 2**30, precision, 0) == 6
    assert "Mixture-of-Experts" in costs.refusal(P.NF4)
    assert costs.max_layers_from(0, 6, 2**30, P.NF4, 0) == 0


def test_shipped_formats_are_refused_on_checkpoints_that_do_not_ship_them(snapshots):
    plain = _costs(snapshots, "llama")
    assert plain.native is None
    assert "ships plain weights" in plain.refusal(P.FP8)
    assert plain.max_layers_from(0, 6, 2**30, P.FP8, 0) == 0
    assert plain.refusal(P.MXFP4) is not None
    mxfp4 = _costs(snapshots, "gpt_oss-mxfp4")
    assert mxfp4.native == "mxfp4" and mxfp4.refusal(P.MXFP4) is None
    assert "ships mxfp4" in mxfp4.refusal(P.FP8)
    fp8 = _costs(snapshots, "deepseek_v3-fp8")
    assert fp8.native == "fp8" and fp8.refusal(P.FP8) is None and fp8.refusal(P.MXFP4)


def test_shipped_formats_are_priced_packed(snapshots):
    """MXFP4: half a byte a value plus a one-byte scale per 32; FP8: a byte plus a float32
    scale per block. Dequantized (bfloat16), both are priced as the plain checkpoint."""
    packed = _costs(snapshots, "gpt_oss-mxfp4")
    plain = _costs(snapshots, "gpt_oss")
    assert packed.weight_bytes(MIDDLE, P.BFLOAT16) == plain.weight_bytes(MIDDLE, P.BFLOAT16)
    assert packed.weight_bytes(MIDDLE, P.INT4) == plain.weight_bytes(MIDDLE, P.INT4)
    experts = packed.layer_packed[1] + packed.layer_packed[2]
    assert experts > 0
    assert packed.layer_packed_bytes[1] + packed.layer_packed_bytes[2] == experts * (0.5 + 1 / 32)
    mxfp4 = packed.weight_bytes(MIDDLE, P.MXFP4)
    assert mxfp4 == packed.weight_bytes(MIDDLE, P.BFLOAT16) - 2 * experts + experts * (17 / 32)
    fp8 = _costs(snapshots, "deepseek_v3-fp8")
    weights = fp8.layer_packed[1] + fp8.layer_packed[2]
    assert weights > 0
    assert weights < fp8.layer_packed_bytes[1] + fp8.layer_packed_bytes[2] < 1.1 * weights
    assert fp8.weight_bytes(MIDDLE, P.FP8) < 0.6 * fp8.weight_bytes(MIDDLE, P.BFLOAT16)


def test_hand_built_costs_keep_working():
    costs = ModelCosts(4, (1000,) * 4, (10,) * 4, 100, 100, 0, 8)
    whole = LayerRange(0, 4)
    assert costs.weight_bytes(whole, P.BFLOAT16) == 2 * (4 * 1010 + 200)
    assert costs.weight_bytes(whole, P.INT8) == 4 * 1000 + 2 * (4 * 10 + 200)
    assert costs.weight_bytes(whole, P.INT4) == int(4 * 1000 * (0.5 + 4 / 64)) + 2 * 240
    assert costs.shard_bytes(whole, P.BFLOAT16, 0) == 2 * 4240 + OVERHEAD_MIN_BYTES

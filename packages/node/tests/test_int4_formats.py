"""int4 safetensors checkpoints — GPTQ (v1 and v2 zeros, symmetric and not), AWQ (GEMM) and
compressed-tensors pack-quantized w4a16 (symmetric and not) — written by our own rounding
and packing code (``meshnet_common.tiny.int4_files``) from tiny random models: served at int4 as shipped, split
over stages = one stage (bit for bit, float32), and equal to the HF model built from the
weights the codes stand for; served at float32 / int8 by dequantizing; bad variants
refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from baselines import split_greedy
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from meshnet_common.errors import InvalidRequest, ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.memory import ModelCosts
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.precision import Precision, native_format_name, resolve_precision
from meshnet_common.tiny.int4_files import write_int4
from meshnet_common.tiny.snapshots import make_tiny
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.lowbit.packed import Int4Weight

PROMPT = list(range(3, 40))
NEW_TOKENS = 6
# (method, symmetric, v1, group)
VARIANTS = [
    ("gptq", True, True, 64),
    ("gptq", False, True, 32),
    ("gptq", False, False, 128),
    ("awq", False, True, 64),
    ("compressed-tensors", True, True, 128),
    ("compressed-tensors", False, True, 32),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    made: dict[tuple, tuple[Path, Path]] = {}

    def make(family: str, method: str, symmetric: bool, v1: bool, group: int):
        key = (family, method, symmetric, v1, group)
        if key not in made:
            snapshot = make_tiny(root, family, f"tiny/{family}", layers=4, hidden=256, intermediate=512)  # fmt: skip
            dest = root / "-".join(map(str, key))
            reference = write_int4(snapshot, dest, method, group=group, symmetric=symmetric, v1=v1)
            made[key] = dest, _reference_snapshot(snapshot, reference, dest.with_suffix(".ref"))
        return made[key]

    return make


def _reference_snapshot(snapshot: Path, weights: dict, folder: Path) -> Path:
    """The plain snapshot with each quantized weight replaced by what its codes stand for."""
    index = CheckpointIndex.load(snapshot)
    state = {}
    for fname in sorted({i.file for i in index.tensors.values()}):
        with safe_open(str(index.root / fname), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118
                state[name] = weights.get(name, fh.get_tensor(name).float()).contiguous()
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(index.config))
    save_file(state, folder / "model.safetensors")
    return folder


def _greedy(path: Path, precision: Precision, cuts):
    stages = [
        Stage(load_shard(path, LayerRange(a, b), precision, dtype=torch.float32)) for a, b in cuts
    ]
    tokens, logits = split_greedy(stages, PROMPT, NEW_TOKENS)
    return tokens, torch.stack([row.reshape(-1) for row in logits]), stages


def _want(reference: Path, tokens: list[int]):
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
        logits = model(torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1 :]
    return want, logits


@pytest.mark.parametrize(("method", "symmetric", "v1", "group"), VARIANTS)
def test_int4_checkpoint_split_equals_one_stage_and_its_weights(checkpoint, method, symmetric, v1, group):  # fmt: skip
    path, reference = checkpoint("llama", method, symmetric, v1, group)
    native = native_format_name(CheckpointIndex.load(path).config)
    assert native == "int4"
    precision = resolve_precision("auto", "float32", native)
    assert precision is Precision.INT4
    tokens, logits, stages = _greedy(path, precision, [(0, 1), (1, 3), (3, 4)])
    one_tokens, one_logits, _ = _greedy(path, precision, [(0, 4)])
    assert tokens == one_tokens and torch.equal(logits, one_logits)
    # held as shipped: int4 in the checkpoint's own group, whatever --quant-group-size says
    q_proj = stages[1].shard.modules.layers[0].self_attn.q_proj
    assert isinstance(q_proj.packed, Int4Weight) and q_proj.packed.group == group
    want, ref = _want(reference, tokens)
    assert tokens == want
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("method", "symmetric"), [("gptq", False), ("compressed-tensors", True)])
def test_moe_experts_load_as_shipped(checkpoint, method, symmetric):
    path, reference = checkpoint("qwen3_moe", method, symmetric, True, 64)
    tokens, logits, _ = _greedy(path, Precision.INT4, [(0, 2), (2, 4)])
    one_tokens, one_logits, _ = _greedy(path, Precision.INT4, [(0, 4)])
    assert tokens == one_tokens and torch.equal(logits, one_logits)
    want, ref = _want(reference, tokens)
    assert tokens == want
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)


def test_other_precisions_dequantize_the_codes(checkpoint):
    path, reference = checkpoint("llama", "gptq", False, True, 32)
    tokens, logits, _ = _greedy(path, Precision.FLOAT32, [(0, 2), (2, 4)])
    want, ref = _want(reference, tokens)
    assert tokens == want
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
    tokens8, _, stages = _greedy(path, Precision.INT8, [(0, 4)])
    assert len(tokens8) == NEW_TOKENS
    assert type(stages[0].shard.modules.layers[0].mlp.down_proj.packed).__name__ == "Int8Weight"


def test_memory_is_priced_from_the_codes(checkpoint):
    path, _ = checkpoint("llama", "awq", False, True, 64)
    costs = ModelCosts.from_index(CheckpointIndex.load(path))
    shard = load_shard(path, LayerRange(1, 3), Precision.INT4, dtype=torch.float32, group_size=64)
    expected = costs.weight_bytes(LayerRange(1, 3), Precision.INT4, dtype="float32")
    assert shard.parameter_bytes() == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True}, "act-order"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 64}, "only 4-bit"),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size -1"),
        ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"}, "GEMM"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8}}},
            },
            "pack-quantized",
        ),  # fmt: skip
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {
                        "weights": {
                            "num_bits": 4,
                            "type": "int",
                            "strategy": "group",
                            "group_size": 64,
                        },
                        "input_activations": {"num_bits": 8},
                    }
                },
            },
            "w4a16",
        ),  # fmt: skip
    ],
)
def test_unserved_variants_are_refused_in_one_line(checkpoint, tmp_path, spec, words):
    path, _ = checkpoint("llama", "gptq", False, True, 32)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = spec
    with pytest.raises(InvalidRequest, match=words):
        native_format_name(config)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ModelError, match=words) as err:
        load_shard(bad, LayerRange(0, 2))
    assert "\n" not in str(err.value)

"""Decode programs (ADR-0041): a one-token step through a layer's program gives the module
path's numbers bit for bit, at SmolLM2's real shapes and in every family and precision
that has one; the other families keep the module path."""

from __future__ import annotations

import pytest
import torch
from program_runs import batched_run, engines, same_run

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.programs import DecodeProgram, StageLayers, decode_programs

PROGRAM_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"]
PRECISIONS = [Precision.BFLOAT16, Precision.FLOAT32, Precision.INT8, Precision.INT4]


@pytest.mark.parametrize("family", PROGRAM_FAMILIES)
@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.value)
def test_programs_give_the_module_path_bit_for_bit(tiny_snapshot, family, precision):
    # a 150-token prompt (chunked, past the tiny sliding window of 48), then decode steps
    prompt = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    reference, programs = engines(tiny_snapshot(family), ((0, 3), (3, 6)), precision)
    same_run(reference, programs, prompt, 10)


@pytest.mark.parametrize("precision", [Precision.BFLOAT16, Precision.FLOAT32])
def test_programs_at_smollm2_shapes(smollm2_snapshot, precision):
    """The real shapes, split where the determinism test splits them, torch's threads."""
    prompt = [1, 504, 3575, 282, 4649, 314, 260, 1345, 282, 4649, 314]
    bounds = ((0, 10), (10, 20), (20, 30))
    reference, programs = engines(smollm2_snapshot, bounds, precision)
    same_run(reference, programs, prompt, 24)


@pytest.mark.parametrize(
    ("family", "precision"),
    [
        ("llama", Precision.BFLOAT16),
        ("mistral", Precision.BFLOAT16),
        ("qwen3", Precision.INT4),
        ("qwen2", Precision.INT8),
    ],  # fmt: skip
)
def test_batched_steps_through_programs_give_the_module_path_bit_for_bit(
    tiny_snapshot, family, precision
):
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 60, 17)]
    reference, programs = engines(tiny_snapshot(family), ((0, 3), (3, 6)), precision)
    calls = []
    original = DecodeProgram.rows

    def counted(self, hidden, contexts):
        calls.append(len(contexts))
        return original(self, hidden, contexts)

    want = batched_run(reference, prompts, 6)
    assert not calls
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeProgram, "rows", counted)
        got = batched_run(programs, prompts, 6)
    assert calls == [3] * (6 * 6)  # every layer of every batched step, all three rows
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_batched_steps_at_smollm2_shapes(smollm2_snapshot):
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 2683, 314, 3575, 28], [1, 77, 88]]
    reference, programs = engines(smollm2_snapshot, ((0, 15), (15, 30)), Precision.BFLOAT16)
    got, want = batched_run(programs, prompts, 12), batched_run(reference, prompts, 12)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_families_without_a_program_take_the_module_path(tiny_snapshot):
    for family in ("gpt2", "mixtral", "qwen3_moe", "deepseek_v3"):
        stage = Stage(load_shard(tiny_snapshot(family), LayerRange(0, 2), Precision.FLOAT32))
        assert stage.layers.engine == "modules", family
        assert decode_programs(stage.shard.modules.layers) is None


def test_a_hooked_layer_keeps_the_module_path(tiny_snapshot):
    shard = load_shard(tiny_snapshot("llama"), LayerRange(0, 2), Precision.FLOAT32)
    shard.modules.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert Stage(shard).layers.engine == "modules"


def test_an_unknown_engine_is_refused(tiny_snapshot):
    shard = load_shard(tiny_snapshot("llama"), LayerRange(0, 2), Precision.FLOAT32)
    with pytest.raises(ValueError, match="engine must be one of native, program, modules"):
        StageLayers(shard.modules.layers, shard.layer_types, shard.adapter.call_layer,
                    shard.adapter.call_layer_batched, "fast")  # fmt: skip

"""--widen-bf16: many-row bf16 products in float32, few-row ones left to torch; off by default."""

from __future__ import annotations

import threading

import pytest
import torch
from baselines import hf_chunked_greedy, load_reference_model, split_greedy
from torch import nn

from meshnet_common.config.shard import ShardSettings
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.tiny import snapshots as tiny
from meshnet_node.engine import bf16_upcast
from meshnet_node.engine.bf16_upcast import upcast_min_rows, widen_linears, widened_linear
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.kernels import row_stable
from meshnet_node.kernels.row_stable import RowGroups

BF16_ULP = 2.0**-7  # relative spacing of bfloat16 values


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


@pytest.mark.parametrize("shape", [(16, 576), (2, 9, 576)], ids=["rows", "batch-seq"])
@pytest.mark.parametrize("bias", [False, True])
def test_widened_products_are_rounded_exact_products(shape, bias):
    """float32 sums of the bf16 inputs, rounded once: within one bf16 step of the exact
    product everywhere, and equal to torch's bf16 product nearly everywhere."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).bfloat16()
    w = torch.randn(5000, shape[-1], generator=gen).bfloat16()  # several scratch blocks
    b = torch.randn(5000, generator=gen).bfloat16() if bias else None
    assert bf16_upcast.SCRATCH_BYTES // 4 // shape[-1] < 5000  # the test spans blocks
    got = widened_linear(x, w, b)
    assert got.shape == (*shape[:-1], 5000) and got.dtype is torch.bfloat16
    exact = _exact(x, w, b)
    rel = (got.double() - exact).abs() / exact.abs().clamp(min=1e-2)
    assert float(rel.max()) <= BF16_ULP
    same = (got == nn.functional.linear(x, w, b)).double().mean()
    assert float(same) >= 0.999


def test_a_call_of_few_rows_stays_torchs_own_product():
    layer = nn.Linear(64, 48).bfloat16()
    gen = torch.Generator().manual_seed(1)
    few = torch.randn(1, 64, generator=gen).bfloat16()
    many = torch.randn(upcast_min_rows() + 5, 64, generator=gen).bfloat16()
    before_few, before_many = layer(few), layer(many)
    assert widen_linears(layer) == 1
    assert torch.equal(layer(few), before_few)  # bit for bit: torch's bf16 path
    assert torch.equal(layer(many), widened_linear(many, layer.weight, layer.bias))
    assert torch.allclose(layer(many).float(), before_many.float(), rtol=2 * BF16_ULP, atol=1e-2)


def test_float32_linears_are_left_alone():
    layer = nn.Linear(8, 8)
    assert widen_linears(layer) == 0 and "forward" not in vars(layer)


def test_by_default_a_shard_keeps_torchs_products(tiny_snapshot):
    """Never widened by default: every linear runs in row groups (ADR-0038) of torch's own
    product, or, where torch multiplies bf16 one row at a time, of the kernel that sums as
    it does (ADR-0030); ``bf16_kernel=False`` keeps torch's."""
    shard = load_shard(tiny_snapshot("llama"), LayerRange(0, 6))
    linears = [m for m in shard.modules.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(vars(m).get("forward"), RowGroups) for m in linears)
    assert {vars(m)["forward"].fn for m in linears} == {row_stable.product}
    plain = load_shard(tiny_snapshot("llama"), LayerRange(0, 6), bf16_kernel=False)
    routed = [vars(m)["forward"] for m in plain.modules.modules() if "forward" in vars(m)]
    assert routed and {r.fn for r in routed} == {nn.functional.linear}


def test_the_flag_reaches_the_settings():
    assert ShardSettings().widen_bf16 is False
    assert ShardSettings(widen_bf16=True).widen_bf16 is True
    assert ShardSettings().bf16_kernel is True
    assert ShardSettings(bf16_kernel=False).bf16_kernel is False


@pytest.mark.parametrize("family", [f for f in tiny.FAMILIES if f not in tiny.MOE_FAMILIES])
def test_a_widened_split_stays_within_bfloat16_tolerance(tiny_snapshot, family):
    """Three widened stages against the unsplit bf16 model: the prompt's logits within the
    bf16 tolerance of the exactness tests and the first tokens equal. Not every token: the
    rounding differs from torch's, and a random tiny model's near-ties can flip later."""
    snapshot = tiny_snapshot(family)
    model = load_reference_model(snapshot, torch.bfloat16)
    vocab = min(model.config.vocab_size, 200)
    prompt = torch.randint(3, vocab, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    ref_tokens, ref_logits = hf_chunked_greedy(model, prompt, 4)
    n = model.config.num_hidden_layers
    stages = []
    for start, end in [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)]:
        shard = load_shard(snapshot, LayerRange(start, end), Precision.BFLOAT16)
        assert widen_linears(shard.modules) > 0  # forced: the CPU under test may have AVX-512
        stages.append(Stage(shard))
    tokens, logits = split_greedy(stages, prompt, 4)
    assert tokens[0] == ref_tokens[0]
    assert float((logits[0] - ref_logits[0]).abs().max()) <= 2e-2


def test_the_scratch_serves_calls_in_and_out_of_inference_mode():
    """A thread's first call may come from a stage (inference mode) and a later one from
    elsewhere: the scratch buffer must stay writable in both."""
    w, x = torch.ones(64, 576).bfloat16(), torch.ones(8, 576).bfloat16()
    results: list[torch.Tensor] = []

    def work():
        with torch.inference_mode():
            results.append(widened_linear(x, w, None))
        results.append(widened_linear(x, w, None))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert len(results) == 2 and all(bool((r == 576).all()) for r in results)

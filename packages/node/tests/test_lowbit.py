"""Low-bit weights at run time (ADR-0031): int8 and int4 for every family, experts included.

Exactness is against one stage at the same precision (the split changes nothing), in
float32 compute; batched decode against one session at a time; the packed formats against
their dequantized matrices."""

from __future__ import annotations

import pytest
import torch
from baselines import split_greedy
from stage_drivers import decode_sessions, speculative_greedy
from torch import nn

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.tiny import snapshots as tiny
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.kernels import intpack
from meshnet_node.kernels import packed as packed_kernels
from meshnet_node.lowbit.modules import PackedExperts, PackedLinear
from meshnet_node.lowbit.packed import (
    WIDE_ROWS,
    Int4Weight,
    Int8Weight,
    packed_bytes,
    prompt_calls,
)

LOWBIT = (Precision.INT8, Precision.INT4)


@pytest.fixture(autouse=True, scope="module")
def _kernels():
    """meshnet's int8/int4 kernels where they build (as a node loads them), else torch's."""
    packed_kernels.start("cpu")
    packed_kernels.wait()


def _prompt(n: int = 140) -> list[int]:  # crosses a 128-token chunk: wide and narrow calls
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(9)).tolist()


def _stages(snapshot, precision, cuts, dtype=torch.float32, group=32) -> list[Stage]:
    return [
        Stage(load_shard(snapshot, LayerRange(a, b), precision, dtype=dtype, group_size=group))
        for a, b in cuts
    ]


@pytest.mark.parametrize("precision", LOWBIT, ids=lambda p: p.value)
@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_split_equals_one_stage_at_the_same_precision(tiny_snapshot, family, precision):
    snapshot = tiny_snapshot(family)
    whole = _stages(snapshot, precision, [(0, 6)])
    packed = [m for m in whole[0].shard.modules.modules() if isinstance(m, PackedLinear)]
    assert packed, "no Linear was packed"
    if family in tiny.MOE_FAMILIES:
        assert any(isinstance(m, PackedExperts) for m in whole[0].shard.modules.modules())
    ref_tokens, ref_logits = split_greedy(whole, _prompt(), 6)
    for cuts in ([(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)]):
        tokens, logits = split_greedy(_stages(snapshot, precision, cuts), _prompt(), 6)
        assert tokens == ref_tokens, cuts
        for got, ref in zip(logits, ref_logits, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_int4_in_bfloat16_tracks_the_bfloat16_model(tiny_snapshot, family):
    """The same tokens split or not in bfloat16 compute, and logits close to bf16 weights'."""
    snapshot = tiny_snapshot(family)
    tokens, logits = split_greedy(
        _stages(snapshot, Precision.INT4, [(0, 6)], torch.bfloat16), _prompt(), 4
    )
    split_tokens, _ = split_greedy(
        _stages(snapshot, Precision.INT4, [(0, 3), (3, 6)], torch.bfloat16), _prompt(), 4
    )
    assert split_tokens == tokens
    _, ref_logits = split_greedy(
        _stages(snapshot, Precision.BFLOAT16, [(0, 6)], None), _prompt(), 1
    )
    corr = torch.corrcoef(torch.stack([logits[0], ref_logits[0]]))[0, 1]
    assert corr > 0.9  # 4-bit weights perturb a random model's logits; they stay correlated


@pytest.mark.parametrize("precision", LOWBIT, ids=lambda p: p.value)
@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "deepseek_v3", "gpt_oss"])
def test_batched_decode_equals_one_session_at_a_time(tiny_snapshot, family, precision):
    stages = _stages(tiny_snapshot(family), precision, [(0, 3), (3, 6)], torch.bfloat16)
    assert decode_sessions(stages, batched=True) == decode_sessions(stages, batched=False)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_verified_drafts_keep_the_tokens_of_plain_int4_decoding(tiny_snapshot, family):
    """Verification passes (1 + drafts rows, accepted and rejected) on int4 stages give
    the tokens of plain decoding at int4, in bfloat16 compute: each row is a one-token
    step's, bit for bit."""
    snapshot = tiny_snapshot(family)
    cuts = [(0, 2), (2, 4), (4, 6)]
    reference, _ = split_greedy(
        _stages(snapshot, Precision.INT4, cuts, torch.bfloat16), _prompt(), 20
    )
    stages = _stages(snapshot, Precision.INT4, cuts, torch.bfloat16)
    vocab = stages[0].shard.vocab_size
    assert speculative_greedy(stages, _prompt(), reference, vocab) == reference


# -- the packed formats -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_and_int4_stand_for_the_weight(dtype):
    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    int8 = Int8Weight.quantize(weight, dtype)
    int4 = Int4Weight.quantize(weight, 32, dtype)
    step8 = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((int8.dequantize() - weight).abs() <= step8 * 0.51 + 1e-2).all()
    grouped = weight.view(128, 8, 32)
    step4 = (grouped.amax(-1) - grouped.amin(-1)) / 15
    err4 = (int4.dequantize() - weight).abs().view(128, 8, 32).amax(-1)
    assert (err4 <= step4 * 0.51 + 2e-2).all()
    act = torch.finfo(dtype).bits // 8  # scales (and int4 zeros) are held in the compute dtype
    assert packed_bytes(int8) == weight.numel() + 128 * act
    assert packed_bytes(int4) == weight.numel() // 2 + 2 * act * weight.numel() // 32


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_rows_are_independent_and_a_long_prompt_chunk_agrees(fmt):
    """A row's output is the same alone or among others (batched = unbatched, exactly); a
    long chunk inside ``prompt_calls`` unpacks for a GEMM and agrees within rounding."""
    weight = torch.randn(256, 128, generator=torch.Generator().manual_seed(2))
    packed = (
        Int8Weight.quantize(weight, torch.float32)
        if fmt == "int8"
        else Int4Weight.quantize(weight, 64, torch.float32)
    )
    wide_rows = WIDE_ROWS[fmt]
    x = torch.randn(wide_rows + 32, 128, generator=torch.Generator().manual_seed(3))
    rows = torch.cat([packed.matmul(x[i : i + 1]) for i in range(len(x))])
    with prompt_calls():  # up to WIDE_ROWS rows even a prompt chunk takes the kernel
        assert torch.equal(packed.matmul(x[:wide_rows]), rows[:wide_rows])
    assert torch.equal(packed.matmul(x), rows)  # outside a prompt chunk: the kernel
    with prompt_calls():
        wide = packed.matmul(x)
    torch.testing.assert_close(wide, x @ packed.dequantize().t(), rtol=1e-5, atol=1e-4)
    # the kernel's rows: int4 rows may be taken as two int8 digits (AVX-512 VNNI, ADR-0045)
    digits = (
        fmt == "int4" and intpack.module() is not None and intpack.takes_digits(intpack.module())
    )
    assert intpack.close(rows, x, packed.dequantize(), None, digits=digits)


def test_packed_linear_moves_and_keeps_its_bias():
    linear = nn.Linear(64, 32)
    packed = PackedLinear(Int8Weight.quantize(linear.weight.data, torch.float32), linear.bias.data)
    packed = packed.to("cpu")
    x = torch.randn(3, 5, 64)
    ref = x @ packed.packed.dequantize().t() + linear.bias.data
    torch.testing.assert_close(packed(x), ref, rtol=1e-5, atol=1e-5)
    assert {n for n, _ in packed.named_buffers()} == {"packed_q", "packed_scale"}

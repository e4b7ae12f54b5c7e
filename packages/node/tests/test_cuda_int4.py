"""int4 through torch's weight-only int4 kernel on a GPU (``lowbit.cuda_int4``, ADR-0055).

The conversion is checked here on CPU, through the CPU twin of the kernel
(``_weight_int4pack_mm_for_cpu``), which computes the same function from the same
``scale_zero``; the CUDA pair itself runs in the ``gpu``-marked test."""

from __future__ import annotations

import logging

import pytest
import torch
from baselines import split_greedy

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.kernels import intpack
from meshnet_node.lowbit.cuda_int4 import (
    TinygemmCheck,
    TinygemmInt4,
    TinygemmOps,
    codes_of,
    inner_k_tiles,
    pack_nibbles,
    to_tinygemm,
)
from meshnet_node.lowbit.modules import PackedLinear
from meshnet_node.lowbit.packed import Int4Weight

CPU = torch.device("cpu")
PROMPT = [5, 91, 17, 140, 33, 8, 77, 12, 190, 64]


def probe_weight(n: int, k: int, group: int, seed: int = 0):
    codes, packed, scale_zero = intpack.int4_probe(n, k, group, torch.bfloat16, seed=seed)
    return codes, scale_zero, Int4Weight(packed, scale_zero, group, (n, k))


@pytest.mark.parametrize(("n", "k", "group"), [(64, 256, 32), (256, 64, 64), (48, 128, 128)])
def test_the_codes_come_back_exactly(n, k, group):
    codes, _, weight = probe_weight(n, k, group, seed=n)
    assert torch.equal(codes_of(weight), codes)


def test_two_codes_a_byte_the_even_input_high():
    codes = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]], dtype=torch.int32)
    assert pack_nibbles(codes).tolist() == [[0x12, 0xF0], [0x78, 0x9A]]
    assert pack_nibbles(codes).dtype is torch.uint8


def test_the_widest_tiling_of_the_inputs():
    assert [inner_k_tiles(k) for k in (1024, 576, 64, 32, 48)] == [8, 4, 4, 2, None]


def test_the_kernel_form_computes_the_weights_products():
    n, k, group = 128, 512, 64
    codes, scale_zero, weight = probe_weight(n, k, group, seed=3)
    form = TinygemmInt4.from_int4(weight, TinygemmOps.for_device(CPU))
    exact = intpack.int4_weight(codes, scale_zero, group)  # float64
    torch.testing.assert_close(form.dequantize(torch.float64), exact, rtol=8e-3, atol=1e-4)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    want = x.double() @ exact.t()
    for rows in (x.to(torch.bfloat16), x):  # bf16 rows, and float32 rows taken as bf16
        got = form.matmul(rows)
        assert got.dtype is rows.dtype and got.shape == (7, n)
        torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(got.double(), weight.matmul(rows).double(), rtol=3e-2, atol=3e-2)  # fmt: skip


def test_only_bf16_weights_of_shapes_the_kernel_takes_convert():
    _, _, weight = probe_weight(64, 256, 64)
    assert TinygemmInt4.convertible(weight)
    floats = Int4Weight(weight.packed, weight.scale_zero.float(), 64, (64, 256))
    assert not TinygemmInt4.convertible(floats)  # the CUDA kernel takes bf16 scales
    _, _, odd_group = probe_weight(64, 240, 16)
    assert not TinygemmInt4.convertible(odd_group)


def test_a_converted_stage_gives_the_int4_stages_tokens(tiny_snapshot):
    """Every int4 projection of a tiny Llama held in the kernel's form: the greedy tokens of
    a split over two stages are the packed stages', and the logits within bf16 rounding."""
    snapshot = tiny_snapshot("llama")

    def run(convert: bool):
        stages = []
        for a, b in ((0, 3), (3, 6)):
            shard = load_shard(snapshot, LayerRange(a, b), Precision.INT4, fuse=False)
            if convert:
                assert to_tinygemm(shard.modules, CPU) > 0
                held = [m.packed for m in shard.modules.modules() if isinstance(m, PackedLinear)]
                assert held and all(isinstance(w, TinygemmInt4) for w in held)
            stages.append(Stage(shard, engine="modules"))
        return split_greedy(stages, PROMPT, 6)

    (want_tokens, want_logits), (tokens, logits) = run(False), run(True)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def test_a_device_whose_kernel_fails_keeps_its_weights(tiny_snapshot, monkeypatch, caplog):
    def broken(device):
        raise RuntimeError("no kernel image for this device")

    shard = load_shard(tiny_snapshot("llama"), LayerRange(0, 2), Precision.INT4, fuse=False)
    before = [m.packed for m in shard.modules.modules() if isinstance(m, PackedLinear)]
    monkeypatch.setattr(TinygemmOps, "for_device", staticmethod(broken))
    with caplog.at_level(logging.WARNING):
        assert to_tinygemm(shard.modules, CPU, check=TinygemmCheck()) == 0
    after = [m.packed for m in shard.modules.modules() if isinstance(m, PackedLinear)]
    assert after == before and all(isinstance(w, Int4Weight) for w in after)
    assert "keeps unpacking per product" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_int4_stages_read_the_codes_and_agree_with_cpu(tiny_snapshot):
    """On a GPU, an int4 shard holds torch's int4 kernel's tiles and gives the CPU int4
    stages' greedy tokens."""
    snapshot = tiny_snapshot("llama")

    def run(device: str):
        stages = []
        for a, b in ((0, 3), (3, 6)):
            shard = load_shard(snapshot, LayerRange(a, b), Precision.INT4, device=device)
            stages.append(Stage(shard))
        return stages, split_greedy(stages, PROMPT, 6)

    stages, (tokens, logits) = run("cuda")
    held = [m.packed for s in stages for m in s.shard.modules.modules() if isinstance(m, PackedLinear)]  # fmt: skip
    assert held and all(isinstance(w, TinygemmInt4) for w in held)
    _, (cpu_tokens, cpu_logits) = run("cpu")
    assert tokens == cpu_tokens
    torch.testing.assert_close(logits[0].float().cpu(), cpu_logits[0].float(), rtol=0.05, atol=0.05)  # fmt: skip

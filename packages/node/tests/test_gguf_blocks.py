"""GGUF's 4-bit blocks (Q4_0, Q4_1, Q4_K) become group-32 int4 weights equal to what the
``gguf`` package dequantizes them to (Q4_0 bit for bit; Q4_1/Q4_K up to the zero's float32
rounding), and multiply as such."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from meshnet_common.tiny.gguf_files import pack_q4_k, pack_q5_k, pack_q6_k
from meshnet_node.kernels import intpack
from meshnet_node.kernels.tolerance import digits_bound
from meshnet_node.lowbit.gguf_blocks import BLOCKS, int4_weight, int8_weight
from meshnet_node.lowbit.packed import Int4Weight, Int8Weight


def raw_blocks(fmt: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random blocks of ``fmt`` with finite, plausible f16 scales: every code and 6-bit
    sub-scale pattern occurs."""
    weights, size = BLOCKS[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // weights, size), dtype=np.uint8)
    scales = (rng.random((rows, k // weights, 2)) * 0.02 + 1e-3).astype(np.float16)
    if fmt == "Q4_1":  # the minimum is negative, as in real blocks
        scales[..., 1] = -(scales[..., 1] * 8)
    head = 2 if fmt == "Q4_0" else 4
    raw[..., :head] = scales[..., : head // 2].view(np.uint8).reshape(rows, -1, head)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, fmt: str) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).copy())


@pytest.mark.parametrize("fmt", list(BLOCKS))
@pytest.mark.parametrize(("rows", "k"), [(64, 256), (512, 512), (304, 768)])
def test_blocks_dequantize_as_gguf_does(fmt, rows, k):
    raw = raw_blocks(fmt, rows, k, seed=rows + k)
    want = reference(raw, fmt)
    weight = int4_weight(torch.from_numpy(raw), fmt, torch.float32)
    assert (weight.out_features, weight.in_features, weight.group) == (rows, k, 32)
    got = weight.dequantize()
    if fmt == "Q4_0":
        assert torch.equal(got, want)
    else:  # the zero, m + 8d or 8 d sc - dmin m, is one float32 rounding away
        torch.testing.assert_close(got, want, rtol=0, atol=float(want.abs().max()) * 2**-21)


def test_q4_0_from_the_gguf_package_quantizer_round_trips():
    x = np.random.default_rng(0).standard_normal((96, 256)).astype(np.float32)
    for fmt in ("Q4_0", "Q4_1"):
        raw = quants.quantize(x, gguf.GGMLQuantizationType[fmt])
        want = reference(raw, fmt)
        got = int4_weight(torch.from_numpy(raw), fmt, torch.float32).dequantize()
        torch.testing.assert_close(got, want, rtol=0, atol=float(want.abs().max()) * 2**-21)


@pytest.mark.parametrize("fmt", list(BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_are_those_of_the_dequantized_matrix(fmt, dtype):
    raw = raw_blocks(fmt, 256, 512, seed=7)
    want = reference(raw, fmt).double()
    weight = int4_weight(torch.from_numpy(raw), fmt, dtype)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
    exact = x.double() @ want.t()
    scale = x.double().abs() @ want.abs().t()
    # bf16: the scale and zero round to bf16, and so does the output; float32 rows taken as
    # two int8 digits where the kernel takes them (AVX-512 VNNI, ADR-0045/0046): their bound
    unit = 2.0**-7 if dtype is torch.bfloat16 else 2.0**-19
    module = intpack.module()
    digits = digits_bound(x, want) if module is not None and intpack.takes_digits(module) else 0
    assert ((weight.matmul(x).double() - exact).abs() <= unit * scale + digits + 1e-6).all()


def test_a_row_of_broken_blocks_is_refused():
    with pytest.raises(ValueError, match="not whole blocks"):
        int4_weight(torch.zeros(32, 30, dtype=torch.uint8), "Q4_0", torch.float32)


@pytest.mark.parametrize(
    ("fmt", "pack", "group", "levels"),
    [("Q4_K", pack_q4_k, 32, 15), ("Q5_K", pack_q5_k, 32, 31), ("Q6_K", pack_q6_k, 16, 31)],
)
def test_our_k_quant_packers_write_what_the_gguf_package_reads_back(fmt, pack, group, levels):
    """``meshnet_common.tiny.gguf_files``'s packers (the gguf package cannot write K-quants): their blocks, read
    back by the gguf package, are within about half a step of each group's grid of the input
    (a block laid out wrong would be off by the values themselves)."""
    x = np.random.default_rng(3).standard_normal((48, 512)).astype(np.float32)
    raw = pack(x)
    assert raw.shape == (48, 2 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]][1])
    back = reference(raw, fmt).numpy().reshape(48, -1, group)
    groups = x.reshape(48, -1, group)
    if fmt == "Q6_K":  # symmetric: d * sc * (q - 32)
        step = np.abs(groups).max(-1) / 31
    else:  # d sc q - dmin m, the minimum at most 0
        step = (groups.max(-1) - np.minimum(groups.min(-1), 0)) / levels
    err = np.abs(back - groups).max(-1)
    # rounding the code (half a step) plus the 6/8-bit scale and minimum's rounding
    assert (err <= 0.8 * step).all()
    assert np.abs(back - groups).mean() < 0.3 * step.mean()


@pytest.mark.parametrize("fmt", ["Q8_0", "Q5_K", "Q6_K", "Q4_K"])
@pytest.mark.parametrize("rows", [64, 304])
def test_other_blocks_are_rounded_as_their_dequantized_values_would_be(fmt, rows):
    """Block types int4 / int8 do not hold as they are go from their values, 256 rows at a
    time: the same weight as quantizing the whole dequantized matrix at once."""
    x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
    packer = {"Q5_K": pack_q5_k, "Q6_K": pack_q6_k, "Q4_K": pack_q4_k}.get(fmt)
    raw = packer(x) if packer else quants.quantize(x, gguf.GGMLQuantizationType[fmt])
    values = reference(raw, fmt)
    got8 = int8_weight(torch.from_numpy(raw), fmt, torch.float32)
    want8 = Int8Weight.quantize(values, torch.float32)
    assert torch.equal(got8.q, want8.q) and torch.equal(got8.scale, want8.scale)
    # int8's rounding: at most half a step of the row's scale
    err = (got8.dequantize() - values).abs().amax(dim=1)
    assert (err <= values.abs().amax(dim=1) / 254 * 1.001).all()
    if fmt == "Q4_K":
        return  # int4 holds it as it is (test_blocks_dequantize_as_gguf_does)
    got4 = int4_weight(torch.from_numpy(raw), fmt, torch.float32)
    want4 = Int4Weight.quantize(values, 32, torch.float32)
    assert torch.equal(got4.dequantize(), want4.dequantize())


def test_a_row_of_broken_blocks_is_refused_for_any_type():
    with pytest.raises(ValueError, match="not whole blocks"):
        int8_weight(torch.zeros(32, 200, dtype=torch.uint8), "Q6_K", torch.float32)

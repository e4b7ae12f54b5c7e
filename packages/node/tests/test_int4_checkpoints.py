"""GPTQ, AWQ and compressed-tensors int4 tensors become Int4Weights equal to their formats'
definitions (within the zero's float32 rounding). Packed here by the formats' published
algorithms, written out loop by loop (never a downloaded file)."""

from __future__ import annotations

import pytest
import torch

from meshnet_node.lowbit.int4_checkpoints import (
    AWQ_ORDER,
    Int4CheckpointError,
    awq_int4,
    compressed_int4,
    gptq_int4,
)

N, K, GROUP = 320, 256, 64


def _words(codes: torch.Tensor, order=range(8)) -> torch.Tensor:
    """Pack the last axis eight codes a word: field i holds code 8j + order[i]."""
    rows, n = codes.shape
    out = torch.zeros(rows, n // 8, dtype=torch.int64)
    for j in range(n // 8):
        for i, pick in enumerate(order):
            out[:, j] |= codes[:, 8 * j + pick].long() << (4 * i)
    return out.to(torch.int32)  # as the formats store them (bit 31 may be set: wraps)


def _probe(seed: int, lowest_zero: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=gen)  # [in, out], as GPTQ and AWQ lay it
    z = torch.randint(lowest_zero, 16, (K // GROUP, N), generator=gen)
    s = (torch.rand(K // GROUP, N, generator=gen) * 0.01 + 1e-3).half()
    w = (q - z.repeat_interleave(GROUP, 0)) * s.float().repeat_interleave(GROUP, 0)
    return q, z, s, w.t()  # W [out, in]


@pytest.mark.parametrize("v1", [True, False])
def test_gptq_is_scale_times_code_minus_zero(v1):
    # v1 stores zero - 1, so its zeros run 1..15 (a zero of 0 would wrap to 16, as in
    # every v1 reader: the format's own flaw)
    q, z, s, want = _probe(1, lowest_zero=1 if v1 else 0)
    qweight = _words(q.t().contiguous()).t().contiguous()  # packed along the input
    qzeros = _words(z - 1 if v1 else z)
    g_idx = torch.arange(K, dtype=torch.int32) // GROUP
    got = gptq_int4(qweight, qzeros, s, g_idx, GROUP, torch.float32, v1=v1).dequantize()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_awq_unpacks_its_interleaved_order():
    q, z, s, want = _probe(2)
    qweight = _words(q, AWQ_ORDER)  # [in, out / 8], packed along the output
    qzeros = _words(z, AWQ_ORDER)
    got = awq_int4(qweight, qzeros, s, GROUP, torch.float32).dequantize()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_pack_quantized(symmetric):
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-8, 8, (N, K), generator=gen)  # signed, stored +8
    zp = torch.randint(-8, 8, (N, K // GROUP), generator=gen)
    s = (torch.rand(N, K // GROUP, generator=gen) * 0.01 + 1e-3).bfloat16()
    packed = _words(q + 8)  # [out, in / 8]
    zero_point = None if symmetric else _words((zp + 8).t().contiguous()).t().contiguous()
    expanded = s.float().repeat_interleave(GROUP, 1)
    want = (q - (0 if symmetric else zp.repeat_interleave(GROUP, 1))) * expanded
    got = compressed_int4(packed, s, torch.float32, zero_point).dequantize()
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_are_the_definitions(dtype):
    q, z, s, want = _probe(4)
    weight = awq_int4(_words(q, AWQ_ORDER), _words(z, AWQ_ORDER), s, GROUP, dtype)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5)).to(dtype)
    exact = x.double() @ want.double().t()
    bound = (2.0**-7 if dtype is torch.bfloat16 else 1e-5) * (x.double().abs() @ want.double().abs().t())  # fmt: skip
    assert ((weight.matmul(x).double() - exact).abs() <= bound + 1e-6).all()


def test_act_order_and_ragged_groups_are_refused():
    q, z, s, _ = _probe(6)
    qweight = _words(q.t().contiguous()).t().contiguous()
    shuffled = (torch.arange(K) // GROUP)[torch.randperm(K, generator=torch.Generator().manual_seed(0))]  # fmt: skip
    with pytest.raises(Int4CheckpointError, match="act-order"):
        gptq_int4(qweight, _words(z), s, shuffled.int(), GROUP, torch.float32)
    with pytest.raises(Int4CheckpointError, match="whole groups"):
        awq_int4(_words(q, AWQ_ORDER), _words(z, AWQ_ORDER), s, 96, torch.float32)

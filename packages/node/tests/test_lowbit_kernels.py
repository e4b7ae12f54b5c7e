"""int8 / int4 products and int4 unpacking in meshnet_node.kernels.packed: equal to torch's
kernels within float32 rounding (the unpacking bit for bit), rows independent of each
other and of the thread count, torch's kernels serving where ours is not checked."""

from __future__ import annotations

import types

import pytest
import torch

from meshnet_node.kernels import intpack
from meshnet_node.kernels.tolerance import digits_bound

INT4_CASES = [  # (N, K, group)
    (576, 576, 32), (576, 576, 64), (1536, 576, 64), (1536, 2048, 128), (2048, 576, 32),
    (2048, 2048, 64), (2048, 2048, 128), (128, 256, 64),
]  # fmt: skip
INT8_CASES = [(576, 576), (1536, 2048), (2048, 576), (96, 64), (40, 192), (36, 200), (17, 33)]
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 33]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernel(packed_kernel) -> types.ModuleType:
    assert intpack.ready(), intpack.unavailable_reason()
    return packed_kernel


def block_of(n: int) -> int:
    block = intpack.int4_block_n(n)
    if block is None:
        pytest.skip(f"torch's int4 packing of {n} rows is not a known layout here")
    return block


@pytest.mark.parametrize(("n", "k", "group"), INT4_CASES)
def test_int4_dequantize_is_torchs_unpacking_bit_for_bit(kernel, n, k, group):
    block = block_of(n)
    for sz_dtype in DTYPES:
        codes, pk, sz = intpack.int4_probe(n, k, group, sz_dtype, seed=n + k)
        for out_dtype in DTYPES:
            want = torch.empty(n, k, dtype=out_dtype)
            intpack.TorchLowbit.int4_dequantize(pk, sz, group, block, want)
            got = torch.empty(n, k, dtype=out_dtype)
            assert torch.equal(intpack.int4_dequantize(pk, sz, group, block, got, _module=kernel), want)  # fmt: skip
        # and the reference is the definition, (code - 8) * scale + zero (float32: 2 roundings)
        exact = intpack.int4_weight(codes, sz, group)
        want = torch.empty(n, k)
        intpack.TorchLowbit.int4_dequantize(pk, sz, group, block, want)
        assert torch.allclose(want.double(), exact, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("n", "k", "group"), INT4_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_linear_equals_the_product_and_torchs(kernel, n, k, group, dtype):
    """Within float32 rounding of the exact product and of torch's kernel; with rows taken
    as two int8 digits (AVX-512 VNNI: ADR-0045), within the digits' bound more."""
    block = block_of(n)
    digits = intpack.takes_digits(kernel)
    codes, pk, sz = intpack.int4_probe(n, k, group, dtype, seed=group)
    weight = intpack.int4_weight(codes, sz, group)
    gen = torch.Generator().manual_seed(n)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        ours = intpack.int4_linear(x, pk, sz, group, block, _module=kernel)
        theirs = intpack.TorchLowbit.int4_linear(x, pk, sz, group, block)
        assert ours.dtype is dtype and ours.shape == (rows, n)
        assert intpack.close(ours, x, weight, None, digits=digits), rows
        assert intpack.near(ours, theirs, x, weight, digits=digits), rows


@pytest.mark.parametrize(("n", "k", "group"), [(576, 576, 32), (1536, 2048, 128), (960, 1536, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_rows_as_two_int8_digits_are_within_their_bound(kernel, n, k, group, dtype):
    """Where the CPU has AVX-512 VNNI, bf16 and float32 rows meet int4 weights as two int8
    digits per 32 inputs (d = max |x| / 127, then the rest in steps of d / 254): one digit
    (llama.cpp's Q8 inputs) would be 254 times further from the exact product."""
    if not intpack.takes_digits(kernel):
        pytest.skip("no AVX-512 VNNI here: rows take the bf16 or float32 tiles (exact inputs)")
    block = block_of(n)
    codes, pk, sz = intpack.int4_probe(n, k, group, dtype, seed=k)
    weight = intpack.int4_weight(codes, sz, group)  # float64 (N, K)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(group)).to(dtype)
    ours = kernel.int4_linear(x, pk, sz, group, block).double()  # float32 before any cast
    _within_two_digits(ours, x.double(), weight)


def _within_two_digits(ours, xd, weight):
    """The float32 product of rows taken as two int8 digits per 32 (each input within
    max |x| / 64516) within that times the weights' magnitudes plus float32 rounding, and
    not within a bound 254 times tighter (the digits are in use, not exact inputs)."""
    exact = xd @ weight.T
    bound = digits_bound(xd, weight) + 1e-5 * (xd.abs() @ weight.abs().T)
    assert bool(((ours - exact).abs() <= bound).all())
    assert not bool(((ours - exact).abs() <= bound / 254).all())


@pytest.mark.parametrize(("n", "k"), [(49152, 576), (576, 1536), (100, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [32, 16])
def test_q8_rows_as_two_int8_digits_are_within_their_bound(kernel, n, k, dtype, block):
    """Q8_0 blocks (a GGUF's LM head) and Q6_K's sub-blocks of 16 against bf16 or float32
    rows take them as the same two digits where the CPU has AVX-512 VNNI (ADR-0045):
    vpdpbusd on the codes with their sign bit flipped, from -128 times the digits' sums."""
    if not intpack.takes_digits(kernel):
        pytest.skip("no AVX-512 VNNI here: rows take the bf16 or float32 tiles (exact inputs)")
    gen = torch.Generator().manual_seed(n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    d = torch.rand(n, k // block, generator=gen) * 0.01
    weight = (q.double().view(n, k // block, block) * d.double().unsqueeze(-1)).view(n, k)
    x = torch.randn(3, k, generator=gen).to(dtype)
    _within_two_digits(kernel.q8_linear(x, q, d).double(), x.double(), weight)


@pytest.mark.parametrize(("n", "k"), INT8_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_linear_equals_the_product_and_torchs(kernel, n, k, dtype):
    q, scale = intpack.int8_probe(n, k, dtype, seed=k)
    weight = q.double() * scale.double()[:, None]
    gen = torch.Generator().manual_seed(n)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        ours = intpack.int8_linear(x, q, scale, _module=kernel)
        assert ours.dtype is dtype and ours.shape == (rows, n)
        assert intpack.close(ours, x, weight, None), rows
        if k % 32 == 0:  # torch 2.13's bf16 int8 kernel crashes on other widths
            assert intpack.near(ours, intpack.TorchLowbit.int8_linear(x, q, scale), x, weight)


@pytest.mark.parametrize(("n", "k"), [(49152, 576), (576, 1536), (96, 64), (17, 96)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block", "zeros"), [(32, False), (16, False), (32, True), (16, True)])
def test_q8_linear_equals_the_product_and_the_definition(kernel, n, k, dtype, block, zeros):
    """llama.cpp's Q8_0 blocks (an LM head's shape first), Q6_K's sub-blocks of 16, and
    blocks with a zero each (Q5_1, Q5_K): within float32 rounding of the exact product and
    of the float32 definition; each row alone gives the rows' bits, on any thread count."""
    q, d = intpack.q8_probe(n, k, seed=n, block=block)
    gen = torch.Generator().manual_seed(k)
    z = (torch.rand(d.shape, generator=gen) - 0.5) * 0.01 if zeros else None
    weight = q.double() * d.double().repeat_interleave(block, 1)
    if z is not None:
        weight = weight + z.double().repeat_interleave(block, 1)
    x = torch.randn(9, k, generator=gen).to(dtype)
    ours = intpack.q8_linear(x, q, d, z, _module=kernel)
    digits = intpack.takes_digits(kernel)
    assert ours.dtype is dtype and ours.shape == (9, n)
    assert intpack.close(ours, x, weight, None, digits=digits)
    theirs = intpack.TorchLowbit.q8_linear(x, q, d, z)
    assert intpack.near(ours, theirs, x, weight, digits=digits)
    alone = [intpack.q8_linear(x[i : i + 1], q, d, z, _module=kernel) for i in range(9)]
    assert torch.equal(torch.cat(alone), ours)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(intpack.q8_linear(x, q, d, z, _module=kernel), ours)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1536, 576, 960])  # 24, 9 and 15 blocks of 64: halves on 2 threads
def test_rows_alone_equal_rows_together_whatever_the_threads(kernel, dtype, n):
    """A decode row gives the same bits alone, in a batch of any size, on any thread count
    (an odd number of blocks is split into half blocks among the threads)."""
    k, group = 576, 64
    block = block_of(n)
    _, pk, sz = intpack.int4_probe(n, k, group, dtype, seed=3)
    q, scale = intpack.int8_probe(n, k + 8, dtype, seed=3)  # a width with a scalar tail
    x4 = torch.randn(33, k).to(dtype)
    x8 = torch.randn(33, k + 8).to(dtype)
    for call, x in (
        (lambda rows: intpack.int4_linear(rows, pk, sz, group, block, _module=kernel), x4),
        (lambda rows: intpack.int8_linear(rows, q, scale, _module=kernel), x8),
    ):
        together = call(x)
        assert torch.equal(together, torch.cat([call(x[i : i + 1]) for i in range(len(x))]))
        assert torch.equal(together[5:21], call(x[5:21]))
        threads = torch.get_num_threads()
        try:
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                assert torch.equal(together, call(x))
                assert torch.equal(together[:1], call(x[:1]))
        finally:
            torch.set_num_threads(threads)


def test_leading_dimensions(kernel):
    _, pk, sz = intpack.int4_probe(128, 128, 32, torch.bfloat16, seed=1)
    q, scale = intpack.int8_probe(128, 128, torch.bfloat16, seed=1)
    x = torch.randn(2, 3, 128).bfloat16()
    y4 = intpack.int4_linear(x, pk, sz, 32, block_of(128), _module=kernel)
    assert y4.shape == (2, 3, 128)
    assert torch.equal(y4[1], intpack.int4_linear(x[1], pk, sz, 32, block_of(128), _module=kernel))
    y8 = intpack.int8_linear(x, q, scale, _module=kernel)
    assert torch.equal(y8.view(6, 128), intpack.int8_linear(x.view(6, 128), q, scale, _module=kernel))  # fmt: skip


def test_the_check_accepts_the_kernel(kernel):
    assert intpack.agrees_with_reference(kernel) is None


def _copy(kernel) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{n: getattr(kernel, n) for n in dir(kernel) if not n.startswith("_")})  # fmt: skip


def test_the_check_refuses_a_kernel_that_is_off(kernel):
    wrong = _copy(kernel)
    wrong.int4_linear = lambda x, p, sz, g, b: kernel.int4_linear(x, p, sz, g, b) * (1 + 1e-3)
    assert "int4 product differs" in intpack.agrees_with_reference(wrong)

    wrong = _copy(kernel)

    def off_unpack(p, sz, g, b, out):  # the block's halves swapped
        kernel.int4_dequantize(p, sz, g, b, out)
        n = out.shape[0]
        out.copy_(out.view(n // b, 2, b // 2, -1).flip(1).reshape(out.shape))

    wrong.int4_dequantize = off_unpack
    assert "int4 unpacking differs" in intpack.agrees_with_reference(wrong)

    wrong = _copy(kernel)

    def batch_dependent(x, q, s):  # a row's result depends on the rows beside it
        y = kernel.int8_linear(x, q, s)
        return y + 1e-7 * y.abs() * (len(x) > 1)

    wrong.int8_linear = batch_dependent
    assert "rows alone differ" in intpack.agrees_with_reference(wrong)


def test_a_refused_kernel_leaves_torchs_kernels_serving(kernel, monkeypatch, caplog):
    monkeypatch.setattr(intpack, "_state", {"module": None, "reason": None})
    monkeypatch.setattr(intpack, "agrees_with_reference", lambda m: "int4 product differs")
    with caplog.at_level("INFO", logger=intpack.__name__):
        intpack.install(kernel)
    assert not intpack.ready()
    assert "int4 product differs" in intpack.unavailable_reason()
    records = [r for r in caplog.records if r.name == intpack.__name__]
    assert len(records) == 1 and records[0].levelname == "WARNING"
    # the public functions now give torch's kernels' results exactly
    _, pk, sz = intpack.int4_probe(128, 128, 32, torch.bfloat16, seed=2)
    q, scale = intpack.int8_probe(128, 128, torch.bfloat16, seed=2)
    x = torch.randn(3, 128).bfloat16()
    block = block_of(128)
    assert torch.equal(
        intpack.int4_linear(x, pk, sz, 32, block), intpack.TorchLowbit.int4_linear(x, pk, sz, 32, block)
    )  # fmt: skip
    assert torch.equal(
        intpack.int8_linear(x, q, scale), intpack.TorchLowbit.int8_linear(x, q, scale)
    )
    out, want = torch.empty(128, 128), torch.empty(128, 128)
    intpack.TorchLowbit.int4_dequantize(pk, sz, 32, block, want)
    assert torch.equal(intpack.int4_dequantize(pk, sz, 32, block, out), want)


def test_an_accepted_kernel_serves_with_one_log_line(kernel, monkeypatch, caplog):
    monkeypatch.setattr(intpack, "_state", {"module": None, "reason": None})
    with caplog.at_level("INFO", logger=intpack.__name__):
        intpack.install(kernel)
    assert intpack.ready()
    assert len([r for r in caplog.records if r.name == intpack.__name__]) == 1


def test_without_a_block_torchs_int4_kernel_serves(kernel):
    _, pk, sz = intpack.int4_probe(64, 128, 32, torch.float32, seed=4)
    x = torch.randn(2, 128)
    want = intpack.TorchLowbit.int4_linear(x, pk, sz, 32, None)
    assert torch.equal(intpack.int4_linear(x, pk, sz, 32, None, _module=kernel), want)


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_of_other_widths(kernel, block, dtype):
    """torch packs 32- or 16-row blocks on other CPUs or widths: the unpacking reads any
    block, the product the ones it lists (``int4_blocks``), torch's kernel the rest."""
    n, k, group = 192, 128, 32
    codes, _, sz = intpack.int4_probe(n, k, group, dtype, seed=block)
    c = codes.to(torch.uint8).view(n // block, block, k).transpose(1, 2)  # [N/B, K, B]
    layout = (c[..., : block // 2] | (c[..., block // 2 :] << 4)).contiguous().view(-1)
    for out_dtype in DTYPES:
        want, got = torch.empty(n, k, dtype=out_dtype), torch.empty(n, k, dtype=out_dtype)
        intpack.TorchLowbit.int4_dequantize(layout, sz, group, block, want)
        assert torch.equal(intpack.int4_dequantize(layout, sz, group, block, got, _module=kernel), want)  # fmt: skip
    if block in kernel.int4_blocks:
        x = torch.randn(6, k).to(dtype)
        y = intpack.int4_linear(x, layout, sz, group, block, _module=kernel)
        weight = intpack.int4_weight(codes, sz, group)
        assert intpack.close(y, x, weight, None, digits=intpack.takes_digits(kernel))


@pytest.mark.parametrize(("n", "k", "group"), [(576, 576, 32), (1536, 576, 64), (128, 256, 64)])
def test_float16_scales_give_float32_rows_the_float32_scales_numbers(kernel, n, k, group):
    """Scales and zeros held in float16 (``Int4Weight.narrowed``: a GGUF's f16 scales in
    float32 compute) widen exactly: products and unpacking equal those of the same values
    held in float32, bit for bit, on every row count."""
    block = block_of(n)
    codes, pk, sz16 = intpack.int4_probe(n, k, group, torch.float16, seed=n)
    sz32 = sz16.float()
    gen = torch.Generator().manual_seed(k)
    for rows in (1, 2, 3, 9):
        x = torch.randn(rows, k, generator=gen)
        want = intpack.int4_linear(x, pk, sz32, group, block, _module=kernel)
        assert torch.equal(intpack.int4_linear(x, pk, sz16, group, block, _module=kernel), want)
    for out_dtype in DTYPES:
        want = torch.empty(n, k, dtype=out_dtype)
        intpack.int4_dequantize(pk, sz32, group, block, want, _module=kernel)
        got = torch.empty(n, k, dtype=out_dtype)
        assert torch.equal(intpack.int4_dequantize(pk, sz16, group, block, got, _module=kernel), want)  # fmt: skip


def test_a_weight_narrows_its_scales_only_where_float16_holds_them():
    from meshnet_node.lowbit.packed import Int4Weight, stacked

    codes, pk, sz16 = intpack.int4_probe(128, 64, 32, torch.float16, seed=3)
    exact = Int4Weight(pk, sz16.float(), 32, (128, 64))
    assert exact.narrowed().scale_zero.dtype is torch.float16
    assert torch.equal(exact.narrowed().scale_zero.float(), exact.scale_zero)
    inexact = Int4Weight(pk, exact.scale_zero + 1e-6, 32, (128, 64))  # not float16 values
    assert inexact.narrowed() is inexact
    bf16 = Int4Weight(pk, sz16.bfloat16(), 32, (128, 64))
    assert bf16.narrowed() is bf16  # only float32 compute narrows
    both = stacked([exact.narrowed(), inexact])  # parts of one fused product
    assert both is not None and both.scale_zero.dtype is torch.float32
    assert torch.equal(both.scale_zero[:, :128], exact.scale_zero)

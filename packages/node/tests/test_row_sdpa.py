"""A batched step's rows through torch's SDPA from C++ (ADR-0051): each row's bits are those
of transformers' own per-row call, whatever the dtype, grouping, mask, lengths and rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from meshnet_node.kernels import packed, row_sdpa


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    packed.start()
    if packed.wait() is None:
        pytest.skip(f"the kernel module is not available here: {packed.unavailable_reason()}")


def _module(heads: int, kv_heads: int) -> nn.Module:
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    return module


def _rows(dtype, heads, kv_heads, d, lengths, mask_kind, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(len(lengths), heads, 1, d, generator=gen) * 2).to(dtype)
    kv = [(torch.randn(1, kv_heads, n, d, generator=gen).to(dtype),
           torch.randn(1, kv_heads, n, d, generator=gen).to(dtype)) for n in lengths]  # fmt: skip
    masks = []
    for n in lengths:
        if mask_kind is None:
            masks.append(None)
            continue
        seen = torch.rand(1, 1, 1, n, generator=gen) > 0.3
        seen[..., -1] = True  # its own position
        masks.append(seen if mask_kind == "bool" else
                     torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min))  # fmt: skip
    return q, kv, masks


def _per_row(module, q, kv, masks, **kwargs):
    return torch.cat([sdpa_attention_forward(module, q[b : b + 1], k, v, m, **kwargs)[0]
                      for b, ((k, v), m) in enumerate(zip(kv, masks, strict=True))])  # fmt: skip


def _on_one_thread(function, *args, **kwargs):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return function(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 8, 64), (32, 8, 128), (4, 1, 256)], ids=str)
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_rows_equal_transformers_per_row_calls_bit_for_bit(dtype, shape, mask_kind):
    """Where the C++ rows serve a kind of call, each row has the bits of transformers' own
    call. A kind is refused (the per-row calls run) only where torch's float32 SDPA gives
    one row other bits on one thread than on the team (its float16 multiplies in float32):
    float32 and float16 on an AMD EPYC Zen 4 (MKL's kernels), never bfloat16."""
    heads, kv_heads, d = shape
    module = _module(heads, kv_heads)
    for rows in (1, 2, 5, 16):
        lengths = [1 + (37 * i + rows) % 700 for i in range(rows)]
        q, kv, masks = _rows(dtype, heads, kv_heads, d, lengths, mask_kind, seed=rows)
        kwargs = {"dropout": 0.0, "scaling": d**-0.5}
        got = row_sdpa.attend(module, sdpa_attention_forward, q, kv, masks, kwargs)
        want = _per_row(module, q, kv, masks, **kwargs)
        if got is None:
            assert dtype != torch.bfloat16, "the C++ rows must serve transformers' bf16 SDPA"
            assert _thread_bound(module, torch.float32, shape, mask_kind)
            continue
        assert torch.equal(got, want)


def _thread_bound(module, dtype, shape, mask_kind) -> bool:
    """Whether one row's SDPA on one thread differs from the team's for some length the
    probes try (what refuses a kind: ``row_sdpa._probe``)."""
    heads, kv_heads, d = shape
    for n in (1, 2, 31, 64, 65, 127, 300, 513, 1030):
        q, kv, masks = _rows(dtype, heads, kv_heads, d, [n], mask_kind, seed=n)
        team = _per_row(module, q, kv, masks, dropout=0.0, scaling=d**-0.5)
        if not torch.equal(_on_one_thread(_per_row, module, q, kv, masks, dropout=0.0, scaling=d**-0.5), team):  # fmt: skip
            return True
    return False


def test_other_calls_keep_the_per_row_path():
    module = _module(9, 3)
    q, kv, masks = _rows(torch.bfloat16, 9, 3, 64, [5, 9], None)

    def eager(*args, **kwargs):  # any other attention function
        return sdpa_attention_forward(*args, **kwargs)

    assert row_sdpa.attend(module, eager, q, kv, masks, {"scaling": 0.125}) is None
    for kwargs in ({"softcap": 30.0}, {"s_aux": torch.zeros(9)}, {"dropout": 0.1}):
        assert row_sdpa.attend(module, sdpa_attention_forward, q, kv, masks, kwargs) is None
    mixed = [None, torch.ones(1, 1, 1, 9, dtype=torch.bool)]  # rows that SDPA takes apart
    assert row_sdpa.attend(module, sdpa_attention_forward, q, kv, mixed, {}) is None

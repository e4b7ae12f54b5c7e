"""Row groups (ADR-0038): every row of a stage's product is that row's one-row product, bit
for bit, whatever the row count and the other rows, at real shapes and with the node's
threads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.kernels import row_stable
from meshnet_node.kernels.row_stable import (
    RowGroups,
    TokensAlone,
    find_limit,
    grouped,
    route_rows,
)

# SmolLM2-135M's products: q/k/v fused, o, gate/up fused, down, the tied LM head.
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def _one_row_each(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` (rows, in) as a one-token step of the unsplit model calls it."""
    return torch.cat([nn.functional.linear(x[None, i : i + 1], linear.weight, linear.bias)[0]
                      for i in range(x.shape[0])])  # fmt: skip


def test_a_product_that_changes_with_the_row_count_is_cut_below_the_change():
    # A stand-in for a library kernel that switches (and sums otherwise) from 4 rows on.
    def switching(x, weight, bias):  # x: (1, rows, in)
        out = torch.cat([nn.functional.linear(x[:, i : i + 1], weight, bias)
                         for i in range(x.shape[1])], dim=1)  # fmt: skip
        return out + 1e-3 if x.shape[1] >= 4 else out

    linear = nn.Linear(64, 16, dtype=torch.float32)
    assert find_limit(linear.weight, linear.bias, [linear], fn=switching) == 3
    x = torch.randn(11, 64)
    got = grouped(x, linear.weight, linear.bias, 3, switching)
    assert torch.equal(got, _one_row_each(linear, x))


@pytest.mark.parametrize("threads", [1, None])
@pytest.mark.parametrize(("out_features", "in_features"), SMOLLM2_SHAPES)
def test_every_row_count_gives_each_row_its_one_row_product_at_real_shapes(
    out_features, in_features, threads
):
    torch.manual_seed(out_features + in_features)
    linear = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    linear.requires_grad_(False)
    before = torch.get_num_threads()
    assert route_rows(linear, threads) == 1
    assert isinstance(linear.forward, RowGroups) and linear.forward.limit >= 1
    try:
        torch.set_num_threads(threads or before)
        x = (torch.randn(130, in_features) * torch.exp(2 * torch.randn(130, 1))).bfloat16()
        alone = _one_row_each(linear, x)
        for rows in [*range(1, 34), 64, 100, 127, 128, 130]:  # decode .. a wire chunk
            assert torch.equal(linear(x[:rows]), alone[:rows]), rows
            assert torch.equal(linear(x[-rows:]), alone[-rows:]), rows  # other neighbours
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bias", [False, True])
def test_a_row_alone_is_a_matrix_vector_product_only_where_that_gives_its_bits(monkeypatch, bias):
    """One row (a lone decode step, an LM head) skips the GEMM's set-up where torch's
    matrix-vector product was checked to give the one-token step's bits for the shape; a
    product that differs keeps the GEMM."""
    linear = nn.Linear(576, 960, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    route_rows(linear)
    x = torch.randn(5, 576).bfloat16()
    assert torch.equal(torch.cat([linear(x[i : i + 1]) for i in range(5)]), _one_row_each(linear, x))  # fmt: skip
    used = []
    real = row_stable.gemv
    monkeypatch.setattr(row_stable, "gemv", lambda *a: used.append(1) or real(*a))
    linear(x[:1])
    assert bool(used) == linear.forward.one_row  # the product taken is the one checked

    def off_by_a_bit(row, weight, b):  # a stand-in whose sums differ
        return real(row, weight, b) * (1 + 2**-7)

    monkeypatch.setattr(row_stable, "gemv", off_by_a_bit)
    monkeypatch.setattr(row_stable, "_gemv_ok", {})
    other = nn.Linear(576, 960, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    route_rows(other)
    assert not other.forward.one_row
    assert torch.equal(other(x[:1]), _one_row_each(other, x[:1]))


@pytest.mark.parametrize("mv_faster", [False, True])
def test_an_exact_matrix_vector_product_is_taken_only_where_it_is_faster(
    monkeypatch, caplog, mv_faster
):
    """Where both give the row its bits, the measured time decides which call computes it
    (on an AMD Zen 4 the GEMM is faster at one row, on an AMX Xeon the matrix-vector
    product): either way the row is the same."""
    monkeypatch.setattr(row_stable, "_gemv_ok", {})
    monkeypatch.setattr(
        row_stable, "gemv", lambda row, w, b: row_stable.product(row.view(1, 1, -1), w, b).view(-1)
    )  # the GEMM's own bits: exact by construction
    times = (1e-5, 2e-5) if mv_faster else (2e-5, 1e-5)
    monkeypatch.setattr(row_stable, "faster_of", lambda *a, **k: times)
    linear = nn.Linear(576, 960, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    with caplog.at_level("INFO", logger=row_stable.__name__):
        route_rows(linear)
    assert linear.forward.one_row is mv_faster
    mv_us, gemm_us = (10, 20) if mv_faster else (20, 10)
    assert f"the same bits; {mv_us} us against {gemm_us} us" in caplog.text
    x = torch.randn(3, 576).bfloat16()
    assert torch.equal(linear(x[:1]), _one_row_each(linear, x[:1]))


def test_faster_of_times_both_calls_interleaved():
    order = []
    first, second = row_stable.faster_of(lambda: order.append(1), lambda: order.append(2), 3)
    assert order == [1, 2] * 4  # one untimed call each, then 3 interleaved rounds
    assert 0 <= first < 1 and 0 <= second < 1


def test_a_shapes_limit_is_found_once_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(row_stable, "_limits", {})
    calls = []
    real = row_stable.find_limit
    monkeypatch.setattr(row_stable, "find_limit", lambda *a, **k: calls.append(1) or real(*a, **k))
    layers = nn.Sequential(nn.Linear(64, 32), nn.Linear(64, 32), nn.Linear(32, 64))
    with caplog.at_level("INFO", logger=row_stable.__name__):
        assert route_rows(layers.requires_grad_(False), 1) == 3
    assert len(calls) == 2  # (32 x 64) once, (64 x 32) once
    assert "rows in groups of at most" in caplog.text


def test_a_prompt_chunk_is_one_call_of_all_its_rows_as_the_unsplit_models():
    torch.manual_seed(1)
    linear = nn.Linear(1536, 576, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    plain = nn.Linear(1536, 576, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    plain.weight.copy_(linear.weight)
    route_rows(linear)
    linear.forward.limit = 1  # as on a CPU whose products change from two rows on
    x = torch.randn(1, 100, 1536).bfloat16()
    with row_stable.prompt_rows(128):
        assert row_stable.in_prompt() == 128
        assert torch.equal(linear(x), plain(x))  # torch's call of 100 rows, as HF's prefill
        # a pass that merged two chunks (128 rows, then 60): each chunk its own call
        full = torch.randn(1, 128, 1536).bfloat16()
        part = x[0, :60].clone().unsqueeze(0)  # a plain layout, as a chunk arrives
        merged = torch.cat([full, part], dim=1)
        assert torch.equal(linear(merged), torch.cat([plain(full), plain(part)], dim=1))
    assert not row_stable.in_prompt()
    assert torch.equal(linear(x)[0], _one_row_each(plain, x[0]))


def test_gpt2_conv1d_computes_a_token_at_a_time_outside_prompts(tiny_snapshot):
    """GPT-2's ``Conv1D`` is an ``addmm`` on the tokens it holds: routed like MoE blocks."""
    stage = Stage(load_shard(tiny_snapshot("gpt2"), LayerRange(0, 6), Precision.BFLOAT16))
    convs = [m for m in stage.shard.modules.modules() if type(m).__name__ == "Conv1D"]
    assert convs and all(isinstance(m.forward, TokensAlone) for m in convs)

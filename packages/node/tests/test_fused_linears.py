"""Sibling projections fused into one product (ADR-0037) give the unfused stage's numbers,
bit for bit, in every family, and cost no memory; a shape whose fused product differs stays
apart."""

from __future__ import annotations

import threading

import pytest
import torch
from baselines import split_greedy
from torch import nn

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.tiny import snapshots as tiny
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.kernels import fused_linears, row_stable
from meshnet_node.kernels.fused_linears import FusedGroup, FusedPart, fuse_siblings
from meshnet_node.lowbit.modules import PackedLinear
from meshnet_node.lowbit.packed import Int4Weight, Int8Weight, prompt_calls

FAMILIES = list(tiny.FAMILIES)


def _stages(snapshot, precision: Precision, fuse: bool) -> list[Stage]:
    return [
        Stage(load_shard(snapshot, LayerRange(a, b), precision, fuse=fuse))
        for a, b in ((0, 2), (2, 4), (4, 6))
    ]


def _parts(stages: list[Stage]) -> int:
    return sum(isinstance(m, FusedPart) for s in stages for m in s.shard.modules.modules())


def _weight_bytes(stages: list[Stage]) -> int:
    return sum(s.shard.parameter_bytes() for s in stages)  # packed weights are buffers


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", [Precision.BFLOAT16, Precision.FLOAT32, Precision.INT4])
def test_fused_stages_give_the_unfused_numbers_bit_for_bit(tiny_snapshot, family, precision):
    snapshot = tiny_snapshot(family)
    prompt = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    plain, fused = _stages(snapshot, precision, False), _stages(snapshot, precision, True)
    assert _parts(plain) == 0
    assert _weight_bytes(fused) == _weight_bytes(plain)  # views, not copies
    want_tokens, want_logits = split_greedy(plain, prompt, 8)  # a chunked prompt, then decode
    tokens, logits = split_greedy(fused, prompt, 8)
    assert tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))


def test_llama_fuses_qkv_and_gate_up_of_every_layer_where_the_check_allows(tiny_snapshot):
    stage = Stage(load_shard(tiny_snapshot("llama"), LayerRange(0, 6), Precision.BFLOAT16))
    for layer in stage.shard.modules.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert type(attn.o_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear
        for module, names in (
            (attn, ("q_proj", "k_proj", "v_proj")),
            (mlp, ("gate_proj", "up_proj")),
        ):
            fused = getattr(module, "fused_" + "_".join(names), None)
            members = [getattr(module, n) for n in names]
            if fused is None:  # the check found a row whose fused product differs (the log says)
                assert all(type(m) is nn.Linear for m in members)
                continue
            assert all(type(m) is FusedPart for m in members) and fused.row_limit >= 1
            # the members' weights are views of the fused weight: the same storage
            ptr = members[1].weight.untyped_storage().data_ptr()
            assert ptr == fused.weight.untyped_storage().data_ptr()


def test_smollm2_shapes_fuse_here():
    # The real shapes the determinism test runs: q/k/v and gate/up of SmolLM2 fuse on this
    # machine (bf16, the default threads), with a row limit of at least one.
    for sizes in ((576, 192, 192), (1536, 1536)):
        layer = nn.Module()
        names = ("q_proj", "k_proj", "v_proj") if len(sizes) == 3 else ("gate_proj", "up_proj")
        for name, n in zip(names, sizes, strict=True):
            setattr(layer, name, nn.Linear(576, n, bias=False, dtype=torch.bfloat16))
        assert fuse_siblings([layer.requires_grad_(False)]) == 1


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_siblings_fuse_into_one_product_bit_for_bit(fmt, dtype):
    """SmolLM2's q/k/v and gate/up at int4 / int8 (a GGUF's runtime): one stacked product
    for decode rows, each member's own product in a prompt chunk, the same bytes held."""
    gen = torch.Generator().manual_seed(5)
    for sizes in ((576, 192, 192), (1536, 1536)):
        layer = nn.Module()
        names = ("q_proj", "k_proj", "v_proj") if len(sizes) == 3 else ("gate_proj", "up_proj")
        members = []
        for name, n in zip(names, sizes, strict=True):
            w = torch.randn(n, 576, generator=gen) * 0.05
            packed = Int4Weight.quantize(w, 32, dtype) if fmt == "int4" else Int8Weight.quantize(w, dtype)  # fmt: skip
            members.append(PackedLinear(packed, None))
            setattr(layer, name, members[-1])
        held = sum(b.numel() * b.element_size() for b in layer.buffers())
        assert fuse_siblings([layer]) == 1
        assert sum(b.numel() * b.element_size() for b in layer.buffers()) == held
        parts = [getattr(layer, name) for name in names]
        assert all(type(p) is FusedPart for p in parts)
        with torch.no_grad():  # no inference tensors: the per-thread scratch outlives the test
            for rows in (1, 2, 7):  # decode: a session, batches
                x = torch.randn(rows, 576, generator=gen).to(dtype)
                assert all(torch.equal(p(x), m(x)) for p, m in zip(parts, members, strict=True))
            x = torch.randn(1, 200, 576, generator=gen).to(dtype)  # a prompt chunk
            with prompt_calls(128):
                got = [p(x) for p in parts]
            with prompt_calls(128):
                want = [m(x) for m in members]
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_shape_whose_fused_product_differs_stays_apart(monkeypatch, caplog):
    monkeypatch.setattr(fused_linears, "row_limit", lambda *a, **k: 0)
    monkeypatch.setattr(fused_linears, "_apart", set())  # said once per shape: not yet
    layer = nn.Module()
    layer.q_proj, layer.k_proj, layer.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
    with caplog.at_level("INFO", logger=fused_linears.__name__):
        assert fuse_siblings([layer]) == 0
    assert type(layer.q_proj) is nn.Linear and "stay apart" in caplog.text


def test_fused_rows_equal_the_members_one_row_products_for_common_shapes_here():
    # The check itself: SmolLM2's q/k/v and a tiny float32 one with biases fuse on this
    # machine, with a row limit of at least one (a machine where the one-row product already
    # differs keeps the projections apart: the test above).
    for sizes, width, dtype, bias in (((576, 192, 192), 576, torch.bfloat16, False),
                                      ((64, 32, 32), 64, torch.float32, True)):  # fmt: skip
        parts = [nn.Linear(width, n, bias=bias, dtype=dtype) for n in sizes]
        fused = fused_linears._stacked(parts)
        for threads in (None, 1):
            assert row_stable.find_limit(fused.weight, fused.bias, parts, threads) >= 1
    # and none for one that is not the parts stacked
    parts = [nn.Linear(64, 32), nn.Linear(64, 32)]
    other = nn.Linear(64, 64)
    assert row_stable.find_limit(other.weight, other.bias, parts) == 0


def test_a_member_given_another_input_computes_it_and_threads_keep_their_own():
    torch.manual_seed(0)
    q, k = nn.Linear(64, 64), nn.Linear(64, 32)
    layer = nn.Module()
    layer.q_proj, layer.k_proj, layer.v_proj = q, k, nn.Linear(64, 32)
    assert fuse_siblings([layer]) == 1
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(layer.q_proj(x), q(x))
        assert torch.equal(layer.k_proj(y), k(y))  # not x: computed for y
        assert torch.equal(layer.k_proj(x), k(x))
        got: dict[str, torch.Tensor] = {}

        def other_thread() -> None:
            got["k"] = layer.k_proj(x)  # nothing kept on this thread: computed afresh

        layer.q_proj(y)
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert torch.equal(got["k"], k(x)) and torch.equal(layer.k_proj(y), k(y))
    assert isinstance(layer.k_proj.group, FusedGroup)

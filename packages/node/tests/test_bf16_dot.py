"""The bf16 product kernel (ADR-0030): torch's numbers bit for bit, several rows at a time."""

from __future__ import annotations

import shutil
import types

import pytest
import torch
from baselines import hf_chunked_greedy, load_reference_model, split_greedy
from torch import nn

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.tiny import snapshots as tiny
from meshnet_node.engine.bf16_upcast import widened_linear
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.kernels import bf16_dot

pytestmark = pytest.mark.skipif(
    not bf16_dot.applies("cpu"), reason="torch multiplies bf16 with its own fast kernels here"
)


@pytest.fixture(scope="module")
def kernel() -> types.ModuleType:
    if shutil.which("g++") is None or shutil.which("ninja") is None:
        pytest.skip("no g++ or ninja to build the kernel with: torch's product is used")
    bf16_dot.start("cpu")
    module = bf16_dot.wait(timeout=600)
    assert module is not None, bf16_dot.unavailable_reason()
    return module


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(1, 64), (2, 128), (50, 576), (97, 1536), (31, 2048)])
def test_equals_torchs_product_for_any_rows(kernel, rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (0.05 * torch.randn(n, k, generator=gen)).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    for b in (None, bias):
        assert torch.equal(kernel.linear(x, w, b), nn.functional.linear(x, w, b))


@pytest.mark.parametrize("rows", [1, 4, 6])
def test_equals_torch_where_the_order_of_every_addition_shows(kernel, rows):
    """On the probe inputs a small term survives or vanishes depending on when the big ones
    cancel: any other summation order changes many outputs (next test)."""
    x, w, bias = bf16_dot.probe(rows, 576, 200, seed=rows)
    assert torch.equal(kernel.linear(x, w, bias), nn.functional.linear(x, w, bias))


def test_the_check_catches_a_kernel_that_sums_in_another_order():
    """float32 GEMM (what --widen-bf16 uses) has the same inputs and another order."""
    other = types.SimpleNamespace(linear=lambda x, w, b: widened_linear(x, w, b))
    differs = bf16_dot.agrees_with_torch(other)
    assert differs is not None and "outputs differ" in differs


def test_rows_batched_equal_rows_alone(kernel):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 576, generator=gen).bfloat16()
    w = (0.05 * torch.randn(300, 576, generator=gen)).bfloat16()
    together = kernel.linear(x, w, None)
    alone = torch.cat([kernel.linear(x[i : i + 1], w, None) for i in range(16)])
    assert torch.equal(together, alone)


def test_calls_it_does_not_take_stay_torchs(kernel):
    w = torch.randn(8, 100).bfloat16()  # inner dimension not a multiple of 64
    x = torch.randn(3, 100).bfloat16()
    assert not bf16_dot.usable(x, w)
    assert torch.equal(bf16_dot.linear(x, w, None), nn.functional.linear(x, w))
    w32 = torch.randn(8, 128)
    assert not bf16_dot.usable(torch.randn(2, 128), w32)
    x3 = torch.randn(2, 5, 128).bfloat16()  # leading dimensions are kept
    w16 = torch.randn(8, 128).bfloat16()
    assert torch.equal(bf16_dot.linear(x3, w16, None), nn.functional.linear(x3, w16))


@pytest.mark.parametrize("family", [f for f in tiny.FAMILIES if f not in tiny.MOE_FAMILIES])
def test_a_split_with_the_kernel_has_torchs_logits_bit_for_bit(kernel, tiny_snapshot, family):
    """Three bf16 stages whose linears run on the kernel against the same stages on torch's
    product, and the unsplit model: the same tokens, and logits equal to torch's stages'."""
    snapshot = tiny_snapshot(family)
    model = load_reference_model(snapshot, torch.bfloat16)
    n = model.config.num_hidden_layers
    bounds = [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)]
    prompt = torch.randint(3, min(model.config.vocab_size, 200), (150,)).tolist()
    ref_tokens, _ = hf_chunked_greedy(model, prompt, 8)

    def stages(use_kernel: bool) -> list[Stage]:
        return [
            Stage(
                load_shard(snapshot, LayerRange(s, e), Precision.BFLOAT16, bf16_kernel=use_kernel)
            )
            for s, e in bounds
        ]

    fast, plain = stages(True), stages(False)
    routed = [m for s in fast for m in s.shard.modules.modules() if "forward" in vars(m)]
    assert routed, "no linear went through the kernel"
    tokens, logits = split_greedy(fast, prompt, 8)
    plain_tokens, plain_logits = split_greedy(plain, prompt, 8)
    assert tokens == plain_tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, plain_logits, strict=True))


def test_a_kernel_that_does_not_build_leaves_torchs_product(monkeypatch, tmp_path, caplog):
    def no_compiler(path):
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(bf16_dot, "_build", no_compiler)
    for key in ("module", "reason"):
        monkeypatch.setitem(bf16_dot._state, key, None)
    bf16_dot._load(tmp_path / "k" / "k.so")
    assert bf16_dot.kernel() is None
    assert "g++: command not found" in bf16_dot.unavailable_reason()
    assert "stay torch's own" in caplog.text
    x, w = torch.randn(4, 128).bfloat16(), torch.randn(8, 128).bfloat16()
    assert torch.equal(bf16_dot.linear(x, w, None), nn.functional.linear(x, w))

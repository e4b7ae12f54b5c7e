"""A session's KV cache grows in place (ADR-0052): the same keys and values as transformers'
concatenating layer, a copy of the whole only every GROW positions, attention on its views
bit for bit, and room given back when a crop leaves much of it empty."""

from __future__ import annotations

import pytest
import torch
from baselines import split_greedy
from stage_drivers import hidden_steps
from transformers import DynamicCache, LlamaConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.engine import growing_cache, sessions
from meshnet_node.engine.growing_cache import FROM, GROW, GrowingLayer, session_cache, update_rows
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.kernels import packed


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 3, n, 64, generator=gen).to(torch.bfloat16),
            torch.randn(1, 3, n, 64, generator=gen).to(torch.bfloat16))  # fmt: skip


def test_steps_and_chunks_hold_what_transformers_layer_holds():
    grown, plain = GrowingLayer(), DynamicLayer()
    buffers = set()
    for seed, n in enumerate([37, 1, 1, 128, *[1] * 300, 5]):
        k, v = _rows(n, seed)
        got, want = grown.update(k, v), plain.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        if grown.keys.shape[-2] >= FROM:
            buffers.add(grown.keys.data_ptr())
    assert grown._key_buffer is not None and not grown.keys.is_contiguous()
    assert len(buffers) <= 1 + (37 + 128 + 300 + 5 + 2 - FROM) // GROW  # a copy every GROW


def test_attention_reads_the_views_with_the_contiguous_bits():
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    layer = GrowingLayer()
    for seed, n in enumerate([300, 1, 1, 29]):
        k, v = layer.update(*_rows(n, seed))
        assert seed == 0 or not k.is_contiguous()  # views of the buffer from the second on
        for rows in (1, n):
            q = torch.randn(1, 9, rows, 64).to(torch.bfloat16)
            mask = None if rows == 1 else torch.ones(1, 1, rows, k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - rows)  # fmt: skip
            got = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.125)[0]
            want = sdpa_attention_forward(module, q, k.contiguous(), v.contiguous(), mask,
                                          dropout=0.0, scaling=0.125)[0]  # fmt: skip
            assert torch.equal(got, want)


def test_a_crop_then_new_rows_overwrite_the_dropped_ones():
    grown, plain = GrowingLayer(), DynamicLayer()
    for layer in (grown, plain):
        layer.update(*_rows(300, 0))
        layer.crop(-7)  # drafts the tail refused
        layer.update(*_rows(3, 1))
    assert grown._key_buffer is not None  # the same buffer: the dropped rows overwritten
    assert grown.keys.shape[-2] == 296 and torch.equal(grown.keys, plain.keys)
    assert torch.equal(grown.values, plain.values)


def test_a_deep_crop_gives_the_room_back():
    layer = GrowingLayer()
    layer.update(*_rows(999, 0))
    layer.update(*_rows(1, 2))  # now in a buffer with room
    assert layer._key_buffer is not None
    layer.crop(-(1000 - 128))  # a finished session cut back to one cached block
    assert layer._key_buffer is None and layer.keys.shape[-2] == 128
    assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * 2
    layer.update(*_rows(1, 1))  # short again: concatenated, as transformers does
    assert layer.keys.shape[-2] == 129 and layer._key_buffer is None


def test_sliding_layers_stay_transformers_own():
    config = LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)  # fmt: skip
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    config.sliding_window = 16
    kinds = [type(layer) for layer in session_cache(config).layers]
    assert kinds == [DynamicSlidingWindowLayer, GrowingLayer] * 2


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2"])
@pytest.mark.parametrize("precision", [Precision.BFLOAT16, Precision.FLOAT32], ids=str)
def test_a_long_split_run_has_the_bits_of_transformers_cache(tiny_snapshot, family, precision, monkeypatch):  # fmt: skip
    """Three stages, a 300-token prompt in wire chunks and 24 greedy steps: past FROM the
    full-attention layers grow in place; every logit equals the run on transformers' own
    concatenating cache, bit for bit (sliding layers are transformers' either way)."""
    snapshot = tiny_snapshot(family)
    prompt = torch.randint(3, 200, (300,), generator=torch.Generator().manual_seed(1)).tolist()

    def run() -> tuple[list[int], list[torch.Tensor]]:
        stages = [Stage(load_shard(snapshot, LayerRange(a, b), precision))
                  for a, b in ((0, 2), (2, 4), (4, 6))]  # fmt: skip
        return split_greedy(stages, prompt, 24)

    grown = run()
    monkeypatch.setattr(sessions, "session_cache", lambda config: DynamicCache(config=config))
    plain = run()
    assert grown[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(grown[1], plain[1], strict=True))


@pytest.fixture
def kernel():
    packed.start()
    if packed.wait() is None:
        pytest.skip(f"the kernel module is not available here: {packed.unavailable_reason()}")


def _config() -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                       hidden_size=576, head_dim=64)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rows_appended_at_once_hold_what_each_update_holds(kernel, monkeypatch, dtype):
    """A batched step's rows go into their layers' buffers in one call: the same keys and
    values as transformers' layer, whatever each row's length; a buffer is written in
    place while it has room and replaced, held positions copied, when full."""
    monkeypatch.setattr(growing_cache, "GROW", 3)  # buffers fill within the steps
    lengths = [1, 5, 40, FROM + 10]
    caches = [session_cache(_config()) for _ in lengths]
    plain = [DynamicLayer() for _ in lengths]
    for seed, (cache, reference, n) in enumerate(zip(caches, plain, lengths, strict=True)):
        k, v = (t.to(dtype) for t in _rows(n, seed))
        cache.update(k, v, 1)
        reference.update(k, v)
    gen = torch.Generator().manual_seed(7)
    replaced = 0
    for _ in range(8):
        # as a program's projections give them: (B, 1, heads, D) seen as (B, heads, 1, D)
        k, v = (torch.randn(len(lengths), 1, 3, 64, generator=gen).to(dtype).transpose(1, 2)
                for _ in range(2))  # fmt: skip
        before = [c.layers[1]._key_buffer for c in caches]
        got = update_rows(caches, k, v, 1)
        for b, (cache, reference) in enumerate(zip(caches, plain, strict=True)):
            want = reference.update(k[b : b + 1], v[b : b + 1])
            layer = cache.layers[1]
            assert all(torch.equal(x, y) for x, y in zip(got[b], want, strict=True))
            assert layer.keys is got[b][0] and layer.values is got[b][1]
            assert layer.keys.data_ptr() == layer._key_buffer.data_ptr()
            room = layer._key_buffer.shape[-2] - layer.keys.shape[-2]
            assert room <= min(3, layer.keys.shape[-2])  # GROW, or as many as it holds
            if before[b] is not None and layer._key_buffer is not before[b]:
                replaced += 1
                assert layer.keys.shape[-2] - 1 == before[b].shape[-2]  # only when full
    assert replaced >= len(lengths)  # every row's buffer filled up at least once
    k, v = _rows(1, 9)  # one session's own step after batched ones: in place
    caches[0].update(k.to(dtype), v.to(dtype), 1)
    assert torch.equal(caches[0].layers[1].keys, plain[0].update(k.to(dtype), v.to(dtype))[0])


def test_rows_of_other_caches_are_each_their_own_update(kernel):
    """A row whose layer is not a held GrowingLayer (a sliding window, a fresh layer):
    every row takes transformers' own update, with the same results."""
    caches = [session_cache(_config()) for _ in range(2)]
    caches[1].layers[1] = DynamicSlidingWindowLayer(sliding_window=4)
    plain = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4)]
    for cache, reference in zip(caches, plain, strict=True):
        cache.update(*_rows(6, 0), 1)
        reference.update(*_rows(6, 0))
    k, v = (torch.randn(2, 3, 1, 64).to(torch.bfloat16) for _ in range(2))
    got = update_rows(caches, k, v, 1)
    for b, reference in enumerate(plain):
        assert all(torch.equal(x, y) for x, y in zip(got[b], reference.update(k[b : b + 1], v[b : b + 1]), strict=True))  # fmt: skip
    assert caches[0].layers[1]._key_buffer is None  # the whole batch took the per-row path


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_rows_grow_in_place_with_one_token_steps_bits(tiny_snapshot, family, kernel, monkeypatch):  # fmt: skip
    """A bfloat16 middle stage, sessions short and long: every row of a batched step (its
    cache appended in one call) is the one-token step's output exactly, past buffers
    filling up too (2 positions of room here)."""
    monkeypatch.setattr(growing_cache, "GROW", 2)
    stage = Stage(load_shard(tiny_snapshot(family), LayerRange(2, 4), Precision.BFLOAT16))
    lengths = (3, 60, FROM + 7)
    alone = hidden_steps(stage, batched=False, lengths=lengths, steps=6)
    together = hidden_steps(stage, batched=True, lengths=lengths, steps=6)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))

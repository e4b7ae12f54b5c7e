"""A session's KV cache grows in place (ADR-0052): the same keys and values as transformers'
concatenating layer, a copy of the whole only every GROW positions, attention on its views
bit for bit, and room given back when a crop leaves much of it empty."""

from __future__ import annotations

import pytest
import torch
from baselines import split_greedy
from transformers import DynamicCache, LlamaConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.engine import sessions
from meshnet_node.engine.growing_cache import FROM, GROW, GrowingLayer, session_cache
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage


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

"""A batched decode step's attention (``engine/row_attention.py``): per row, its projections
computed for all rows at once; the same outputs as row by row, every row run once."""

from __future__ import annotations

import torch
from torch import nn

from meshnet_node.engine.row_attention import RowAttention


class ToyAttention(nn.Module):
    """Projections around a per-row step with a side effect (a cache that grows)."""

    def __init__(self, width: int = 8, *, norm_first: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.o_proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width) if norm_first else None
        self.seen: list[int] = []  # rows run, in order (the "cache")

    def forward(self, hidden, b):
        self.seen.append(b)
        x = self.norm(hidden) if self.norm is not None else hidden
        q, k = self.q_proj(x), self.k_proj(x).tanh()
        return self.o_proj(q * k + b), None


def row_by_row(module, hidden):
    return torch.cat([module(hidden[b : b + 1], b)[0] for b in range(hidden.shape[0])])


def call(module, row, b):
    return module(row, b)[0]


def test_projections_are_batched_and_each_row_runs_once():
    attend = RowAttention()
    module = ToyAttention()
    hidden = torch.randn(5, 1, 8)
    want = row_by_row(module, hidden)
    module.seen.clear()
    for _ in range(2):  # learning the plan (first call), then using it
        got = attend(module, hidden, call)
        torch.testing.assert_close(got, want)
        assert module.seen == [0, 1, 2, 3, 4]
        module.seen.clear()
    plan = attend._plans[module]
    assert plan.inputs == ("q_proj", "k_proj") and plan.output == "o_proj"
    assert isinstance(module.q_proj, nn.Linear) and isinstance(module.o_proj, nn.Linear)


def test_a_projection_that_does_not_read_the_row_runs_as_written():
    attend = RowAttention()
    module = ToyAttention(norm_first=True)  # the projections read the normed row
    hidden = torch.randn(3, 1, 8)
    want = row_by_row(module, hidden)
    module.seen.clear()
    for _ in range(2):
        torch.testing.assert_close(attend(module, hidden, call), want)
    assert attend._plans[module].inputs == ()


def test_one_row():
    attend = RowAttention()
    module = ToyAttention()
    hidden = torch.randn(1, 1, 8)
    want = row_by_row(module, hidden)
    for _ in range(2):
        torch.testing.assert_close(attend(module, hidden, call), want)


# ``attend_together`` (ADR-0028) on transformers' own LlamaAttention.


def _llama_attention(seed: int = 0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, num_hidden_layers=1)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaAttention(config, layer_idx=0).to(torch.bfloat16).eval(), LlamaRotaryEmbedding(
        config
    )


def _caches(lengths, width=64):
    """A DynamicCache per session, filled by running ``n`` random tokens through a fresh
    attention module of the same seed (so keys and values are real ones)."""
    from transformers import DynamicCache

    attn, rotary = _llama_attention()
    gen = torch.Generator().manual_seed(5)
    caches = []
    for n in lengths:
        cache = DynamicCache()
        x = torch.randn(1, n, width, generator=gen).to(torch.bfloat16)
        pos = torch.arange(n)[None]
        attn(x, rotary(x, pos), None, cache=cache)  # causal prompt: is_causal, no mask
        caches.append(cache)
    return caches


def _one_by_one(attn, rotary, hidden, lengths, caches):
    outs = []
    for b, n in enumerate(lengths):
        row, pos = hidden[b : b + 1], torch.tensor([[n]])
        outs.append(attn(row, rotary(row, pos), None, cache=caches[b])[0])
    return torch.cat(outs)


def _together_call(attn, rotary, hidden, lengths, caches):
    from meshnet_node.engine.row_attention import attend_together

    pos = torch.tensor([[n] for n in lengths])
    parts = [rotary(hidden[b : b + 1], pos[b : b + 1]) for b in range(len(lengths))]
    rot = (torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts]))
    return attend_together(
        attn, caches, [None] * len(lengths),
        lambda cache: attn(hidden, rot, None, cache=cache, position_ids=pos)[0],
    )  # fmt: skip


def test_together_rows_equal_one_token_calls_bit_for_bit():
    from meshnet_node.engine.row_attention import enable_together, together_ok

    lengths = [3, 40, 17]
    hidden = torch.randn(3, 1, 64).to(torch.bfloat16)
    attn, rotary = _llama_attention()
    want = _one_by_one(attn, rotary, hidden, lengths, alone := _caches(lengths))
    assert enable_together(attn)
    assert torch.equal(_one_by_one(attn, rotary, hidden, lengths, _caches(lengths)), want)
    caches = _caches(lengths)
    assert together_ok(attn, caches) and not together_ok(attn, [caches[0], caches[0]])
    assert torch.equal(_together_call(attn, rotary, hidden, lengths, caches), want)
    for got, ref in zip(caches, alone, strict=True):
        assert torch.equal(got.layers[0].keys, ref.layers[0].keys)
        assert torch.equal(got.layers[0].values, ref.layers[0].values)


def test_a_module_that_changes_its_cache_output_goes_row_by_row_untouched():
    """Like DeepSeek's MLA: what the attention reads is not what the cache returned. The
    module is refused before any cache is written, and marked to go row by row."""
    from meshnet_node.engine.row_attention import enable_together

    class Expanding(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden, rot, mask, cache=None, **kwargs):
            class Doubling:  # hands the attention a transformed copy of the cache's output
                def update(self, k, v, idx, *args, **kw):
                    k, v = cache.update(k, v, idx, *args, **kw)
                    return k * 1, v * 1

            return self.inner(hidden, rot, mask, cache=Doubling(), **kwargs)

    lengths = [3, 40]
    hidden = torch.randn(2, 1, 64).to(torch.bfloat16)
    attn, rotary = _llama_attention()
    assert enable_together(attn)
    caches = _caches(lengths)
    before = [c.get_seq_length() for c in caches]
    module = Expanding(attn)
    assert _together_call(module, rotary, hidden, lengths, caches) is None
    assert [c.get_seq_length() for c in caches] == before  # nothing written
    assert module.__dict__["_meshnet_rows_only"] is True


def test_widened_many_rows_attend_in_float32_and_few_rows_as_torch_does():
    """``--widen-bf16`` (ADR-0027): a batched call of at least ``upcast_min_rows`` rows runs
    each row's SDPA in float32 on the bf16 keys and values, within bf16 rounding of the
    one-token calls; fewer rows, and every one-token call, stay torch's bf16 SDPA."""
    from meshnet_node.engine.bf16_upcast import upcast_min_rows
    from meshnet_node.engine.row_attention import enable_together, widen_attention

    attn, rotary = _llama_attention()
    assert enable_together(attn) and widen_attention(attn)
    original = attn.__dict__["_meshnet_attention"]
    seen: list[torch.dtype] = []

    def recording(module, query, key, value, mask, **kwargs):
        seen.append(query.dtype)
        assert key.dtype == value.dtype == query.dtype
        return original(module, query, key, value, mask, **kwargs)

    attn.__dict__["_meshnet_attention"] = recording
    many = [3 + 7 * b for b in range(max(upcast_min_rows(attention=True), 2))]
    hidden = torch.randn(len(many), 1, 64).to(torch.bfloat16)
    want = _one_by_one(attn, rotary, hidden, many, _caches(many))
    assert set(seen) == {torch.bfloat16}  # one-token calls: torch's own
    seen.clear()
    got = _together_call(attn, rotary, hidden, many, _caches(many))
    assert seen == [torch.float32] * len(many) and got.dtype is torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    seen.clear()
    few = many[: upcast_min_rows(attention=True) - 1] or many[:1]
    if len(few) < upcast_min_rows(attention=True):
        _together_call(attn, rotary, hidden[: len(few)], few, _caches(few))
        assert set(seen) == {torch.bfloat16}


def test_only_sdpa_attention_is_widened():
    from meshnet_node.engine.row_attention import enable_together, widen_attention

    attn, _ = _llama_attention()
    assert not widen_attention(attn)  # not set up for batched steps: nothing to widen
    attn.config._attn_implementation = "eager"
    assert enable_together(attn) and not widen_attention(attn)
    assert "_meshnet_widen" not in attn.__dict__

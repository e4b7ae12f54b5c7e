"""Split stages give the same tokens and logits as the unsplit HF model (every family)."""

from __future__ import annotations

import contextvars

import pytest
import torch
from baselines import hf_chunked_greedy, load_reference_model, split_greedy

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_common.tiny import snapshots as tiny
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage

FAMILIES = list(tiny.FAMILIES)
PRECISIONS = [(Precision.FLOAT32, 1e-4), (Precision.BFLOAT16, 2e-2)]
# Expert routing is a top-k over router scores: in bfloat16 a near-tie can pick another expert
# than the unsplit model does (different rounding of the same sums), so MoE families are held
# to float32 exactness; their bfloat16 runs must agree on the first tokens and the prefill's logits.
BF16_EXACT = [f for f in FAMILIES if f not in tiny.MOE_FAMILIES]


def three_stages(snapshot, num_layers: int, precision: Precision) -> list[Stage]:
    a, b = num_layers // 3, 2 * num_layers // 3
    bounds = [(0, a), (a, b), (b, num_layers)]
    return [Stage(load_shard(snapshot, LayerRange(s, e), precision)) for s, e in bounds]


def two_stages(snapshot, num_layers: int, precision: Precision) -> list[Stage]:
    bounds = [(0, num_layers // 2), (num_layers // 2, num_layers)]
    return [Stage(load_shard(snapshot, LayerRange(s, e), precision)) for s, e in bounds]


def prompt_ids(vocab: int, length: int = 300, seed: int = 7) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("precision", "tol"), PRECISIONS, ids=["float32", "bfloat16"])
def test_split_matches_single_process(tiny_snapshot, family, precision, tol):
    """Three stages, a 300-token prompt (chunked prefill, past every sliding window)."""
    snapshot = tiny_snapshot(family)
    model = load_reference_model(snapshot, precision.compute_dtype)
    prompt = prompt_ids(min(model.config.vocab_size, 200))  # > 128 tokens: chunked prefill
    ref_tokens, ref_logits = hf_chunked_greedy(model, prompt, 20)
    stages = three_stages(snapshot, model.config.num_hidden_layers, precision)
    tokens, logits = split_greedy(stages, prompt, 20)
    if precision is Precision.BFLOAT16 and family not in BF16_EXACT:
        assert tokens[:3] == ref_tokens[:3]  # until the first near-tie flips a route
        assert float((logits[0] - ref_logits[0]).abs().max()) <= tol
        return
    assert tokens == ref_tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(ref_logits, logits, strict=True))
    assert worst <= tol


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stages_match_single_process(tiny_snapshot, family):
    snapshot = tiny_snapshot(family)
    model = load_reference_model(snapshot, torch.float32)
    prompt = prompt_ids(min(model.config.vocab_size, 200), length=180, seed=11)
    ref_tokens, ref_logits = hf_chunked_greedy(model, prompt, 12)
    tokens, logits = split_greedy(two_stages(snapshot, 6, Precision.FLOAT32), prompt, 12)
    assert tokens == ref_tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(ref_logits, logits, strict=True))
    assert worst <= 1e-4


def test_qwen2_tiny_has_mixed_sliding_layers(tiny_snapshot):
    stage = three_stages(tiny_snapshot("qwen2"), 6, Precision.FLOAT32)[1]
    assert len(set(stage.shard.adapter.layer_types(stage.shard.config))) == 2


@pytest.mark.parametrize(("precision", "tol"), PRECISIONS, ids=["float32", "bfloat16"])
def test_smollm2_split_matches_chunked_reference(smollm2_snapshot, precision, tol):
    model = load_reference_model(smollm2_snapshot, precision.compute_dtype)
    prompt = prompt_ids(model.config.vocab_size, length=200, seed=3)
    ref_tokens, ref_logits = hf_chunked_greedy(model, prompt, 20)
    stages = three_stages(smollm2_snapshot, 30, precision)
    tokens, logits = split_greedy(stages, prompt, 20)
    assert tokens == ref_tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(ref_logits, logits, strict=True))
    assert worst <= tol


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


def test_smollm2_split_equals_generate(smollm2_snapshot):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_snapshot)
    model = load_reference_model(smollm2_snapshot, torch.float32)
    stages = three_stages(smollm2_snapshot, 30, Precision.FLOAT32)
    for i, text in enumerate(SMOLLM2_PROMPTS):
        ids = tokenizer(text, return_tensors="pt").input_ids
        expected = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16
        )[0, ids.shape[1] :].tolist()
        tokens, _ = split_greedy(
            stages, ids[0].tolist(), 16, session_id=f"p{i}", stop_ids=[tokenizer.eos_token_id]
        )
        assert tokens == expected, text
    paris = split_greedy(stages, tokenizer("The capital of France is").input_ids, 3)[0]
    assert tokenizer.decode(paris).startswith(" Paris")


@pytest.mark.parametrize("length", [128, 700])
def test_smollm2_bf16_prompt_is_the_unsplit_call_bit_for_bit(smollm2_snapshot, length):
    """A prompt is computed as the unsplit model computes it, in one call on every stage
    (ADR-0053; up to ``--prompt-call-tokens``): in bfloat16 at SmolLM2's shapes the last
    position's logits over three stages equal HF's one forward of the prompt bit for bit
    (the tests above feed prompts in wire chunks to both sides)."""
    model = load_reference_model(smollm2_snapshot, torch.bfloat16)
    prompt = prompt_ids(model.config.vocab_size, length=length, seed=5)
    with torch.inference_mode():
        want = model(torch.tensor([prompt]), logits_to_keep=1).logits.reshape(-1)
    stages = [Stage(load_shard(smollm2_snapshot, LayerRange(a, b), Precision.BFLOAT16))
              for a, b in ((0, 10), (10, 20), (20, 30))]  # fmt: skip
    _, logits = split_greedy(stages, prompt, 1, chunk_tokens=length)
    assert torch.equal(logits[0].reshape(-1), want.float())


def test_smollm2_bf16_steps_between_a_prompts_layers_change_no_bits(smollm2_snapshot):
    """A long prompt's pass runs a layer at a time (``Stage.stepping``, ADR-0053) while
    another session's decode steps run between its layers: at SmolLM2's shapes in bfloat16,
    each computes the bits it computes alone."""
    stage = Stage(load_shard(smollm2_snapshot, LayerRange(0, 10), Precision.BFLOAT16))
    vocab = stage.shard.vocab_size
    prompt, other = prompt_ids(vocab, 300, seed=9), prompt_ids(vocab, 20, seed=10)
    tokens = [torch.tensor([[5 + i]]) for i in range(9)]  # one step per yield: 10 layers

    def decode(session: str) -> list[torch.Tensor]:
        return [stage.step(session, 20 + i, token_ids=t).hidden for i, t in enumerate(tokens)]

    for session in ("a", "b"):
        stage.open_session(session)
    want_a = stage.step("a", 0, token_ids=torch.tensor([prompt])).hidden
    stage.step("b", 0, token_ids=torch.tensor([other]))
    want_b = decode("b")

    for session in ("a2", "b2"):
        stage.open_session(session)
    stage.step("b2", 0, token_ids=torch.tensor([other]))
    steps = stage.stepping("a2", 0, token_ids=torch.tensor([prompt]))
    ctx = contextvars.copy_context()  # as the scheduler drives it: its settings its own
    got_b, pieces = [], iter(tokens)
    try:
        while True:
            ctx.run(next, steps)
            got_b.append(stage.step("b2", 20 + len(got_b), token_ids=next(pieces)).hidden)
    except StopIteration as done:
        got_a = done.value.hidden
    assert len(got_b) == 9
    assert torch.equal(got_a, want_a)
    assert all(torch.equal(g, w) for g, w in zip(got_b, want_b, strict=True))


def test_eager_attention_cuts_prompt_calls_to_its_scores_budget(tiny_snapshot, monkeypatch):
    """Eager attention (Gemma 2 here, gpt-oss) holds rows x keys scores per head: a prompt
    call is cut to keep a first call's within ``EAGER_SCORES_BYTES``, whole wire chunks; an
    SDPA family's is not cut, and the cut calls still give the chunked reference's tokens."""
    from meshnet_node.engine import families

    gemma2, llama = tiny_snapshot("gemma2"), tiny_snapshot("llama")
    heads = load_reference_model(gemma2, torch.float32).config.num_attention_heads
    monkeypatch.setattr(families, "EAGER_SCORES_BYTES", 4 * heads * 300 * 300)
    eager = three_stages(gemma2, 6, Precision.FLOAT32)
    assert [s.prompt_call_tokens for s in eager] == [256, 256, 256]
    assert three_stages(llama, 6, Precision.FLOAT32)[0].prompt_call_tokens == 8192
    model = load_reference_model(gemma2, torch.float32)
    prompt = prompt_ids(min(model.config.vocab_size, 200), length=300, seed=13)
    ref_tokens, _ = hf_chunked_greedy(model, prompt, 6, chunk_tokens=256)
    tokens, _ = split_greedy(eager, prompt, 6, chunk_tokens=256)
    assert tokens == ref_tokens

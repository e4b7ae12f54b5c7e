"""The native engine (docs/adr/0044): packed low-bit stages run every pass through C++
layer steps around the kernel module's own attention. A row's numbers are fixed by the
code: the same bits whatever the split, the chunking of a prompt, the rows sharing a batch
or a verification pass, and the thread count; within float tolerance of transformers'
modules, with the same greedy tokens on real prompts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from baselines import split_greedy
from program_runs import batched_run

from meshnet_common.layers import LayerRange
from meshnet_common.models.gguf_import import smollm2_gguf_path
from meshnet_common.precision import Precision
from meshnet_common.tiny.gguf_files import write_gguf
from meshnet_common.tiny.snapshots import make_tiny
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.kernels import intpack, packed

PROMPTS = [[1, 504, 3575, 282, 4649, 314], [1, 504, 1345, 3458, 6707, 359]]
THIRDS = ((0, 10), (10, 20), (20, 30))


@pytest.fixture(scope="module")
def kernels():
    packed.start()
    if packed.wait() is None:
        pytest.skip(f"the kernel module is not available here: {packed.unavailable_reason()}")
    return intpack.module()


@pytest.fixture(scope="module")
def smollm2(kernels):
    """SmolLM2's Q4_1 GGUF as int4 bf16 shards: whole, and in thirds."""
    path = smollm2_gguf_path()

    def shards(bounds):
        return [load_shard(path, LayerRange(a, b), Precision.INT4, dtype=torch.bfloat16) for a, b in bounds]  # fmt: skip

    return shards(((0, 30),)), shards(THIRDS)


def _stages(shards, engine="native"):
    stages = [Stage(s, engine=engine) for s in shards]
    assert all(s.layers.engine == engine for s in stages)
    return stages


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _caches(n_rows, kv_heads=3, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 70, 300][:n_rows]
    keys = [torch.randn(1, kv_heads, n, d, generator=g).to(dtype) for n in lengths]
    values = [torch.randn(1, kv_heads, n, d, generator=g).to(dtype) for n in lengths]
    q = torch.randn(n_rows, kv_heads * 3, 1, d, generator=g).to(dtype)
    return q, keys, values, [max(1, n - 2) for n in lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_sdpas_within_float_tolerance(kernels, dtype):
    q, keys, values, visible = _caches(3, dtype=dtype)
    out = kernels.attend(q, keys, values, visible, 0.125)
    for r in range(3):
        n = visible[r]
        want = F.scaled_dot_product_attention(
            q[r : r + 1].float(), keys[r][:, :, :n].float(), values[r][:, :, :n].float(),
            scale=0.125, enable_gqa=True,
        ).transpose(1, 2).reshape(1, 1, -1)  # fmt: skip
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(out[r : r + 1].float(), want, atol=tolerance, rtol=tolerance)


def test_a_rows_attention_is_the_same_bits_alone_in_a_batch_and_on_any_thread_count(kernels):
    q, keys, values, visible = _caches(3)
    together = kernels.attend(q, keys, values, visible, 0.125)
    alone = [kernels.attend(q[r : r + 1], keys[r : r + 1], values[r : r + 1], visible[r : r + 1], 0.125) for r in range(3)]  # fmt: skip
    assert torch.equal(torch.cat(alone), together)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.attend(q, keys, values, visible, 0.125), together)
    finally:
        torch.set_num_threads(threads)


def test_a_split_gives_the_unsplit_stages_bits_and_transformers_greedy_tokens(smollm2):
    whole, thirds = smollm2
    reference = _stages(whole, "modules")
    float32 = [
        load_shard(smollm2_gguf_path(), LayerRange(0, 30), Precision.INT4, dtype=torch.float32)
    ]
    for prompt in PROMPTS:
        tokens, logits = split_greedy(_stages(whole), prompt, 24)
        split_tokens, split_logits = split_greedy(_stages(thirds), prompt, 24)
        assert split_tokens == tokens and _same(split_logits, logits)
        want_tokens, want_logits = split_greedy(reference, prompt, 24)
        _same_tokens_but_at_ties(tokens, want_tokens, want_logits)
        # within bf16's error of the module path computed in float32 (logits ~20)
        _, exact = split_greedy(_stages(float32, "modules"), prompt, 1)
        assert torch.allclose(logits[0], exact[0], atol=0.5, rtol=0)


def _same_tokens_but_at_ties(tokens, want_tokens, want_logits, margin=0.125):
    """Greedy tokens equal to the reference's, except from a position where the reference's
    two best logits are within ``margin`` (a tie in bf16: ~2 units in the last place at
    SmolLM2's scale) and ours is one of the two; the texts part there."""
    for i, (token, want) in enumerate(zip(tokens, want_tokens, strict=True)):
        if token != want:
            best = torch.topk(want_logits[i].float(), 2)
            assert float(best.values[0] - best.values[1]) <= margin, (i, token, want)
            assert token in best.indices.tolist(), (i, token, want)
            return


def test_a_prompt_gives_the_same_bits_in_any_chunking(smollm2):
    whole, _ = smollm2
    prompt = PROMPTS[0] + PROMPTS[1][1:]
    _, want = split_greedy(_stages(whole), prompt, 4)
    for chunk in (1, 3, 7):
        _, logits = split_greedy(_stages(whole), prompt, 4, chunk_tokens=chunk)
        assert _same(logits, want), chunk


def test_batched_steps_and_drafts_give_each_sessions_own_bits(smollm2):
    _, thirds = smollm2
    stages = _stages(thirds)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][:4]]
    batched = batched_run(stages, prompts, 4)
    for i, prompt in enumerate(prompts):
        _, alone = split_greedy(stages, prompt, 5)
        assert _same(batched[i :: len(prompts)], alone[1:]), i
    # a verification pass: a token and its drafts as rows of one session
    tokens, logits = split_greedy(stages, PROMPTS[0], 4)
    for stage in stages:
        stage.open_session("v")
    out = stages[0].step("v", 0, token_ids=torch.tensor([PROMPTS[0]]))
    for stage in stages[1:]:
        out = stage.step("v", 0, hidden=out.hidden)
    rows = torch.tensor([tokens[:3]])
    out = stages[0].step("v", len(PROMPTS[0]), token_ids=rows, drafts=tuple(tokens[1:3]))
    for stage in stages[1:]:
        out = stage.step("v", len(PROMPTS[0]), hidden=out.hidden, drafts=tuple(tokens[1:3]))
    assert out.token.token_id == tokens[1] and [t.token_id for t in out.more] == tokens[2:4]


def test_a_refused_pass_changes_no_cache(smollm2):
    """The stack reads every layer's cache before its layers run and writes them after:
    a pass refused (one session's rows as two groups) leaves the session as it was."""
    whole, _ = smollm2
    (stage,) = _stages(whole)
    session = stage.open_session("r")
    stage.step("r", 0, token_ids=torch.tensor([PROMPTS[0]]))
    before = [(layer.keys, layer.values) for layer in session.cache.layers]
    rows = torch.zeros(2, 1, stage.shard.config.hidden_size, dtype=torch.bfloat16)
    cos = sin = torch.ones(2, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one group"):
        stage.layers.native(0, rows, cos, sin, [(session.cache, 1), (session.cache, 1)])
    after = [(layer.keys, layer.values) for layer in session.cache.layers]
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(before, after, strict=True))
    assert session.cache.get_seq_length() == len(PROMPTS[0])


def test_the_thread_count_changes_no_bit(smollm2):
    whole, _ = smollm2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, one = split_greedy(_stages(whole), PROMPTS[1], 6)
        torch.set_num_threads(2)
        _, two = split_greedy(_stages(whole), PROMPTS[1], 6)
    finally:
        torch.set_num_threads(threads)
    assert _same(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_final_norm_from_cpp_is_transformers_bit_for_bit(kernels, smollm2, dtype):
    """A native stage's final norm makes LlamaRMSNorm's calls from C++: the same bits."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(3)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=g).to(dtype)
    hidden = (4 * torch.randn(3, 2, 576, generator=g)).to(dtype)
    with torch.inference_mode():
        assert torch.equal(
            kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon), norm(hidden)
        )
    (stage,) = _stages(smollm2[0])
    assert stage.final_norm is not stage.shard.modules.norm
    (module_stage,) = _stages(smollm2[0], engine="program")
    assert module_stage.final_norm is module_stage.shard.modules.norm


def test_only_packed_pre_norm_stages_take_it(tiny_snapshot, kernels):
    for family, precision, engine in (
        ("llama", Precision.INT4, "native"),
        ("qwen2", Precision.INT8, "native"),
        ("llama", Precision.BFLOAT16, "program"),  # transformers' numbers: decode programs
        ("gemma2", Precision.INT4, "program"),  # sandwich norms: not mirrored in C++
        ("mistral", Precision.INT4, "program"),  # a sliding window: not this attention
        ("qwen2", Precision.INT4, "native"),  # layers 0-1 attend in full
    ):
        shard = load_shard(tiny_snapshot(family), LayerRange(0, 2), precision)
        assert Stage(shard).layers.engine == engine, (family, precision)


# whole and split, by family: the tiny Qwen2's layers 3-5 slide (max_window_layers 3), so
# its tail keeps the program engine and only its first three layers are split
BOUNDS = {
    "llama": (((0, 6),), ((0, 2), (2, 4), (4, 6))),
    "qwen2": (((0, 3), (3, 6)), ((0, 1), (1, 3), (3, 6))),
}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("precision", [Precision.INT4, Precision.INT8], ids=lambda p: p.value)
def test_packed_tiny_models_split_as_unsplit_and_near_the_modules(tiny_snapshot, kernels, family, precision):  # fmt: skip
    """A prompt of 150 rows (one chunk of 128, over the 96 rows that keep the GEMM, then 22
    row by row) and 8 tokens; Qwen2's projections carry biases."""
    snapshot = tiny_snapshot(family)
    prompt = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(7)).tolist()

    def stages(bounds, engine="native"):
        out = [Stage(load_shard(snapshot, LayerRange(a, b), precision), engine=engine) for a, b in bounds]  # fmt: skip
        full = [all(t == "full_attention" for t in s.shard.layer_types) for s in out]
        want = [engine if f or engine == "modules" else "program" for f in full]
        assert [s.layers.engine for s in out] == want
        return out

    whole, split = BOUNDS[family]
    tokens, logits = split_greedy(stages(whole), prompt, 8)
    split_tokens, split_logits = split_greedy(stages(split), prompt, 8)
    assert split_tokens == tokens and _same(split_logits, logits)
    _, reference = split_greedy(stages(whole, "modules"), prompt, 1)
    assert torch.allclose(logits[0], reference[0], atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "precision"), [("Q4_K_M", Precision.INT4), ("Q5_K_M", Precision.INT8)])  # fmt: skip
def test_a_k_mixs_kept_products_run_native(tmp_path, kernels, dtype, fmt, precision):
    """A K-quant mix's Q6_K projections, and a Q5_K_M's Q5_K ones (a zero per block), kept
    as ``Q8Weight`` (docs/adr/0049), take the native Q8 product: the same bits as their
    module's forward for any rows; split over three stages the native engine gives the
    unsplit stage's bits, near the modules'."""
    snapshot = make_tiny(tmp_path, "llama", "tiny/llama", layers=4, hidden=256, intermediate=512)
    path = write_gguf(snapshot, tmp_path / f"llama-{fmt}.gguf", fmt)
    shard = load_shard(path, LayerRange(0, 4), precision, dtype=dtype)
    # llama.cpp's Q6_K layers: 2 and 3 of 4
    downs = [shard.modules.layers[i].mlp.down_proj for i in (0, 3)]
    assert [d.packed.fmt for d in downs] == ["int4" if fmt == "Q4_K_M" else "q5_k", "q6_k"]
    gen = torch.Generator().manual_seed(3)
    for down in downs[1:] if fmt == "Q4_K_M" else downs:
        w = down.packed
        product = kernels.Product.q8(w.q, w.d, None, w.z)
        for rows in (1, 3, 130):
            x = torch.randn(rows, 1, down.in_features, generator=gen).to(dtype)
            assert torch.equal(product(x), down(x)), rows
    prompt = list(range(3, 40))

    def stages(bounds, engine="native"):
        made = [Stage(load_shard(path, LayerRange(a, b), precision, dtype=dtype), engine=engine) for a, b in bounds]  # fmt: skip
        assert all(s.layers.engine == engine for s in made)
        return made

    tokens, logits = split_greedy(stages(((0, 4),)), prompt, 6)
    split_tokens, split_logits = split_greedy(stages(((0, 1), (1, 3), (3, 4))), prompt, 6)
    assert split_tokens == tokens and _same(split_logits, logits)
    _, reference = split_greedy(stages(((0, 4),), "modules"), prompt, 1)
    assert torch.allclose(logits[0].float(), reference[0].float(), atol=0.05, rtol=0.02)


def _exp_fixed(x: np.ndarray) -> np.ndarray:
    """attention.cpp's exp_fixed, op for op in float32."""
    f = np.float32
    shift = f(12582912.0)
    n = (x * f(1.44269504088896341) + shift) - shift
    r = (x - n * f(0.693145751953125)) - n * f(1.428606765330187045e-06)
    p = np.full_like(x, f(1.0) / f(720.0))
    for c in (f(1.0) / f(120.0), f(1.0) / f(24.0), f(1.0) / f(6.0), f(0.5), f(1.0), f(1.0)):
        p = p * r + c
    out = (p.view(np.int32) + (n.astype(np.int32) << 23)).view(np.float32)
    return np.where(x < f(-87.0), f(0.0), out)


def _attend_reference(q, keys, values, visible, scaling):
    """The order attention.cpp documents, in numpy float32: 16-lane dot products folded by
    halves, exp_fixed, values summed key by key, the division last."""
    f = np.float32
    rows, heads, _, d = q.shape
    out = np.zeros((rows, heads * d), dtype=np.float32)
    for r in range(rows):
        kv = keys[r].shape[1]
        for h in range(heads):
            g = h // (heads // kv)
            qh = q[r, h, 0].float().numpy()
            k = keys[r][0, g, : visible[r]].float().numpy()
            v = values[r][0, g, : visible[r]].float().numpy()
            lanes = np.zeros((k.shape[0], 16), dtype=np.float32)
            for i in range(0, d, 16):
                lanes = lanes + qh[i : i + 16] * k[:, i : i + 16]
            for width in (8, 4, 2, 1):
                lanes[:, :width] = lanes[:, :width] + lanes[:, width : 2 * width]
            scores = lanes[:, 0] * f(scaling)
            p = _exp_fixed(scores - scores.max())
            acc, total = np.zeros(d, dtype=np.float32), f(0.0)
            for j in range(k.shape[0]):
                acc = acc + p[j] * v[j]
                total = total + p[j]
            out[r, h * d : (h + 1) * d] = acc / total
    return torch.from_numpy(out).unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "kv_heads", "d"), [(2, 2, 32), (3, 3, 64)])
def test_attention_computes_in_the_order_its_code_documents(kernels, dtype, rows, kv_heads, d):
    q, keys, values, visible = _caches(rows, kv_heads=kv_heads, d=d, dtype=dtype, seed=3)
    got = kernels.attend(q, keys, values, visible, 0.17)
    assert torch.equal(got, _attend_reference(q, keys, values, visible, 0.17).to(dtype))

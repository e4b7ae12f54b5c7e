"""GGUF files in each block format, written by our own packing code from tiny random models
(``meshnet_common.tiny.gguf_files``): split over stages = one stage at the same precision (bit for bit, float32),
equal to the HF model holding what the runtime holds (the blocks as they are, or rounded as
``gguf_blocks`` says) within float32 rounding, and close to the HF model built from the
file's dequantized weights within float32 rounding — Q4_0, Q4_1 and Q4_K int4 as they
are, Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 kept in their values, and the Q4_K_M / Q5_K_M mixes
both (docs/adr/0049)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from baselines import split_greedy
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.gguf_index import KEPT_BLOCKS
from meshnet_common.precision import Precision, native_format_name, resolve_precision
from meshnet_common.tiny.gguf_files import write_gguf
from meshnet_common.tiny.snapshots import make_tiny
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.preflight import weight_bytes
from meshnet_node.engine.stage import Stage
from meshnet_node.kernels import intpack
from meshnet_node.lowbit.gguf_blocks import (
    BLOCKS,
    KEPT,
    GgufTensors,
    int4_weight,
    int8_weight,
    kept_weight,
)
from meshnet_node.lowbit.gguf_embedding import GgufEmbedding

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# (family, format, the runtime ``auto`` serves it in): every family in the 4-bit formats and
# Q8_0; the 5/6-bit K-quants and llama.cpp's Q4_K_M on a dense and an MoE family (Q5_K_M on
# the dense one: its types are those of the Q5_K and Q6_K cases); Gemma 2/3
# and Mistral (written by llama.cpp as ``llama``) in Q4_0, Q4_K and Q8_0.
CASES = [
    *((f, fmt, "int4") for f in FAMILIES for fmt in ("Q4_0", "Q4_1", "Q4_K")),
    *((f, "Q8_0", "int8") for f in FAMILIES),
    ("llama", "Q5_0", "int8"),
    ("llama", "Q5_1", "int8"),
    # rows of 384: llama.cpp's Q5_0 / Q8_0 fallbacks, mostly Q5_0 (as Gemma 3 1B's 1152)
    *((f, "Q4_K_M", "int8") for f in ("llama-384", "gemma3-384")),
    *((f, fmt, "int8") for f in ("llama", "qwen3_moe") for fmt in ("Q5_K", "Q6_K")),
    ("llama", "Q5_K_M", "int8"),
    *((f, "Q4_K_M", "int4") for f in ("llama", "qwen3_moe")),
    *((f, fmt, "int8" if fmt == "Q8_0" else "int4")
      for f in ("gemma2", "gemma3", "mistral") for fmt in ("Q4_0", "Q4_K", "Q8_0")),
]  # fmt: skip
PROMPT = list(range(3, 40))
NEW_TOKENS = 6
# The HF model of what the runtime holds: float32 rounding (int4 zeros, int8 products).
HELD_ATOL = 1e-5
# The HF model of the file's dequantized values: int4 from 4-bit blocks is exact up to the
# zero's float32 rounding, Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 kept in their values exact.
ATOL = 1e-5
# Where the CPU has AVX-512 VNNI, int4 and Q8 products take float32 rows as two int8
# digits per 32 inputs (ADR-0045): within max |x| / 64516 of each input, not float32's.
DIGITS_ATOL = 2e-4


def _atol(exact: float) -> float:
    """``exact``, or the digits' tolerance where the products take rows as digits."""
    module = intpack.module()
    return max(exact, DIGITS_ATOL) if module is not None and intpack.takes_digits(module) else exact


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    made: dict[tuple[str, str], Path] = {}

    def snapshot(family: str) -> Path:  # made once, then found; "llama-384": rows of 384
        name, _, hidden = family.partition("-")
        return make_tiny(root, name, f"tiny/{family}", layers=4, hidden=int(hidden or 256),
                         intermediate=512)  # fmt: skip

    def make(family: str, fmt: str) -> Path:
        if (family, fmt) not in made:
            made[family, fmt] = write_gguf(snapshot(family), root / f"{family}-{fmt}.gguf", fmt)
        return made[family, fmt]

    make.snapshot = snapshot
    return make


def _greedy(path: Path, precision: Precision, cuts) -> tuple[list[int], torch.Tensor]:
    stages = [
        Stage(load_shard(path, LayerRange(a, b), precision, dtype=torch.float32)) for a, b in cuts
    ]
    tokens, logits = split_greedy(stages, PROMPT, NEW_TOKENS)
    return tokens, torch.stack([row.reshape(-1) for row in logits])


def _reference(path: Path, held: bool = False) -> AutoModelForCausalLM:
    """The family's HF model holding the file's weights in float32 (``held``: as the runtime
    holds them at the file's ``auto`` precision; else as the ``gguf`` package dequantizes
    them): written as a safetensors snapshot and loaded by transformers (which fuses
    per-expert tensors)."""
    index = CheckpointIndex.load(path)
    fields = {k: v for k, v in index.config.items() if k != "quantization_config"}
    folder = path.with_suffix(".held" if held else ".reference")
    if not folder.exists():
        folder.mkdir()
        AutoConfig.for_model(**fields).save_pretrained(folder)
        reader = GgufTensors(index)
        state = {name: reader.dense(name, torch.float32).contiguous() for name in index.tensors}
        if held:
            state.update(_held(index, reader))
        save_file(state, folder / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _held(index: CheckpointIndex, reader: GgufTensors) -> dict[str, torch.Tensor]:
    """The layers' block matrices as the runtime holds them (routers stay as read)."""
    runtime = index.config["quantization_config"]["runtime"]
    out = {}
    for name, info in index.tensors.items():
        if index.layer_of(name) is None or len(info.shape) != 2 or info.dtype == "F32":
            continue
        raw = reader.raw(name)
        if info.dtype in BLOCKS:  # 4-bit blocks, at int4 and int8: as the gguf package reads
            continue
        if info.dtype in KEPT:
            out[name] = kept_weight(raw, info.dtype).dequantize()
        elif runtime == "int8":
            out[name] = int8_weight(raw, info.dtype, torch.float32).dequantize()
        else:
            out[name] = int4_weight(raw, info.dtype, torch.float32).dequantize()
    return out


@pytest.mark.parametrize(("family", "fmt", "runtime"), CASES)
def test_split_equals_one_stage_and_the_dequantized_model(gguf_file, family, fmt, runtime):
    path = gguf_file(family, fmt)
    assert native_format_name(CheckpointIndex.load(path).config) == runtime
    precision = resolve_precision("auto", "float32", runtime)
    tokens, logits = _greedy(path, precision, [(0, 1), (1, 3), (3, 4)])
    one_tokens, one_logits = _greedy(path, precision, [(0, 4)])
    assert tokens == one_tokens and torch.equal(logits, one_logits)

    ids = torch.tensor([PROMPT + tokens[:-1]])
    for held in (True, False):
        model = _reference(path, held)
        with torch.no_grad():
            want = model.generate(
                torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(PROMPT) :].tolist()
            ref = model(ids).logits[0, len(PROMPT) - 1 :]
        if held:
            assert tokens == want
            torch.testing.assert_close(logits, ref, rtol=0, atol=_atol(HELD_ATOL))
        else:
            tol = _atol(ATOL)
            assert tokens == want
            torch.testing.assert_close(logits, ref, rtol=0, atol=tol)


def test_llama_matches_transformers_own_gguf_loader(gguf_file):
    """transformers reads the same file (and undoes llama.cpp's q/k permutation itself)."""
    path = gguf_file("llama", "Q4_K")
    _, logits = _greedy(path, Precision.INT4, [(0, 2), (2, 4)])
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)  # fmt: skip
    ours = _reference(path)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=0, atol=1e-5)
    assert logits.shape[-1] == theirs.config.vocab_size


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_reads_back_as_the_hf_model_it_was_written_from(gguf_file, family):
    """llama.cpp's Gemma quirks undone: norms stored as 1 + w read as w, the four norms of
    a layer in their places, and what llama.cpp hard-codes (layer pattern, query scale,
    soft-caps, Gemma 3's local rope base) back in the config as the snapshot had it."""
    path = gguf_file(family, "Q8_0")
    index = CheckpointIndex.load(path)
    snapshot = CheckpointIndex.load(gguf_file.snapshot(family))
    theirs = AutoConfig.from_pretrained(snapshot.root)
    fields = {k: v for k, v in index.config.items() if k != "quantization_config"}
    ours = AutoConfig.for_model(**fields)
    assert index.architecture == snapshot.architecture and index.tied_embeddings
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim",
                "attn_logit_softcapping", "final_logit_softcapping", "rope_parameters"):  # fmt: skip
        assert getattr(ours, key) == getattr(theirs, key), key
    reader = GgufTensors(index)
    weights = {}
    for file in {t.file for t in snapshot.tensors.values()}:
        weights.update(load_file(snapshot.root / file))
    norms = [n for n in index.tensors if n.endswith("norm.weight")]
    assert len(norms) == 1 + index.num_layers * (6 if family == "gemma3" else 4)
    for name in norms:  # (1 + w) - 1 in float32: w up to float32's rounding of 1 + w
        torch.testing.assert_close(reader.dense(name, torch.float32), weights[name].float(), rtol=0, atol=2e-7)  # fmt: skip


def test_mistral_as_llama_cpp_writes_it_is_the_mistral_model(gguf_file):
    """llama.cpp writes Mistral as ``llama``: read back as Llama it gives the logits of
    MistralForCausalLM holding the same weights (within its sliding window, which llama.cpp
    does not keep)."""
    path = gguf_file("mistral", "Q4_K")
    index = CheckpointIndex.load(path)
    assert index.architecture == "LlamaForCausalLM"
    _, logits = _greedy(path, Precision.INT4, [(0, 2), (2, 4)])
    llama = _reference(path)
    folder = path.with_suffix(".mistral")
    folder.mkdir()
    AutoConfig.from_pretrained(gguf_file.snapshot("mistral")).save_pretrained(folder)
    state = {k: v.contiguous() for k, v in llama.state_dict().items()}
    save_file(state, folder / "model.safetensors")
    mistral = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(mistral).__name__ == "MistralForCausalLM"
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(mistral(ids).logits, llama(ids).logits, rtol=0, atol=1e-6)
        ref = mistral(ids).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, rtol=0, atol=_atol(1e-5))


@pytest.mark.parametrize(
    ("fmt", "runtime"), [("Q4_K_M", "int4"), ("Q5_K_M", "int8"), ("Q6_K", "int8")]
)
def test_auto_serves_a_mix_in_the_runtime_of_most_of_its_bytes(gguf_file, fmt, runtime):
    index = CheckpointIndex.load(gguf_file("llama", fmt))
    types = {info.dtype for info in index.tensors.values()}
    assert native_format_name(index.config) == runtime
    if fmt in ("Q4_K_M", "Q5_K_M"):  # llama.cpp's use_more_bits: layers 2 and 3 of 4
        assert {fmt[:4], "Q6_K"} <= types
        assert index.tensors["model.layers.3.mlp.down_proj.weight"].dtype == "Q6_K"
        assert index.tensors["model.layers.0.mlp.down_proj.weight"].dtype == fmt[:4]
        assert index.tensors["model.embed_tokens.weight"].dtype == fmt[:4]  # (tied)


KEPT_CASES = [("llama", "Q4_K_M", 3, "q6_k"), ("llama", "Q6_K", 0, "q6_k"),
              ("llama", "Q8_0", 0, "q8_0"), ("llama", "Q5_0", 0, "q5_0"),
              ("llama", "Q5_K", 0, "q5_k"), ("llama", "Q5_1", 0, "q5_1"),
              ("llama", "Q5_K_M", 0, "q5_k"),
              ("llama-384", "Q4_K_M", 0, "int4"), ("llama-384", "Q4_K_M", 3, "q6_k")]  # fmt: skip


@pytest.mark.parametrize(("family", "fmt", "layer", "held"), KEPT_CASES)
def test_gguf_blocks_are_held_in_their_values(gguf_file, family, fmt, layer, held):
    """Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 projections are held as int8 codes with a scale (and
    a zero) per 16 or 32 weights, 4-bit blocks as int4 as they are, at int4 and int8 alike
    (docs/adr/0049): the
    values the ``gguf`` package dequantizes, bit for bit (Q4_K's zeros to float32's
    rounding); siblings of one block size still fuse."""
    path = gguf_file(family, fmt)
    index = CheckpointIndex.load(path)
    precision = resolve_precision("auto", "float32", native_format_name(index.config))
    shard = load_shard(path, LayerRange(layer, layer + 1), precision, dtype=torch.float32)
    mlp = shard.modules.layers[0].mlp
    assert mlp.down_proj.packed.fmt == held
    want = GgufTensors(index).dense(f"model.layers.{layer}.mlp.down_proj.weight", torch.float32)
    got = mlp.down_proj.packed.dequantize()
    assert torch.equal(got, want) if held != "int4" else torch.allclose(got, want, atol=1e-6)
    if fmt != "Q4_K_M" or family == "llama-384":  # gate and up of one block size: one product
        assert getattr(mlp.gate_proj, "group", None) is not None
    assert set(KEPT) == set(KEPT_BLOCKS)


@pytest.mark.parametrize(
    ("family", "fmt", "start", "end"),
    [("llama", "Q4_K_M", 1, 3), ("llama", "Q6_K", 1, 3), ("llama", "Q8_0", 1, 3),
     ("llama", "Q4_K", 1, 3), ("llama-384", "Q4_K_M", 1, 3), ("llama", "Q5_K_M", 1, 3),
     ("llama-384", "Q4_K_M", 3, 4), ("llama-384", "Q4_K_M", 0, 4)],
)  # fmt: skip
def test_a_gguf_range_is_priced_as_it_is_held(gguf_file, family, fmt, start, end):
    """The memory the tracker plans for a range is what the node holds: kept blocks at one
    byte a weight and a float32 scale (and zero) per block, int4 at half a byte and a scale
    and zero per 32 (in an int8 node too); a tail's kept LM head (the tied Q5_0 embedding
    of a model 384 wide) and a head's block embedding as held."""
    path = gguf_file(family, fmt)
    index = CheckpointIndex.load(path)
    precision = resolve_precision("auto", "float32", native_format_name(index.config))
    layers = LayerRange(start, end)
    shard = load_shard(path, layers, precision, dtype=torch.float32)
    held = {t.data_ptr(): t.numel() * t.element_size()
            for t in (*shard.modules.parameters(), *shard.modules.buffers())}  # fmt: skip
    expected = weight_bytes(index, layers, precision, dtype="float32", group_size=32)
    assert sum(held.values()) == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize(
    ("family", "fmt"), [("llama", "Q4_K_M"), ("gemma3-384", "Q4_K_M"), ("llama-384", "Q4_K_M")]
)
def test_a_heads_gguf_embedding_stays_in_its_blocks(gguf_file, family, fmt):
    """A head looks its tokens up in the embedding's blocks (docs/adr/0050): the rows the
    dense tensor held, bit for bit (Gemma's scale applied as its module does), for a
    fraction of float32's bytes; the head range is priced as held."""
    path = gguf_file(family, fmt)
    index = CheckpointIndex.load(path)
    precision = resolve_precision("auto", "float32", native_format_name(index.config))
    shard = load_shard(path, LayerRange(0, 1), precision, dtype=torch.float32)
    embed = shard.modules.embed
    assert isinstance(embed, GgufEmbedding)
    dense = GgufTensors(index).dense("model.embed_tokens.weight", torch.float32)
    ids = torch.tensor([[3, 9, 4, 200], [0, 1, 2, 3]])
    want = torch.nn.functional.embedding(ids, dense)
    if family.startswith("gemma3"):  # Gemma3TextScaledWordEmbedding: rows times sqrt(hidden)
        want = want * torch.tensor(embed.scale.item())
    assert torch.equal(embed(ids), want)
    assert embed.blocks.numel() < dense.numel() * dense.element_size() / 3
    held = {t.data_ptr(): t.numel() * t.element_size()
            for t in (*shard.modules.parameters(), *shard.modules.buffers())}  # fmt: skip
    expected = weight_bytes(index, LayerRange(0, 1), precision, dtype="float32", group_size=32)
    assert sum(held.values()) == pytest.approx(expected, rel=0.02)

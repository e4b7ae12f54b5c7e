"""GGUF files in each block format, written by our own packing code from tiny random models
(``tiny_gguf``): split over stages = one stage at the same precision (bit for bit, float32),
and equal to the HF model built from the file's dequantized weights in float32 — Q4_0, Q4_1
and Q4_K are int4 as they are (logits within float32 rounding), Q8_0 is int8 rounded to a
scale per row (close, not exact)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.tiny import make_tiny
from meshnet_common.models.tiny_gguf import BLOCK_FORMATS, write_gguf
from meshnet_common.precision import Precision, native_format_name, resolve_precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.reference import split_greedy
from meshnet_node.engine.stage import Stage
from meshnet_node.lowbit.gguf_blocks import GgufTensors

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
PROMPT = list(range(3, 40))
NEW_TOKENS = 6
# int4 from 4-bit blocks: the zero is one float32 rounding from the file's (Q4_0: exact)
ATOL = {"int4": 1e-5, "int8": 0.1}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    made: dict[tuple[str, str], Path] = {}

    def make(family: str, fmt: str) -> Path:
        if (family, fmt) not in made:
            snapshot = make_tiny(root, family, f"tiny/{family}", layers=4, hidden=256, intermediate=512)  # fmt: skip
            made[family, fmt] = write_gguf(snapshot, root / f"{family}-{fmt}.gguf", fmt)
        return made[family, fmt]

    return make


def _greedy(path: Path, precision: Precision, cuts) -> tuple[list[int], torch.Tensor]:
    stages = [
        Stage(load_shard(path, LayerRange(a, b), precision, dtype=torch.float32)) for a, b in cuts
    ]
    tokens, logits = split_greedy(stages, PROMPT, NEW_TOKENS)
    return tokens, torch.stack([row.reshape(-1) for row in logits])


def _reference(path: Path) -> AutoModelForCausalLM:
    """The family's HF model holding the file's weights dequantized, in float32: written as
    a safetensors snapshot and loaded by transformers (which fuses per-expert tensors)."""
    index = CheckpointIndex.load(path)
    fields = {k: v for k, v in index.config.items() if k != "quantization_config"}
    folder = path.with_suffix(".reference")
    if not folder.exists():
        folder.mkdir()
        AutoConfig.for_model(**fields).save_pretrained(folder)
        reader = GgufTensors(index)
        state = {name: reader.dense(name, torch.float32).contiguous() for name in index.tensors}
        save_file(state, folder / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_split_equals_one_stage_and_the_dequantized_model(gguf_file, family, fmt):
    path = gguf_file(family, fmt)
    runtime = native_format_name(CheckpointIndex.load(path).config)
    assert runtime == ("int8" if fmt == "Q8_0" else "int4")
    precision = resolve_precision("auto", "float32", runtime)
    tokens, logits = _greedy(path, precision, [(0, 1), (1, 3), (3, 4)])
    one_tokens, one_logits = _greedy(path, precision, [(0, 4)])
    assert tokens == one_tokens and torch.equal(logits, one_logits)

    model = _reference(path)
    with torch.no_grad():
        want = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
        ref = model(torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1 :]
    assert tokens == want
    torch.testing.assert_close(logits, ref, rtol=0, atol=ATOL[runtime])


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

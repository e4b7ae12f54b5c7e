"""``meshnet-models``: make-tiny for every family and layout, list, and clean failures."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshnet_common.models.checkpoint import INDEX_FILE, CheckpointIndex
from meshnet_common.models.cli import main
from meshnet_common.models.models_dir import find_snapshot, scan_models_dir
from meshnet_common.tiny.snapshots import FAMILIES, MOE_FAMILIES

LAYOUTS = ("plain", "hub")
EXPECTED = {
    # family: (architecture, tied embeddings)
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", False),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", True),
    "gpt2": ("GPT2LMHeadModel", True),
    "gemma2": ("Gemma2ForCausalLM", True),
    "gemma3": ("Gemma3ForCausalLM", True),
    "phi3": ("Phi3ForCausalLM", False),
    "mixtral": ("MixtralForCausalLM", False),
    "qwen2_moe": ("Qwen2MoeForCausalLM", False),
    "qwen3_moe": ("Qwen3MoeForCausalLM", False),
    "deepseek_v3": ("DeepseekV3ForCausalLM", False),
    "glm4_moe": ("Glm4MoeForCausalLM", False),
    "gpt_oss": ("GptOssForCausalLM", False),
}


def run_cli(*args: str, models_dir_env: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter, as an operator would run it."""
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_MODELS_DIR"}
    if models_dir_env is not None:
        env["MESHNET_MODELS_DIR"] = str(models_dir_env)
    return subprocess.run(
        [sys.executable, "-m", "meshnet_common.models.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.fixture(scope="module")
def cli_models(tmp_path_factory) -> Path:
    """One models dir holding every family in both layouts, written through ``main``."""
    root = tmp_path_factory.mktemp("cli-models")
    for family in FAMILIES:
        for layout in LAYOUTS:
            argv = ["make-tiny", "--family", family, "--model-id", f"t/{family}-{layout}"]
            assert main([*argv, "--models-dir", str(root), "--layout", layout]) == 0
    return root


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_make_tiny_snapshot_loads_in_transformers(cli_models, family, layout):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    snapshot = find_snapshot(cli_models, f"t/{family}-{layout}", layout)
    assert snapshot is not None
    index = CheckpointIndex.load(snapshot)
    architecture, tied = EXPECTED[family]
    assert index.architecture == architecture
    assert index.tied_embeddings is tied
    assert ("lm_head.weight" in index.tensors) is not tied
    assert len({t.file for t in index.tensors.values()}) >= 3
    assert (snapshot / INDEX_FILE).is_file()
    assert index.dtype == "BF16"
    # routers of group-routed MoEs stay float32, as transformers keeps and saves them
    others = {t.dtype for n, t in index.tensors.items() if ".mlp.gate." not in n}
    assert others == {"BF16"}

    model = AutoModelForCausalLM.from_pretrained(snapshot)
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    assert model.config.num_hidden_layers == 6
    assert model.config.vocab_size % 32 == 0 and model.config.vocab_size >= len(tokenizer)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in MOE_FAMILIES])
def test_every_linear_width_is_a_multiple_of_32(cli_models, family):
    """bitsandbytes nf4 on CPU needs it; 1-D tensors (norms, biases) do not matter. MoE
    families are never quantized (refused), so their routers may be narrow."""
    index = CheckpointIndex.load(find_snapshot(cli_models, f"t/{family}-plain", "plain"))
    for tensor in index.tensors.values():
        if len(tensor.shape) == 2:
            assert all(dim % 32 == 0 for dim in tensor.shape), (tensor.name, tensor.shape)


def test_sliding_window_settings(cli_models):
    def config(family: str) -> dict:
        path = find_snapshot(cli_models, f"t/{family}-plain", "plain")
        return json.loads((path / "config.json").read_text())

    assert config("mistral")["sliding_window"] == 48
    qwen2 = config("qwen2")
    assert qwen2["sliding_window"] == 48
    assert set(qwen2["layer_types"]) == {"full_attention", "sliding_attention"}
    assert set(config("qwen3")["layer_types"]) == {"full_attention"}


def test_make_tiny_is_deterministic_and_idempotent(cli_models, tmp_path, capsys):
    argv = ["make-tiny", "--family", "qwen2", "--model-id", "t/qwen2-hub", "--layout", "hub"]
    assert main([*argv, "--models-dir", str(tmp_path)]) == 0
    again = find_snapshot(tmp_path, "t/qwen2-hub", "hub")
    first = find_snapshot(cli_models, "t/qwen2-hub", "hub")
    assert again.name == first.name  # content-derived revision: identical bytes

    mtime = (again / INDEX_FILE).stat().st_mtime_ns
    assert main([*argv, "--models-dir", str(tmp_path)]) == 0
    assert (again / INDEX_FILE).stat().st_mtime_ns == mtime  # skipped, not rewritten
    assert "t/qwen2-hub: " in capsys.readouterr().out


def test_make_tiny_shape_change_needs_force(tmp_path, capsys):
    base = ["make-tiny", "--family", "llama", "--model-id", "t/l", "--models-dir", str(tmp_path)]
    assert main(base) == 0
    assert main([*base, "--layers", "4"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main([*base, "--layers", "4", "--force"]) == 0
    assert CheckpointIndex.load(tmp_path / "t" / "l").num_layers == 4
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_force_replaces_a_broken_hub_copy(tmp_path, capsys):
    argv = ["make-tiny", "--family", "gpt2", "--model-id", "t/g", "--layout", "hub"]
    argv += ["--models-dir", str(tmp_path)]
    assert main(argv) == 0
    snapshot = find_snapshot(tmp_path, "t/g", "hub")
    (snapshot / INDEX_FILE).write_text("{}")
    assert main(argv) == 2
    assert str(snapshot) in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0
    assert find_snapshot(tmp_path, "t/g", "hub") == snapshot  # same content, same revision
    assert CheckpointIndex.load(snapshot).num_layers == 6


def test_list_table_and_json(cli_models):
    table = run_cli("list", "--models-dir", str(cli_models))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "MODEL",
        "LAYERS",
        "ARCHITECTURE",
        "DTYPE",
        "SIZE",
        "FILES",
        "LAYOUT",
    ]
    assert len(lines) == 1 + 2 * len(FAMILIES)
    llama = next(line.split() for line in lines if line.startswith("t/llama-hub "))
    assert llama[1:4] == ["6", "LlamaForCausalLM", "BF16"] and llama[-1] == "hub"

    listing = run_cli("list", "--json", models_dir_env=cli_models)
    assert listing.returncode == 0, listing.stderr
    payload = json.loads(listing.stdout)
    assert payload["problems"] == []
    entries, _ = scan_models_dir(cli_models)
    assert payload["models"] == [e.to_json() for e in entries]


def test_list_reports_problems_and_exits_1(tiny_snapshot, tmp_path):
    shutil.copytree(tiny_snapshot("llama"), tmp_path / "ok" / "llama")
    broken = shutil.copytree(tiny_snapshot("llama"), tmp_path / "bad" / "llama")
    (broken / INDEX_FILE).write_text("[]")
    result = run_cli("list", "--models-dir", str(tmp_path))
    assert result.returncode == 1
    assert "ok/llama" in result.stdout
    assert str(broken) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["list", "--models-dir", "/nonexistent/models"], "/nonexistent/models"),
        (["make-tiny", "--family", "llama", "--model-id", "../evil"], "'../evil'"),
        (["make-tiny", "--family", "llama", "--model-id", "a/b", "--hidden", "48"], "multiple"),
        (["make-tiny", "--family", "bert", "--model-id", "a/b"], "invalid choice"),
        (["make-tiny", "--family", "gpt2", "--model-id", "a/b", "--layers", "0"], "positive"),
        (["import-gguf", "/nonexistent/x.gguf", "--model-id", "a/b"], "/nonexistent/x.gguf"),
        (["list"], "MESHNET_MODELS_DIR"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(tmp_path, args, needle):
    if args[0] != "list":
        args = [*args, "--models-dir", str(tmp_path)]
    result = run_cli(*args)
    assert result.returncode == 2, result
    assert needle in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "meshnet-models"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for command in ("import-smollm2", "import-gguf", "make-tiny", "list"):
        assert command in result.stdout


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"meshnet-models {importlib.metadata.version('meshnet-common')}"
    assert out.split()[1][0].isdigit()  # installed in the venv, so not "unknown"

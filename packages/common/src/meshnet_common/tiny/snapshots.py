"""Random-weight models of each supported family, built offline for tests and benchmarks.

Weights come from the model's own initialiser under a fixed seed and the tokenizer is a
byte-level BPE trained on a small built-in English text, so the same arguments always
give the same files. Every Linear output width is a multiple of 32: bitsandbytes nf4 on
CPU refuses anything else.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from meshnet_common.errors import InvalidRequest, ModelError
from meshnet_common.models.checkpoint import INDEX_FILE, CheckpointIndex
from meshnet_common.models.models_dir import Layout, find_snapshot, staged_snapshot
from meshnet_common.tiny.configs import (  # the family table, re-exported here
    CONFIG_BUILDERS,
    MAX_POSITIONS,
    WIDTH_MULTIPLE,
    TinySpec,
    _round_up,
)
from meshnet_common.tiny.configs import (
    EXPERTS as EXPERTS,
)
from meshnet_common.tiny.configs import (
    FAMILIES as FAMILIES,
)
from meshnet_common.tiny.configs import (
    MOE_FAMILIES as MOE_FAMILIES,
)
from meshnet_common.tiny.configs import (
    SLIDING_WINDOW as SLIDING_WINDOW,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

MIN_WEIGHT_FILES = 3
TOKENIZER_VOCAB = 1024  # BPE target; a tiny corpus may stop short of it

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Fixed training text for the tokenizer: plain English prose, enough for common merges.
CORPUS = """\
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
The capital of Spain is Madrid. The capital of Japan is Tokyo. The capital of Canada is Ottawa.
Paris is a city on the river Seine, and many people visit it every year to see its museums.
A large language model reads a sequence of tokens and predicts the next token in the text.
The model is split into layers, and each machine in the network serves a range of layers.
Once upon a time there was a small cat who lived in a house near the sea with an old man.
Every morning the cat walked along the beach, looking at the boats and the birds in the sky.
The weather today is sunny and warm, with a light wind from the west and a few clouds.
Tomorrow it will rain in the morning, but the afternoon should be dry and a little cooler.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, hundred.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week.
January, February, March, April, May, June, July, August, September, October, November.
The quick brown fox jumps over the lazy dog while the children laugh and play in the garden.
She opened the book, read the first page, and then looked out of the window at the street.
He said that the train would leave at nine o'clock, so they had to be at the station early.
Water boils at one hundred degrees and freezes at zero degrees on the Celsius scale.
The sun is a star, and the earth moves around it once a year while turning once a day.
Computers store numbers as bits, and a byte is made of eight bits that are zero or one.
People write programs to tell computers what to do, step by step, in a careful order.
Good morning! How are you today? I am fine, thank you. What would you like to eat for lunch?
I would like some bread, some cheese, an apple and a cup of tea with milk, please.
The teacher asked the students to write a short story about their favourite animal.
Mountains, rivers, forests and lakes cover the land, and the oceans cover most of the planet.
The history of the world is long, and many kings, queens and leaders have come and gone.
Music, painting and poetry are arts that people have loved for thousands of years.
The doctor told him to drink more water, to sleep well and to walk for an hour every day.
In the evening the family sat together at the table, talking about what they had done.
The answer to the question is simple: think about the problem before you try to solve it.
"""


def tiny_spec(
    family: str,
    layers: int = 6,
    hidden: int = 64,
    *,
    intermediate: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
) -> TinySpec:
    """Fill in defaults and check the shape; raise InvalidRequest for an impossible one.

    Defaults: intermediate = 2 * hidden, heads = max(4, hidden // 64) (head_dim 16 at
    hidden 64, 64 from hidden 256 up), kv_heads = max(2, heads // 4). So ``hidden=2048,
    layers=24`` with ``vocab_size=32000`` is a ~0.9B-parameter Llama.
    """
    if family not in FAMILIES:
        raise InvalidRequest(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    heads = heads if heads is not None else max(4, hidden // 64)
    kv_heads = kv_heads if kv_heads is not None else max(2, heads // 4)
    if family in ("gpt2", "deepseek_v3"):
        kv_heads = heads  # no grouped-query attention (GPT-2; MLA expands its latent per head)
    intermediate = intermediate if intermediate is not None else 2 * hidden
    spec = TinySpec(family, layers, hidden, intermediate, heads, kv_heads, vocab_size, seed)
    _check_spec(spec)
    return spec


def _check_spec(spec: TinySpec) -> None:
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads"):
        if getattr(spec, name) <= 0:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be positive")
    if spec.hidden % spec.heads:
        raise InvalidRequest(f"hidden {spec.hidden} is not divisible by heads {spec.heads}")
    if spec.heads % spec.kv_heads:
        raise InvalidRequest(f"heads {spec.heads} is not divisible by kv-heads {spec.kv_heads}")
    widths = {
        "hidden": spec.hidden,
        "intermediate": spec.intermediate,
        "kv-heads * head_dim": spec.kv_heads * spec.head_dim,
    }
    for name, width in widths.items():
        if width % WIDTH_MULTIPLE:
            raise InvalidRequest(
                f"{name} = {width} is not a multiple of {WIDTH_MULTIPLE} (needed for nf4 on CPU)"
            )
    if spec.vocab_size is not None and spec.vocab_size <= 0:
        raise InvalidRequest("--vocab-size must be positive")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``CORPUS``, with bos/eos/unk/pad and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> dict:
    return {
        "bos_token_id": tokenizer.convert_tokens_to_ids(BOS),
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD),
    }


def build_config(spec: TinySpec, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The transformers config for ``spec``, with a vocab covering ``tokenizer``."""
    vocab_size = spec.vocab_size if spec.vocab_size is not None else len(tokenizer)
    if vocab_size < len(tokenizer):
        raise InvalidRequest(f"--vocab-size {vocab_size} is below the tokenizer's {len(tokenizer)}")
    padded = _round_up(vocab_size, WIDTH_MULTIPLE)
    if padded != vocab_size and spec.vocab_size is not None:
        logger.info(
            "vocab size %d padded to %d (multiple of %d)", vocab_size, padded, WIDTH_MULTIPLE
        )
    return CONFIG_BUILDERS[spec.family](spec, padded, _token_ids(tokenizer))


def _shard_size(model) -> int:
    """Bytes per shard so that the weights span several files and layers straddle them."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # Tensors are never split, so a fifth per shard gives 5-6 files with edges inside layers,
    # leaving slack above MIN_WEIGHT_FILES when one big tensor (the embedding) fills a shard.
    return max(1, total // (MIN_WEIGHT_FILES + 2))


def make_tiny(
    models_dir: Path | str,
    family: str,
    model_id: str,
    layers: int = 6,
    hidden: int = 64,
    layout: Layout = "plain",
    *,
    intermediate: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    force: bool = False,
    weight_format: str = "bf16",
) -> Path:
    """Write a random ``family`` model as ``model_id``; return its snapshot folder.

    ``weight_format``: "fp8" or "mxfp4" stores the weights the way the family's hub
    checkpoints ship quantized (``meshnet_common.models.native_formats``).

    Skips the work (and returns the existing folder) when the model is already there,
    unless ``force``.
    """
    spec = tiny_spec(
        family,
        layers,
        hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=kv_heads,
        vocab_size=vocab_size,
        seed=seed,
    )
    if weight_format == "mxfp4" and family != "gpt_oss":
        raise InvalidRequest("--format mxfp4: only gpt_oss ships MXFP4 (its experts)")
    if weight_format == "fp8" and family == "gpt2":
        raise InvalidRequest("--format fp8: GPT-2 checkpoints are not shipped in FP8")
    # With force, an existing copy (even a broken one) is simply replaced.
    existing = None if force else find_snapshot(models_dir, model_id, layout)
    if existing is not None:
        _check_existing(existing, spec, weight_format)
        logger.info(
            "%s already present at %s; skipping (use --force to rebuild)", model_id, existing
        )
        return existing

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tokenizer()
    config = build_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ids = _token_ids(tokenizer)
    # Chat replies end with <|im_end|>; plain text with </s>: stop on either.
    ids["eos_token_id"] = [ids["eos_token_id"], tokenizer.convert_tokens_to_ids(IM_END)]
    model.generation_config = GenerationConfig(**ids)
    with staged_snapshot(models_dir, model_id, layout, replace=force) as staged:
        model.save_pretrained(staged.folder, max_shard_size=_shard_size(model))
        tokenizer.save_pretrained(staged.folder)
        if weight_format != "bf16":
            from meshnet_common.models.native_formats import convert_snapshot

            convert_snapshot(staged.folder, weight_format)
        _check_written(staged.folder)
    params = sum(p.numel() for p in model.parameters())
    logger.info("wrote %s (%s, %.1fM params) to %s", model_id, family, params / 1e6, staged.path)
    return staged.path


def _check_existing(snapshot: Path, spec: TinySpec, weight_format: str = "bf16") -> None:
    """Refuse to reuse a snapshot that is broken or was built with a different shape."""
    index = CheckpointIndex.load(snapshot)
    config = index.config
    found = {
        "family": {"gemma3_text": "gemma3"}.get(config.get("model_type"), config.get("model_type")),
        "layers": index.num_layers,
        "hidden": config.get("hidden_size", config.get("n_embd")),
        "format": (config.get("quantization_config") or {}).get("quant_method", "bf16"),
    }
    wanted = {
        "family": spec.family, "layers": spec.layers, "hidden": spec.hidden,
        "format": weight_format,
    }  # fmt: skip
    if found != wanted:
        raise ModelError(
            f"{snapshot}: existing model has {found}, asked for {wanted}; use --force to rebuild"
        )


def _check_written(folder: Path) -> None:
    """Refuse to publish a snapshot with too few weight files (it would test nothing)."""
    index = CheckpointIndex.load(folder)
    files = {t.file for t in index.tensors.values()}
    if not (folder / INDEX_FILE).exists() or len(files) < MIN_WEIGHT_FILES:
        raise InvalidRequest(
            f"{folder}: only {len(files)} weight file(s) written; "
            f"need {MIN_WEIGHT_FILES} (model too small to shard?)"
        )

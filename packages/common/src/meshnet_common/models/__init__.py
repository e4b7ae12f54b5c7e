"""Model files: reading a checkpoint's index and headers without torch (``checkpoint``),
models dirs in both layouts (``models_dir``), layer-subset files (``shardfiles``), and the
``meshnet-models`` tooling (``cli``, ``gguf_import``, ``tiny``: these need the ``models``
extra).

Here: the largest numbers a model file may state (``check_config``). Every reader of the
package holds a file's numbers to them, so a crafted file is refused in one ModelError
line naming it instead of sizing a loop, a list or a division by what it claims. The
maxima sit far above any released model (Llama 3.1 405B: 126 layers, 128 heads, hidden
16384; Kimi K2: 384 experts; Gemma 3: a 262144-token vocabulary)."""

from __future__ import annotations

from meshnet_common.errors import ModelError

MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 14
MAX_EXPERTS = 1 << 12
MAX_WIDTH = 1 << 20  # hidden, intermediate and head widths, latent ranks
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 27
MAX_TENSORS = 1 << 20  # tensors one index lists (a GGUF's experts one by one)
MAX_DIM = 1 << 32  # one dimension of one tensor
MAX_NUMEL = 1 << 40  # values in one tensor: int64 offsets of its bytes never overflow

# config field -> (least, most): what the tracker prices a model by and the node
# sizes its caches by. A field named twice (GPT-2's ``n_embd``) is checked under both names.
_CONFIG_INTS = {
    "num_hidden_layers": (1, MAX_LAYERS), "n_layer": (1, MAX_LAYERS),
    "hidden_size": (1, MAX_WIDTH), "n_embd": (1, MAX_WIDTH),
    "num_attention_heads": (1, MAX_HEADS), "n_head": (1, MAX_HEADS),
    "num_key_value_heads": (1, MAX_HEADS), "head_dim": (1, MAX_WIDTH),
    "kv_lora_rank": (0, MAX_WIDTH), "qk_rope_head_dim": (0, MAX_WIDTH),
    "intermediate_size": (0, MAX_WIDTH), "moe_intermediate_size": (0, MAX_WIDTH),
    "shared_expert_intermediate_size": (0, MAX_WIDTH),
    "vocab_size": (1, MAX_VOCAB), "max_position_embeddings": (1, MAX_POSITIONS),
    "num_experts": (0, MAX_EXPERTS), "num_local_experts": (0, MAX_EXPERTS),
    "n_routed_experts": (0, MAX_EXPERTS), "num_experts_per_tok": (0, MAX_EXPERTS),
}  # fmt: skip
# One of each pair must be there: the layer count, the width and the heads.
_REQUIRED = (("num_hidden_layers", "n_layer"), ("hidden_size", "n_embd"),
             ("num_attention_heads", "n_head"))  # fmt: skip
_CONFIG_REALS = ("rope_theta", "rms_norm_eps", "attn_logit_softcapping", "final_logit_softcapping")


def bounded(value, least: int, most: int, what: str) -> int:
    """``value`` when it is an integer in ``[least, most]``; ModelError naming ``what``."""
    if type(value) is not int or not least <= value <= most:
        shown = repr(value) if isinstance(value, int | float | str) else type(value).__name__
        raise ModelError(f"{what} is {shown[:40]}: an integer in [{least}, {most}] is read")
    return value


def check_config(config: dict, where: object, names: dict[str, str] | None = None) -> None:
    """Hold a config's numbers to the maxima; ModelError naming ``where`` (and the field as
    ``names`` calls it: a GGUF's metadata key) on the first that is missing or out of range.
    A null field is absent (``head_dim: null``)."""
    names = names or {}
    for pair in _REQUIRED:
        if all(config.get(field) is None for field in pair):
            raise ModelError(f"{where}: {names.get(pair[0], pair[0])} is missing")
    for field, (least, most) in _CONFIG_INTS.items():
        if config.get(field) is not None:
            bounded(config[field], least, most, f"{where}: {names.get(field, field)}")
    if not isinstance(config.get("quantization_config") or {}, dict):
        raise ModelError(f"{where}: quantization_config is not a JSON object")
    for field in _CONFIG_REALS:
        value = config.get(field)
        if value is not None and (type(value) not in (int, float) or value != value):
            raise ModelError(f"{where}: {names.get(field, field)} is not a number")

"""How each family's tiny random config is built from a resolved ``TinySpec`` (defined here,
filled in by ``snapshots.tiny_spec``): one builder per family (``CONFIG_BUILDERS``), with the
shapes every family shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "gpt2",
    "gemma2", "gemma3", "phi3",
    "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss",
)  # fmt: skip
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")
EXPERTS = 4  # routed experts per MoE layer in a tiny model, 2 of them per token
WIDTH_MULTIPLE = 32  # nf4 on CPU needs Linear output widths divisible by this
SLIDING_WINDOW = 48  # small, so a 300-token prompt crosses the window
MAX_POSITIONS = 1024


@dataclass(frozen=True)
class TinySpec:
    """The resolved shape of a random model; every default already filled in."""

    family: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab_size: int | None  # None: the tokenizer's size rounded up to WIDTH_MULTIPLE
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _decoder_kwargs(spec: TinySpec, vocab_size: int) -> dict:
    return {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": MAX_POSITIONS,
    }


def _llama(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import LlamaConfig

    return LlamaConfig(**_decoder_kwargs(spec, vocab_size), **token_ids, tie_word_embeddings=True)


def _mistral(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import MistralConfig

    return MistralConfig(
        **_decoder_kwargs(spec, vocab_size),
        **token_ids,
        sliding_window=SLIDING_WINDOW,
        tie_word_embeddings=False,
    )


def _qwen2(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import Qwen2Config

    # Layers from max_window_layers on use sliding attention: a mix of both kinds.
    return Qwen2Config(
        **_decoder_kwargs(spec, vocab_size),
        **token_ids,
        use_sliding_window=True,
        sliding_window=SLIDING_WINDOW,
        max_window_layers=max(1, spec.layers // 2),
        tie_word_embeddings=False,
    )


def _qwen3(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import Qwen3Config

    return Qwen3Config(
        **_decoder_kwargs(spec, vocab_size),
        **token_ids,
        use_sliding_window=False,
        tie_word_embeddings=True,
    )


def _gpt2(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size,
        n_embd=spec.hidden,
        n_inner=spec.intermediate,
        n_layer=spec.layers,
        n_head=spec.heads,
        n_positions=MAX_POSITIONS,
        tie_word_embeddings=True,
        **token_ids,
    )


def _alternating(layers: int) -> list[str]:
    """Sliding and full attention layers in turn (Gemma 2, gpt-oss): both kinds in a stage."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _gemma2(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import Gemma2Config

    return Gemma2Config(
        **_decoder_kwargs(spec, vocab_size), **token_ids, sliding_window=SLIDING_WINDOW,
        layer_types=_alternating(spec.layers), query_pre_attn_scalar=spec.head_dim,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, tie_word_embeddings=True,
    )  # fmt: skip


def _gemma3(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import Gemma3TextConfig

    # Five local layers per global one, as the real models: here 2 local, 1 global.
    types = [
        "full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(spec.layers)
    ]
    config = Gemma3TextConfig(
        **_decoder_kwargs(spec, vocab_size), **token_ids, sliding_window=SLIDING_WINDOW,
        layer_types=types, query_pre_attn_scalar=spec.head_dim, tie_word_embeddings=True,
        final_logit_softcapping=30.0,
    )  # fmt: skip
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def _phi3(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import Phi3Config

    return Phi3Config(**_decoder_kwargs(spec, vocab_size), **token_ids, tie_word_embeddings=False)


def _moe_width(spec: TinySpec) -> int:
    return max(WIDTH_MULTIPLE, _round_up(spec.intermediate // 2, WIDTH_MULTIPLE))


def _mixtral(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import MixtralConfig

    return MixtralConfig(
        **_decoder_kwargs(spec, vocab_size), **token_ids, num_local_experts=EXPERTS,
        num_experts_per_tok=2, sliding_window=SLIDING_WINDOW, tie_word_embeddings=False,
    )  # fmt: skip


def _qwen2_moe(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import Qwen2MoeConfig

    # Layer 0 dense (mlp_only_layers), then every second layer sparse: all three kinds mixed.
    return Qwen2MoeConfig(
        **_decoder_kwargs(spec, vocab_size), **token_ids, num_experts=EXPERTS,
        num_experts_per_tok=2, moe_intermediate_size=_moe_width(spec),
        shared_expert_intermediate_size=_moe_width(spec), decoder_sparse_step=2,
        mlp_only_layers=[0], tie_word_embeddings=False,
    )  # fmt: skip


def _qwen3_moe(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_decoder_kwargs(spec, vocab_size), **token_ids, num_experts=EXPERTS,
        num_experts_per_tok=2, moe_intermediate_size=_moe_width(spec), mlp_only_layers=[0],
        decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
    )  # fmt: skip


def _mla_kwargs(spec: TinySpec) -> dict:
    return {
        "kv_lora_rank": WIDTH_MULTIPLE,
        "q_lora_rank": 2 * WIDTH_MULTIPLE,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
    }


def _deepseek_v3(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import DeepseekV3Config

    kwargs = _decoder_kwargs(spec, vocab_size)
    kwargs.pop("head_dim")
    # MLA attention, the first layer dense, then shared + routed experts with group routing
    # (2 groups, the best 1 chosen), YaRN rope as the real checkpoints ship it.
    return DeepseekV3Config(
        **kwargs, **token_ids, **_mla_kwargs(spec), n_routed_experts=EXPERTS,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=_moe_width(spec),
        first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "rope_theta": 10000.0,
        },
        tie_word_embeddings=False,
    )  # fmt: skip


def _glm4_moe(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import Glm4MoeConfig

    config = Glm4MoeConfig(
        **_decoder_kwargs(spec, vocab_size), **token_ids, n_routed_experts=EXPERTS,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=_moe_width(spec),
        first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
        use_qk_norm=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
    )  # fmt: skip
    return config


def _gpt_oss(spec: TinySpec, vocab_size: int, token_ids: dict) -> PretrainedConfig:
    from transformers import GptOssConfig

    return GptOssConfig(
        **_decoder_kwargs(spec, vocab_size), **token_ids, num_local_experts=EXPERTS,
        num_experts_per_tok=2, sliding_window=SLIDING_WINDOW,
        layer_types=_alternating(spec.layers), tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
            "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 150000.0, "truncate": False,
        },
    )  # fmt: skip


# One entry per family: how to build its config from a resolved spec.
CONFIG_BUILDERS: dict[str, Callable[[TinySpec, int, dict], PretrainedConfig]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gpt2": _gpt2,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _glm4_moe,
    "gpt_oss": _gpt_oss,
}

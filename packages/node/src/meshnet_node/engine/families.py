"""Model-family adapters: the only place that knows how each family names and calls things.

Each supported architecture has one ``FamilyAdapter``: where the layer list, embeddings and
final norm live in the HF module tree, whether it uses rotary embeddings, and how one
decoder layer is called with a stage-local KV cache. The stage runs a per-layer loop with
these adapters instead of the stock base-model forward, which breaks on trimmed layer lists
(GPT-2 always adds learned positions; Qwen2 indexes ``layer_types`` with local indices).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import (
    GPT2LMHeadModel,
    LlamaForCausalLM,
    MistralForCausalLM,
    PreTrainedConfig,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from meshnet_common.errors import UnsupportedArchitecture
from meshnet_common.models.checkpoint import SUPPORTED_ARCHITECTURES

FULL = "full_attention"
SLIDING = "sliding_attention"

LayerCall = Callable[..., torch.Tensor]


def _call_decoder_layer(layer, hidden, *, mask, position_ids, cache, position_embeddings):
    # transformers 5.x: the keyword is `cache=`; decoder layers return a tensor.
    return layer(
        hidden,
        attention_mask=mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
        position_embeddings=position_embeddings,
    )


def _call_gpt2_block(layer, hidden, *, mask, position_ids, cache, position_embeddings):
    # GPT-2 blocks take the cache positionally before the mask, and have no rotary.
    return layer(hidden, cache, mask, use_cache=True, position_ids=position_ids)


@dataclass(frozen=True)
class SessionContext:
    """What one session brings to a batched decode step: its cache, mask, positions."""

    cache: Cache
    mask: torch.Tensor | None
    position_ids: torch.Tensor  # (1, 1)
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None


def _batched_decoder_layer(layer, hidden, sessions: list[SessionContext]) -> torch.Tensor:
    """One decode token for each of B sessions: norms and MLP run batched (B, 1, H), each
    session's attention runs against its own cache. Mirrors LlamaDecoderLayer.forward."""
    residual = hidden
    normed = layer.input_layernorm(hidden)
    attended = torch.cat(
        [
            layer.self_attn(
                hidden_states=normed[b : b + 1],
                attention_mask=ctx.mask,
                position_ids=ctx.position_ids,
                cache=ctx.cache,
                use_cache=True,
                position_embeddings=ctx.position_embeddings,
            )[0]
            for b, ctx in enumerate(sessions)
        ]
    )  # (B, 1, H)
    hidden = residual + attended
    residual = hidden
    return residual + layer.mlp(layer.post_attention_layernorm(hidden))


def _batched_gpt2_block(layer, hidden, sessions: list[SessionContext]) -> torch.Tensor:
    """GPT2Block.forward for B sessions' decode tokens (no cross-attention)."""
    residual = hidden
    normed = layer.ln_1(hidden)
    attended = torch.cat(
        [
            layer.attn(
                normed[b : b + 1],
                cache=ctx.cache,
                attention_mask=ctx.mask,
                use_cache=True,
                position_ids=ctx.position_ids,
            )[0]
            for b, ctx in enumerate(sessions)
        ]
    )  # (B, 1, H)
    hidden = attended + residual
    residual = hidden
    return residual + layer.mlp(layer.ln_2(hidden))


@dataclass(frozen=True)
class FamilyAdapter:
    """How one architecture's modules are found and called."""

    family: str
    model_class: type[nn.Module]
    base_attr: str  # attribute of the *ForCausalLM holding the base model
    layers_attr: str
    embed_attr: str
    position_embed_attr: str | None  # learned absolute positions (GPT-2)
    norm_attr: str
    rotary: bool
    call_layer: LayerCall
    call_layer_batched: Callable[..., torch.Tensor]

    def layer_types(self, config: PreTrainedConfig) -> list[str]:
        """Attention type of every global layer (full or sliding window)."""
        n = config.num_hidden_layers
        declared = getattr(config, "layer_types", None)
        if declared:
            return list(declared[:n])
        if self.family == "mistral" and getattr(config, "sliding_window", None):
            return [SLIDING] * n
        return [FULL] * n


ADAPTERS: dict[str, FamilyAdapter] = {
    "LlamaForCausalLM": FamilyAdapter(
        "llama", LlamaForCausalLM, "model", "layers", "embed_tokens", None, "norm", True,
        _call_decoder_layer, _batched_decoder_layer,
    ),
    "MistralForCausalLM": FamilyAdapter(
        "mistral", MistralForCausalLM, "model", "layers", "embed_tokens", None, "norm", True,
        _call_decoder_layer, _batched_decoder_layer,
    ),
    "Qwen2ForCausalLM": FamilyAdapter(
        "qwen2", Qwen2ForCausalLM, "model", "layers", "embed_tokens", None, "norm", True,
        _call_decoder_layer, _batched_decoder_layer,
    ),
    "Qwen3ForCausalLM": FamilyAdapter(
        "qwen3", Qwen3ForCausalLM, "model", "layers", "embed_tokens", None, "norm", True,
        _call_decoder_layer, _batched_decoder_layer,
    ),
    "GPT2LMHeadModel": FamilyAdapter(
        "gpt2", GPT2LMHeadModel, "transformer", "h", "wte", "wpe", "ln_f", False,
        _call_gpt2_block, _batched_gpt2_block,
    ),
}  # fmt: skip

if set(ADAPTERS) != set(SUPPORTED_ARCHITECTURES):  # keep common's naming table in step
    raise RuntimeError("family adapters and checkpoint naming disagree")


def adapter_for(config: PreTrainedConfig) -> FamilyAdapter:
    """The adapter for ``config``'s architecture, or UnsupportedArchitecture."""
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else None
    adapter = ADAPTERS.get(arch)
    if adapter is None:
        raise UnsupportedArchitecture(
            f"unsupported architecture {arch!r}; supported: {', '.join(sorted(ADAPTERS))}"
        )
    return adapter


def build_masks(
    stage_config: PreTrainedConfig,
    layer_types: list[str],
    hidden: torch.Tensor,
    cache: Cache,
    position_ids: torch.Tensor,
    first_layer: int = 0,
) -> dict[str, torch.Tensor | None]:
    """One attention mask per attention type among the stage's layers ``first_layer..``.

    Must run before the layers append this chunk to the cache: mask sizes come from the
    cache's current length, read from the first layer of each type that this session runs
    (layers before ``first_layer`` are never run for it and their cache slots stay empty).
    """
    masks: dict[str, torch.Tensor | None] = {}
    for layer_type, make_mask in (
        (FULL, create_causal_mask),
        (SLIDING, create_sliding_window_causal_mask),
    ):
        local = [i for i in range(first_layer, len(layer_types)) if layer_types[i] == layer_type]
        if local:
            masks[layer_type] = make_mask(
                config=stage_config,
                inputs_embeds=hidden,
                attention_mask=None,
                cache=cache,
                position_ids=position_ids,
                layer_idx=local[0],
            )
    return masks

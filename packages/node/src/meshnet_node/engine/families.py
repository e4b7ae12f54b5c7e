"""Model-family adapters: the only place that knows how each family names and calls things.

Each supported architecture has one ``FamilyAdapter``: where the layer list, embeddings and
final norm live in the HF module tree, whether it uses rotary embeddings, and how one
decoder layer is called with a stage-local KV cache. The stage runs a per-layer loop with
these adapters instead of the stock base-model forward, which breaks on trimmed layer lists
(GPT-2 always adds learned positions; Qwen2 indexes ``layer_types`` with local indices).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import (
    DeepseekV3ForCausalLM,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Glm4MoeForCausalLM,
    GPT2LMHeadModel,
    GptOssForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    Phi3ForCausalLM,
    PreTrainedConfig,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from meshnet_common.errors import UnsupportedArchitecture
from meshnet_common.models.checkpoint import SUPPORTED_ARCHITECTURES
from meshnet_node.engine.row_attention import RowAttention, attend_together, together_ok

FULL = "full_attention"
SLIDING = "sliding_attention"

LayerCall = Callable[..., torch.Tensor]
attend_rows = RowAttention()  # a batched step's attention: per row, projections batched


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


class RowMasks:
    """The attention masks of one row of a batched pass, each built the first time a layer
    of its type asks for it, from the row's cache as it is at that moment.

    Built lazily, a row's mask is the one a one-token step would build, also when several
    rows of a pass are positions of the same session (a verification pass, ADR-0019): row
    ``i`` reaches the first layer of a type after rows ``0..i-1`` went through it, so that
    layer's cache then holds exactly the positions before row ``i``."""

    __slots__ = ("_stage_config", "_layer_types", "_hidden", "_cache", "_position_ids",
                 "_first", "_built")  # fmt: skip

    def __init__(self, stage_config, layer_types, hidden, cache, position_ids, first=0):
        self._stage_config, self._layer_types = stage_config, layer_types
        self._hidden, self._cache, self._position_ids = hidden, cache, position_ids
        self._first = first
        self._built: dict[str, torch.Tensor | None] = {}

    def get(self, layer_type: str) -> torch.Tensor | None:
        if layer_type not in self._built:
            self._built[layer_type] = build_mask(
                self._stage_config, self._layer_types, layer_type, self._hidden, self._cache,
                self._position_ids, self._first,
            )  # fmt: skip
        return self._built[layer_type]


class SessionContext:
    """What one row brings to a batched decode pass: its session's cache, its mask (built
    when first needed, ``RowMasks``), positions and rotary embeddings."""

    __slots__ = ("cache", "position_ids", "position_embeddings", "_masks", "_layer_type")

    def __init__(self, cache: Cache, masks: RowMasks, layer_type: str, position_ids,
                 position_embeddings) -> None:  # fmt: skip
        self.cache = cache
        self.position_ids = position_ids  # (1, 1)
        self.position_embeddings = position_embeddings  # (cos, sin) or None
        self._masks, self._layer_type = masks, layer_type

    @property
    def mask(self) -> torch.Tensor | None:
        return self._masks.get(self._layer_type)


def row_contexts(
    adapter: FamilyAdapter, rotary: nn.Module | None, stage_config, layer_types: list[str],
    caches: list[Cache], hidden: torch.Tensor, position_ids: list[torch.Tensor], first: int,
) -> Callable[[str], list[SessionContext]]:  # fmt: skip
    """For a batched pass of one-token rows ``hidden`` (B, 1, H), row ``b`` of session cache
    ``caches[b]`` at ``position_ids[b]`` (1, 1): each row's ``SessionContext`` for a layer
    of a given attention type (masks built when a layer first needs them: ``RowMasks``)."""
    rows = []
    for b, cache in enumerate(caches):
        one = hidden[b : b + 1]
        masks = RowMasks(stage_config, layer_types, one, cache, position_ids[b], first)
        embeddings = adapter.position_embeddings(rotary, one, position_ids[b], layer_types[first:])
        rows.append((cache, masks, embeddings))

    def rows_for(layer_type: str) -> list[SessionContext]:
        return [SessionContext(cache, masks, layer_type, position_ids[b], embeddings[layer_type])
                for b, (cache, masks, embeddings) in enumerate(rows)]  # fmt: skip

    return rows_for


def _together(attn: nn.Module, hidden: torch.Tensor, sessions: list[SessionContext], **kwargs):
    """``attn`` run once for all rows (B, 1, H), each row attending to its own session's
    cache with the mask and rotary embeddings a one-token step gives it
    (``attend_together``); None where the module cannot (then nothing ran)."""
    masks = [ctx.mask for ctx in sessions]  # built before any row's cache grows
    rotary = sessions[0].position_embeddings
    if rotary is not None:
        rotary = tuple(torch.cat([ctx.position_embeddings[i] for ctx in sessions]) for i in (0, 1))
    position_ids = torch.cat([ctx.position_ids for ctx in sessions])  # (B, 1)

    def run(cache) -> torch.Tensor:
        if rotary is None:  # GPT-2: learned positions, no rotary argument
            return attn(hidden, cache=cache, attention_mask=None, position_ids=position_ids,
                        **kwargs)[0]  # fmt: skip
        return attn(hidden_states=hidden, attention_mask=None, position_ids=position_ids,
                    cache=cache, position_embeddings=rotary, **kwargs)[0]  # fmt: skip

    return attend_together(attn, [ctx.cache for ctx in sessions], masks, run)


def _batched_decoder_layer(layer, hidden, sessions: list[SessionContext]) -> torch.Tensor:
    """One decode token for each of B sessions: norms, MLP and the attention module run
    batched (B, 1, H), each session's row attending to its own cache (``_together``; row
    by row with batched projections where it cannot: ``attend_rows``). Mirrors
    LlamaDecoderLayer.forward."""
    residual = hidden
    normed = layer.input_layernorm(hidden)
    attended = None
    if together_ok(layer.self_attn, [ctx.cache for ctx in sessions]):
        attended = _together(layer.self_attn, normed, sessions, use_cache=True)
    if attended is None:

        def one(attn, row, b):
            ctx = sessions[b]
            return attn(hidden_states=row, attention_mask=ctx.mask, position_ids=ctx.position_ids,
                        cache=ctx.cache, use_cache=True,
                        position_embeddings=ctx.position_embeddings)[0]  # fmt: skip

        attended = attend_rows(layer.self_attn, normed, one)  # (B, 1, H)
    hidden = residual + attended
    residual = hidden
    return residual + layer.mlp(layer.post_attention_layernorm(hidden))


class SessionAttention(nn.Module):
    """Wraps a decoder layer's ``self_attn`` so that the whole layer can run a batched decode
    step: given ``meshnet_sessions`` (one ``SessionContext`` per row), the attention module
    runs once for all rows, each attending to its own session's cache with its own mask and
    positions (``_together``; where it cannot, row by row with batched projections:
    ``attend_rows``); norms, MLP and MoE routing run batched in the layer's own code.
    Without it, calls pass straight through.

    This keeps every family's decoder layer as transformers wrote it (Gemma's four norms,
    gpt-oss's router scores, Phi-3's dropouts) instead of mirroring each one here."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, *args, meshnet_sessions=None, **kwargs):
        if meshnet_sessions is None:
            return self.inner(hidden_states, *args, **kwargs)
        for name in ("attention_mask", "position_ids", "cache", "position_embeddings"):
            kwargs.pop(name, None)
        if together_ok(self.inner, [ctx.cache for ctx in meshnet_sessions]):
            attended = _together(self.inner, hidden_states, meshnet_sessions, **kwargs)
            if attended is not None:
                return attended, None

        def one(attn, row, b):
            ctx = meshnet_sessions[b]
            return attn(hidden_states=row, attention_mask=ctx.mask, position_ids=ctx.position_ids,
                        cache=ctx.cache, position_embeddings=ctx.position_embeddings,
                        **kwargs)[0]  # fmt: skip

        return attend_rows(self.inner, hidden_states, one), None


def attention_module(layer: nn.Module) -> nn.Module:
    """The transformers attention module of a decoder layer (inside its SessionAttention)."""
    attn = layer.self_attn if hasattr(layer, "self_attn") else layer.attn
    return attn.inner if isinstance(attn, SessionAttention) else attn


def _batched_any_layer(layer, hidden, sessions: list[SessionContext]) -> torch.Tensor:
    """B sessions' decode tokens through one decoder layer whose ``self_attn`` is a
    ``SessionAttention`` (installed by the loader)."""
    return layer(hidden, use_cache=True, meshnet_sessions=sessions)


def _batched_gpt2_block(layer, hidden, sessions: list[SessionContext]) -> torch.Tensor:
    """GPT2Block.forward for B sessions' decode tokens (no cross-attention)."""
    residual = hidden
    normed = layer.ln_1(hidden)
    attended = None
    if together_ok(layer.attn, [ctx.cache for ctx in sessions]):
        attended = _together(layer.attn, normed, sessions, use_cache=True)
    if attended is None:
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
    rotary_per_type: bool = False  # one rotary per attention type (Gemma 3: local/global)
    split_attention: bool = False  # batched decode through ``SessionAttention``
    moe: bool = False  # fused expert weights (3D parameters, not nn.Linear)

    def layer_types(self, config: PreTrainedConfig) -> list[str]:
        """Attention type of every global layer (full or sliding window)."""
        n = config.num_hidden_layers
        declared = getattr(config, "layer_types", None)
        if declared:
            return list(declared[:n])
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            return [SLIDING] * n  # Mistral, Mixtral: every layer slides when a window is set
        return [FULL] * n

    def position_embeddings(
        self, rotary: nn.Module | None, hidden: torch.Tensor, position_ids: torch.Tensor,
        layer_types: list[str],
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:  # fmt: skip
        """The rotary (cos, sin) each attention type among ``layer_types`` gets."""
        if rotary is None:
            return {t: None for t in set(layer_types)}
        if self.rotary_per_type:
            return {t: rotary(hidden, position_ids, t) for t in set(layer_types)}
        shared = rotary(hidden, position_ids)
        return {t: shared for t in set(layer_types)}


def final_logits(config: PreTrainedConfig, lm_head: nn.Module, hidden: torch.Tensor):
    """``lm_head`` and the final logit soft-cap of families that have one (Gemma 2/3)."""
    logits = lm_head(hidden)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


# Eager attention (transformers' choice for Gemma 2 and gpt-oss) holds a call's scores, rows
# x keys per head in float32: a prompt call is cut so that those of a prompt's first call
# stay within this (ADR-0053). SDPA computes them in blocks: no cut.
EAGER_SCORES_BYTES = 1 << 30


def eager_call_rows(config: PreTrainedConfig) -> int:
    """The most rows of a prompt call on a stage of ``config`` (unbounded: SDPA)."""
    if getattr(config, "_attn_implementation", None) != "eager":
        return 1 << 30
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 1)
    return math.isqrt(EAGER_SCORES_BYTES // (4 * heads))


def _decoder(family: str, model_class: type[nn.Module], **flags) -> FamilyAdapter:
    """A family whose layers, embeddings and norm sit where Llama's do (``model.layers`` ...)
    and whose decoder layers run unchanged, batched through ``SessionAttention``."""
    return FamilyAdapter(
        family, model_class, "model", "layers", "embed_tokens", None, "norm", True,
        _call_decoder_layer, _batched_any_layer, split_attention=True, **flags,
    )  # fmt: skip


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
    "Gemma2ForCausalLM": _decoder("gemma2", Gemma2ForCausalLM),
    "Gemma3ForCausalLM": _decoder("gemma3", Gemma3ForCausalLM, rotary_per_type=True),
    "Phi3ForCausalLM": _decoder("phi3", Phi3ForCausalLM),
    "MixtralForCausalLM": _decoder("mixtral", MixtralForCausalLM, moe=True),
    "Qwen2MoeForCausalLM": _decoder("qwen2_moe", Qwen2MoeForCausalLM, moe=True),
    "Qwen3MoeForCausalLM": _decoder("qwen3_moe", Qwen3MoeForCausalLM, moe=True),
    "DeepseekV3ForCausalLM": _decoder("deepseek_v3", DeepseekV3ForCausalLM, moe=True),
    "Glm4MoeForCausalLM": _decoder("glm4_moe", Glm4MoeForCausalLM, moe=True),
    "GptOssForCausalLM": _decoder("gpt_oss", GptOssForCausalLM, moe=True),
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
    return {
        layer_type: build_mask(
            stage_config, layer_types, layer_type, hidden, cache, position_ids, first_layer
        )
        for layer_type in (FULL, SLIDING)
        if layer_type in layer_types[first_layer:]
    }


def build_mask(
    stage_config: PreTrainedConfig,
    layer_types: list[str],
    layer_type: str,
    hidden: torch.Tensor,
    cache: Cache,
    position_ids: torch.Tensor,
    first_layer: int = 0,
) -> torch.Tensor | None:
    """The attention mask of the layers of ``layer_type`` (``build_masks``)."""
    make_mask = create_causal_mask if layer_type == FULL else create_sliding_window_causal_mask
    local = layer_types.index(layer_type, first_layer)
    return make_mask(
        config=stage_config,
        inputs_embeds=hidden,
        attention_mask=None,
        cache=cache,
        position_ids=position_ids,
        layer_idx=local,
    )

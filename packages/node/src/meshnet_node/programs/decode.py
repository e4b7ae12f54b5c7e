"""A decoder layer's one-token step as one flat function over the layer's own pieces.

transformers reaches a decoder layer's torch operations through a dozen module calls per
layer, each with its keyword plumbing, deprecation wrappers and hook checks, and a fused
projection's slices through ``FusedPart`` and ``FusedGroup.part``. On SmolLM2 (30 layers)
that is ~4 ms of a ~29 ms bf16 token on 2 cores (docs/adr/0041). A ``DecodeProgram`` makes
the calls the layer would make, in its order, on the same tensors:

- the layer's norms and activation by their own ``forward``;
- its projections as the stage installed them (row groups, packed kernels, bias); sibling
  projections as their fused group's one product, sliced as the group hands slices out;
- its family's ``apply_rotary_pos_emb`` and, for Qwen3, the q/k norms;
- the cache's ``update`` with the attention module's ``layer_idx``;
- the attention function transformers picks for the module at call time, with the keyword
  arguments the family passes.

So a step's output is the module path's, bit for bit, by construction (and tested against
it at SmolLM2's shapes). A program exists only for a layer whose class it mirrors
(Llama-shaped: Llama, Mistral, Qwen2, Qwen3) and that has no hooks; it runs only one-token
steps (``StageLayers`` decides); prompt chunks take the module path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from meshnet_node.kernels.fused_linears import FusedPart

Products = Callable[[torch.Tensor], list[torch.Tensor]]

# decoder layer class -> how its attention module passes the sliding window on
_LAYERS: dict[str, Callable[[nn.Module], dict]] = {
    "LlamaDecoderLayer": lambda attn: {},
    "MistralDecoderLayer": lambda attn: {
        "sliding_window": getattr(attn.config, "sliding_window", None)
    },
    "Qwen2DecoderLayer": lambda attn: {"sliding_window": attn.sliding_window},
    "Qwen3DecoderLayer": lambda attn: {"sliding_window": attn.sliding_window},
}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")


def siblings(modules: Sequence[nn.Module]) -> Products:
    """The outputs of sibling projections of one input, in order: their fused group's one
    product cut into contiguous slices as ``FusedGroup.part`` cuts it, or each member's own
    product where they are not one group."""
    group = getattr(modules[0], "group", None)
    if (
        group is not None
        and len(group.bounds) == len(modules)
        and all(
            isinstance(m, FusedPart) and m.group is group and m.index == i
            for i, m in enumerate(modules)
        )
    ):
        fused, bounds = group.fused.forward, group.bounds

        def sliced(x: torch.Tensor) -> list[torch.Tensor]:
            product = fused(x)
            return [product[..., a:b].contiguous() for a, b in bounds]

        return sliced
    forwards = [m.forward for m in modules]
    return lambda x: [forward(x) for forward in forwards]


def _hooked(layer: nn.Module) -> bool:
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
        for m in layer.modules()
    )  # fmt: skip


class DecodeProgram:
    """One Llama-shaped decoder layer's one-token step (LlamaDecoderLayer.forward and its
    attention and MLP modules' forwards, made as one function)."""

    __slots__ = ("attn", "eager", "layer_idx", "head_dim", "scaling", "extra", "norm1",
                 "norm2", "qkv", "q_norm", "k_norm", "rotary", "o", "gate_up", "act", "down")  # fmt: skip

    def __init__(self, layer: nn.Module, extra: dict) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        family = sys.modules[type(attn).__module__]
        self.attn, self.eager = attn, family.eager_attention_forward
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, attn.head_dim, attn.scaling
        self.extra = extra
        self.norm1 = layer.input_layernorm.forward
        self.norm2 = layer.post_attention_layernorm.forward
        self.qkv = siblings([attn.q_proj, attn.k_proj, attn.v_proj])
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = None if q_norm is None else q_norm.forward
        self.k_norm = None if k_norm is None else k_norm.forward
        rotary = family.apply_rotary_pos_emb  # a module where hub kernels may replace it
        self.rotary = rotary.forward if isinstance(rotary, nn.Module) else rotary
        self.o = attn.o_proj.forward
        self.gate_up = siblings([mlp.gate_proj, mlp.up_proj])
        self.act, self.down = mlp.act_fn.forward, mlp.down_proj.forward

    @classmethod
    def build(cls, layer: nn.Module) -> DecodeProgram | None:
        """The layer's program, or None where the layer is not one this mirrors."""
        extra = _LAYERS.get(type(layer).__name__)
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if extra is None or attn is None or mlp is None or layer.training or _hooked(layer):
            return None
        if not all(hasattr(attn, n) for n in _ATTENTION) or not all(hasattr(mlp, n) for n in _MLP):
            return None
        if (getattr(attn, "q_norm", None) is None) != (getattr(attn, "k_norm", None) is None):
            return None
        rotary = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
        if rotary is None or (isinstance(rotary, nn.Module) and _hooked(rotary)):
            return None
        return cls(layer, extra(attn))

    def __call__(self, hidden: torch.Tensor, cache, mask, position_embeddings) -> torch.Tensor:
        """``hidden`` (1, 1, H) -> the layer's output; appends the step to ``cache``;
        ``mask``: the layer's attention mask (None where the attention needs none)."""
        residual = hidden
        q, k, v = self._projected(self.norm1(hidden), *position_embeddings)
        k, v = cache.update(k, v, self.layer_idx)
        out, _ = self._attention()(self.attn, q, k, v, mask, dropout=0.0, scaling=self.scaling, **self.extra)  # fmt: skip
        return self._finish(residual, out)

    def rows(self, hidden: torch.Tensor, contexts: Sequence) -> torch.Tensor:
        """One-token steps of B distinct sessions (B, 1, H), as a batched step runs the
        layer with its attention module once for all rows (``attend_together``, ADR-0028):
        products, norms and rotary over all rows; each row's cache update and attention
        its own, with its mask built before any row's cache grows. ``contexts``: each
        row's ``SessionContext`` (cache, mask, rotary)."""
        residual = hidden
        cos = torch.cat([c.position_embeddings[0] for c in contexts])
        sin = torch.cat([c.position_embeddings[1] for c in contexts])
        q, k, v = self._projected(self.norm1(hidden), cos, sin)
        masks = [c.mask for c in contexts]
        attention, outs = self._attention(), []
        for b, context in enumerate(contexts):
            kb, vb = context.cache.update(k[b : b + 1], v[b : b + 1], self.layer_idx)
            outs.append(attention(self.attn, q[b : b + 1], kb, vb, masks[b], dropout=0.0,
                                  scaling=self.scaling, **self.extra)[0])  # fmt: skip
        return self._finish(residual, torch.cat(outs))

    def _projected(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries and keys (rotated; Qwen3: normed first) and values, (B, heads, 1, D)."""
        q, k, v = self.qkv(x)
        shape = (*x.shape[:-1], -1, self.head_dim)
        if self.q_norm is None:
            q, k = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2)
        else:
            q, k = self.q_norm(q.view(shape)).transpose(1, 2), self.k_norm(k.view(shape)).transpose(1, 2)  # fmt: skip
        q, k = self.rotary(q, k, cos, sin)
        return q, k, v.view(shape).transpose(1, 2)

    def _attention(self) -> Callable:
        """The attention function transformers picks for the module now."""
        return ALL_ATTENTION_FUNCTIONS.get_interface(self.attn.config._attn_implementation, self.eager)  # fmt: skip

    def _finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The output projection, the residuals and the MLP."""
        hidden = residual + self.o(attended.reshape(*residual.shape[:-1], -1).contiguous())
        gate, up = self.gate_up(self.norm2(hidden))
        return hidden + self.down(self.act(gate) * up)


def decode_programs(layers: Sequence[nn.Module]) -> list[DecodeProgram] | None:
    """A program for every layer of a stage, or None unless every layer has one."""
    programs = [DecodeProgram.build(layer) for layer in layers]
    if any(p is None for p in programs):
        return None
    return programs  # type: ignore[return-value]

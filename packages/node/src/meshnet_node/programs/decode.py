"""A decoder layer's one-token step as one flat function over the layer's own pieces.

transformers reaches a decoder layer's torch operations through a dozen module calls per
layer, each with its keyword plumbing, deprecation wrappers and hook checks, and a fused
projection's slices through ``FusedPart`` and ``FusedGroup.part``. On SmolLM2 (30 layers)
that is ~4 ms of a ~29 ms bf16 token on 2 cores (docs/adr/0041). A ``DecodeProgram`` makes
the calls the layer would make, in its order, on the same tensors:

- the layer's norms and activation by their own ``forward``;
- its projections as the stage installed them (row groups, packed kernels, bias); sibling
  projections as their fused group's one product, sliced as the group hands slices out;
- its family's ``apply_rotary_pos_emb`` and, for Qwen3 and Gemma 3, the q/k norms where
  the family applies them;
- the cache's ``update`` with the attention module's ``layer_idx``;
- the attention function transformers picks for the module at call time, with the keyword
  arguments the family passes.

So a step's output is the module path's, bit for bit, by construction (and tested against
it, at SmolLM2's shapes too). A program exists only for a layer whose class it mirrors
(``_LAYOUTS``: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3) and that has no
hooks; it runs one-token steps and batched steps of distinct sessions (``StageLayers``
decides); prompt chunks take the module path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from meshnet_node.engine.growing_cache import update_rows
from meshnet_node.kernels import packed, row_sdpa
from meshnet_node.kernels.fused_linears import FusedPart
from meshnet_node.programs.native import layer_step

Products = Callable[[torch.Tensor], list[torch.Tensor]]
_PENDING = object()  # a program's C++ step not looked for yet


@dataclass(frozen=True)
class Layout:
    """How a family's decoder layer is put together, as its forwards do it."""

    extra: Callable[[nn.Module], dict]  # keywords the attention passes to its function
    # q/k norms: "heads" (Qwen3: before the transpose), "moved" (Gemma 3: after it)
    qk_norm: str | None = None
    packed: bool = False  # Phi-3: one qkv_proj sliced as views; gate_up_proj chunked
    sandwich: bool = False  # Gemma 2/3: a norm after attention, and around the MLP


def _window(attn: nn.Module) -> dict:
    return {"sliding_window": attn.sliding_window}


def _config_window(attn: nn.Module) -> dict:
    return {"sliding_window": getattr(attn.config, "sliding_window", None)}


_LAYOUTS: dict[str, Layout] = {
    "LlamaDecoderLayer": Layout(lambda attn: {}),
    "MistralDecoderLayer": Layout(_config_window),
    "Qwen2DecoderLayer": Layout(_window),
    "Qwen3DecoderLayer": Layout(_window, qk_norm="heads"),
    "Phi3DecoderLayer": Layout(_config_window, packed=True),
    "Gemma2DecoderLayer": Layout(
        lambda attn: {**_window(attn), "softcap": attn.attn_logit_softcapping}, sandwich=True
    ),
    "Gemma3DecoderLayer": Layout(_window, qk_norm="moved", sandwich=True),
}
_PARTS = {  # what a layout reads of the attention module, the MLP and the layer
    False: (("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj", "act_fn")),
    True: (("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj", "activation_fn")),
}  # fmt: skip
_SANDWICH = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


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


def _views(module: nn.Module, q: int, k: int) -> Products:
    """One product's outputs as views ``[:q]``, ``[q:q+k]``, ``[q+k:]``: how Phi-3's
    attention cuts its ``qkv_proj``."""
    forward = module.forward

    def cut(x: torch.Tensor) -> list[torch.Tensor]:
        product = forward(x)
        return [product[..., :q], product[..., q : q + k], product[..., q + k :]]

    return cut


def _mlp(mlp: nn.Module, packed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's forward: ``down(act(gate) * up)``; Phi-3's ``down(up * act(gate))`` with
    gate and up the two halves of one product."""
    down = mlp.down_proj.forward
    if packed:
        gate_up, act = mlp.gate_up_proj.forward, mlp.activation_fn.forward

        def phi3(x: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up(x).chunk(2, dim=-1)
            return down(up * act(gate))

        return phi3
    gate_up, act = siblings([mlp.gate_proj, mlp.up_proj]), mlp.act_fn.forward

    def llama(x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(x)
        return down(act(gate) * up)

    return llama


def _hooked(layer: nn.Module) -> bool:
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
        for m in layer.modules()
    )  # fmt: skip


def _attention_of(layer: nn.Module) -> nn.Module | None:
    """The layer's transformers attention module (inside a node's ``SessionAttention``)."""
    attn = getattr(layer, "self_attn", None)
    return attn.inner if type(attn).__name__ == "SessionAttention" else attn


class DecodeProgram:
    """One decoder layer's one-token step: its forward and its attention and MLP modules'
    forwards, made as one function (``Layout``: the families it mirrors)."""

    __slots__ = ("attn", "eager", "layer_idx", "head_dim", "scaling", "extra", "norm1",
                 "norms", "qkv", "q_norm", "k_norm", "qk_norm", "rotary", "o", "mlp",
                 "native", "_layer", "layout", "_config", "_function")  # fmt: skip

    def __init__(self, layer: nn.Module, layout: Layout) -> None:
        attn, mlp = _attention_of(layer), layer.mlp
        # the layer's C++ step (native.py), looked for until the kernel module settles
        self.native, self._layer, self.layout = _PENDING, layer, layout
        self._config, self._function = None, None  # the attention function (_attention)
        family = sys.modules[type(attn).__module__]
        self.attn, self.eager = attn, family.eager_attention_forward
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, attn.head_dim, attn.scaling
        self.extra = layout.extra(attn)
        self.norm1 = layer.input_layernorm.forward
        names = _SANDWICH if layout.sandwich else ("post_attention_layernorm",)
        self.norms = tuple(getattr(layer, name).forward for name in names)
        if layout.packed:
            heads, kv_heads = attn.config.num_attention_heads, attn.num_key_value_heads
            self.qkv = _views(attn.qkv_proj, heads * attn.head_dim, kv_heads * attn.head_dim)
        else:
            self.qkv = siblings([attn.q_proj, attn.k_proj, attn.v_proj])
        self.qk_norm = layout.qk_norm
        self.q_norm = attn.q_norm.forward if layout.qk_norm else None
        self.k_norm = attn.k_norm.forward if layout.qk_norm else None
        rotary = family.apply_rotary_pos_emb  # a module where hub kernels may replace it
        self.rotary = rotary.forward if isinstance(rotary, nn.Module) else rotary
        self.o = attn.o_proj.forward
        self.mlp = _mlp(mlp, layout.packed)

    @classmethod
    def build(cls, layer: nn.Module) -> DecodeProgram | None:
        """The layer's program, or None where the layer is not one this mirrors."""
        layout = _LAYOUTS.get(type(layer).__name__)
        attn, mlp = _attention_of(layer), getattr(layer, "mlp", None)
        if layout is None or attn is None or mlp is None or layer.training or _hooked(layer):
            return None
        attention, feedforward = _PARTS[layout.packed]
        needs = [
            (attn, attention),
            (mlp, feedforward),
            (layer, _SANDWICH if layout.sandwich else ()),
        ]
        if layout.qk_norm:
            needs.append((attn, ("q_norm", "k_norm")))
        if not all(hasattr(m, name) for m, names in needs for name in names):
            return None
        rotary = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
        if rotary is None or (isinstance(rotary, nn.Module) and _hooked(rotary)):
            return None
        return cls(layer, layout)

    def __call__(self, hidden: torch.Tensor, cache, mask, position_embeddings) -> torch.Tensor:
        """``hidden`` (1, 1, H) -> the layer's output; appends the step to ``cache``;
        ``mask``: the layer's attention mask (None where the attention needs none)."""
        native = self.native if self.native is not _PENDING else self._native()
        if native is not None:  # the same calls from C++ (native.py)
            q, k, v = native.before(hidden, *position_embeddings)
        else:
            q, k, v = self._projected(self.norm1(hidden), *position_embeddings)
        k, v = cache.update(k, v, self.layer_idx)
        out, _ = self._attention()(self.attn, q, k, v, mask, dropout=0.0, scaling=self.scaling, **self.extra)  # fmt: skip
        return native.after(hidden, out) if native is not None else self._finish(hidden, out)

    def rows(self, hidden: torch.Tensor, contexts: Sequence) -> torch.Tensor:
        """One-token steps of B distinct sessions (B, 1, H), as a batched step runs the
        layer with its attention module once for all rows (``attend_together``, ADR-0028):
        products, norms and rotary over all rows; each row's cache update and attention
        its own, with its mask built before any row's cache grows. ``contexts``: each
        row's ``SessionContext`` (cache, mask, rotary)."""
        native = self.native if self.native is not _PENDING else self._native()
        cos = torch.cat([c.position_embeddings[0] for c in contexts])
        sin = torch.cat([c.position_embeddings[1] for c in contexts])
        if native is not None:
            q, k, v = native.before(hidden, cos, sin)
        else:
            q, k, v = self._projected(self.norm1(hidden), cos, sin)
        masks = [c.mask for c in contexts]
        kv = update_rows([c.cache for c in contexts], k, v, self.layer_idx)
        attention = self._attention()
        kwargs = {"dropout": 0.0, "scaling": self.scaling, **self.extra}
        # The function the module's config names (row_attention's wrapper keeps it in the
        # module: outside a batch it calls just that), from C++ for every row (ADR-0051).
        attended = row_sdpa.attend(self.attn, self.attn.__dict__.get("_meshnet_attention", attention),
                                   q, kv, masks, kwargs)  # fmt: skip
        if attended is None:
            attended = torch.cat([attention(self.attn, q[b : b + 1], kb, vb, masks[b], **kwargs)[0]
                                  for b, (kb, vb) in enumerate(kv)])  # fmt: skip
        return native.after(hidden, attended) if native is not None else self._finish(hidden, attended)  # fmt: skip

    def _native(self):
        """The layer's ``LayerStep`` once the kernel module is checked (None for good
        where it mirrors no such layer, or the module will not come); None meanwhile."""
        if not packed.settled():
            return None
        self.native = layer_step(self._layer, self.attn, self.layout)
        return self.native

    def _projected(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries and keys (rotated; normed first where the family norms them) and
        values, (B, heads, 1, D)."""
        q, k, v = self.qkv(x)
        shape = (*x.shape[:-1], -1, self.head_dim)
        if self.qk_norm == "heads":
            q, k = self.q_norm(q.view(shape)).transpose(1, 2), self.k_norm(k.view(shape)).transpose(1, 2)  # fmt: skip
        else:
            q, k = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2)
            if self.qk_norm == "moved":
                q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, cos, sin)
        return q, k, v.view(shape).transpose(1, 2)

    def _attention(self) -> Callable:
        """The attention function transformers picks for the module's config, found once
        per config object: reading a transformers config's attribute costs ~20 us, and a
        node sets each attention module's implementation once, at load (a module given
        another config is looked up again)."""
        config = self.attn.config
        if config is not self._config:
            self._function = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, self.eager)  # fmt: skip
            self._config = config
        return self._function

    def _finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The output projection, the residuals, the norms around them and the MLP."""
        out = self.o(attended.reshape(*residual.shape[:-1], -1).contiguous())
        if len(self.norms) == 1:  # Llama: pre-norms only
            hidden = residual + out
            return hidden + self.mlp(self.norms[0](hidden))
        post_attention, pre_mlp, post_mlp = self.norms  # Gemma's sandwich
        hidden = residual + post_attention(out)
        return hidden + post_mlp(self.mlp(pre_mlp(hidden)))


def decode_programs(layers: Sequence[nn.Module]) -> list[DecodeProgram] | None:
    """A program for every layer of a stage, or None unless every layer has one."""
    programs = [DecodeProgram.build(layer) for layer in layers]
    if any(p is None for p in programs):
        return None
    return programs  # type: ignore[return-value]

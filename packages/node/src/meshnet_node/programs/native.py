"""A decode program's layer in C++ around its attention (``LayerStep``, docs/adr/0043).

``layer_step.cpp`` makes a pre-norm layer's calls (RMS norms, products, views, rotary,
residuals, the gated MLP) from C++ in the order and with the arguments the Python program
makes them, so a step computes the same numbers with the same kernels without the
interpreter between them. Built only where the layer is exactly what the C++ mirrors:

- a plain pre-norm layout (Llama, Mistral, Qwen2: no q/k norms, no packed projections, no
  sandwich norms);
- both norms run transformers' ``LlamaRMSNorm.forward`` (the same code object's bytes, as
  every family that copies it has), the activation is ``nn.SiLU``, and the family's
  ``apply_rotary_pos_emb`` and ``rotate_half`` are Llama's code;
- the products are the int4 kernel of the built module (``Int4Weight`` whose one-row call
  reaches it), its Q8 kernel (``Q8Weight``: a GGUF's Q8_0 / Q6_K), or any other module,
  called back through its own ``forward``.

Anything else keeps the Python program; so does a process whose kernel module is not
built (yet): both give the same bits, so a stage may switch once it is.

The native engine (``NativeStack``, docs/adr/0044) runs every pass of a packed low-bit
stage through the same steps' ``native_before``/``native_after`` around the module's own
attention, in one C++ call: its own numbers, the same bits under any schedule.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama import modeling_llama

from meshnet_node.kernels import intpack, packed
from meshnet_node.kernels.fused_linears import FusedPart
from meshnet_node.lowbit.modules import PackedLinear
from meshnet_node.lowbit.packed import WIDE_ROWS, Int4Weight
from meshnet_node.lowbit.shipped import Q8Weight

logger = logging.getLogger(__name__)


def _same_code(a: Any, b: Any) -> bool:
    """Two functions whose compiled code is the same: the same operations on the same
    names and constants (a family's copy of Llama's function)."""
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return (
        ca is not None
        and cb is not None
        and (ca.co_code, ca.co_consts, ca.co_names) == (cb.co_code, cb.co_consts, cb.co_names)
    )


def _llama_norm(module: nn.Module) -> bool:
    return _same_code(type(module).forward, modeling_llama.LlamaRMSNorm.forward) and hasattr(
        module, "variance_epsilon"
    )


def _silu(act: nn.Module) -> bool:
    """``nn.SiLU``, or transformers' ``SiLUActivation`` (``F.silu`` of its input)."""
    return type(act) is nn.SiLU or _same_code(type(act).forward, SiLUActivation.forward)


def _function(obj: Any) -> Any:
    """The function behind a ``kernels`` function module (transformers wraps its rotary in
    one that calls the function unless a hub kernel is active for it: none here, no hub is
    asked), or ``obj`` itself."""
    if not isinstance(obj, nn.Module):
        return obj
    forward = type(obj).forward
    names, cells = forward.__code__.co_freevars, forward.__closure__ or ()
    inner = dict(zip(names, (c.cell_contents for c in cells), strict=True)).get("func")
    active = inner is not None and _active_hub_kernels(forward)
    return None if inner is None or active else inner


def _active_hub_kernels(forward: Any) -> bool:
    registry = forward.__globals__.get("_ACTIVE_KERNEL_FUNCS")
    return registry is not None and registry.get() is not None


def _llama_rotary(family: Any) -> bool:
    rotary = _function(getattr(family, "apply_rotary_pos_emb", None))
    rotate = getattr(family, "rotate_half", None)
    return rotary is not None and (
        _same_code(rotary, _function(modeling_llama.apply_rotary_pos_emb))
        and _same_code(rotate, modeling_llama.rotate_half)
        and rotary.__globals__.get("rotate_half") is rotate
    )


def _product(kernels: Any, module: nn.Module) -> Any:
    """``module``'s product: the int4 kernel where its one-row call reaches that kernel
    (its own forward for calls of more rows than ``WIDE_ROWS``: a prompt's pass may take a
    GEMM there), the Q8 kernel for a kept Q8_0 / Q6_K weight (every call), else its own
    forward."""
    weight = getattr(module, "packed", None)
    kept = type(module) is PackedLinear and type(weight) is Q8Weight
    if kept and hasattr(kernels.Product, "q8") and weight.q.device.type == "cpu":
        bias = None if module.bias is None else module.bias.detach()
        return kernels.Product.q8(weight.q, weight.d, bias, weight.z)
    if type(module) is PackedLinear and type(weight) is Int4Weight:
        block = intpack.int4_block_n(weight.out_features)
        if block in getattr(kernels, "int4_blocks", ()) and weight.packed.device.type == "cpu":
            bias = None if module.bias is None else module.bias.detach()
            return kernels.Product.int4(
                weight.packed, weight.scale_zero.contiguous(), weight.group, block,
                weight.in_features, weight.out_features, bias,
                wide=module.forward, wide_rows=WIDE_ROWS[weight.fmt],
            )  # fmt: skip
    return kernels.Product.python(module.forward)


def _siblings(kernels: Any, modules: list[nn.Module]) -> Any:
    """As ``decode.siblings``: the fused group's one product cut by its bounds, or each
    member's own."""
    group = getattr(modules[0], "group", None)
    if (
        group is not None
        and len(group.bounds) == len(modules)
        and all(
            isinstance(m, FusedPart) and m.group is group and m.index == i
            for i, m in enumerate(modules)
        )
    ):
        return kernels.Siblings(_product(kernels, group.fused), list(group.bounds))
    return kernels.Siblings([_product(kernels, m) for m in modules])


def layer_step(layer: nn.Module, attn: nn.Module, layout: Any) -> Any | None:
    """The layer's ``LayerStep``, or None where the C++ does not mirror it or the kernel
    module is not built and checked."""
    kernels = intpack.module()
    if kernels is None or not hasattr(kernels, "LayerStep"):
        return None
    if layer.input_layernorm.weight.device.type != "cpu":  # the C++ reads host memory
        return None
    if layout.packed or layout.sandwich or layout.qk_norm:
        return None
    mlp = layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not (all(_llama_norm(n) for n in norms) and _silu(mlp.act_fn)):
        return None
    if not _llama_rotary(sys.modules[type(attn).__module__]):
        return None
    return kernels.LayerStep(
        input_norm=norms[0].weight.detach(), input_eps=float(norms[0].variance_epsilon),
        post_norm=norms[1].weight.detach(), post_eps=float(norms[1].variance_epsilon),
        head_dim=attn.head_dim,
        qkv=_siblings(kernels, [attn.q_proj, attn.k_proj, attn.v_proj]),
        o=_product(kernels, attn.o_proj),
        gate_up=_siblings(kernels, [mlp.gate_proj, mlp.up_proj]),
        down=_product(kernels, mlp.down_proj),
    )  # fmt: skip


GROW = 64  # positions a layer's cache buffer holds beyond its rows when it moves


class NativeStack:
    """The native engine's layers of a stage (docs/adr/0044): each layer's ``LayerStep``
    around the kernel module's own attention, run for any rows in one call of
    ``native_stack`` (a prompt chunk's positions, one session's step, a batched step's
    sessions, a verification pass's drafts) that appends each row's keys and values to its
    cache (a buffer with room to grow, the cache's tensors views of it) and releases the
    GIL while the layers compute. Each row's result is the same bits whatever rows share
    its pass, the thread count or the split: every part computes a row alone in an order
    its code fixes. Its numbers are not transformers' (the attention is not torch's SDPA):
    the engine is only for packed low-bit stages (``native_stack``), whose reference is a
    dequantized model anyway."""

    def __init__(
        self, kernels: Any, steps: list, indices: list[int], scalings: list[float]
    ) -> None:
        self.run_stack = kernels.native_stack
        self.steps, self.indices, self.scalings = steps, indices, scalings

    def __len__(self) -> int:
        return len(self.steps)

    def __call__(self, first: int, hidden, cos, sin, groups) -> Any:
        """``hidden`` (N, 1, H): rows through layers ``first..``; ``cos``/``sin`` (N, 1, D)
        their rotary; ``groups``: consecutive rows of one session as ``(cache, count)``, in
        position order (row ``i`` of a group of ``count`` whose cache then holds ``n`` sees
        its first ``n - count + 1 + i`` positions)."""
        return self.run_stack(
            self.steps[first:], self.indices[first:], self.scalings[first:], hidden, cos, sin,
            [(cache, count) for cache, count in groups], GROW, WIDE_ROWS["int4"],
        )  # fmt: skip


def final_norm(norm: nn.Module | None, stack: NativeStack | None) -> Any | None:
    """A native stage's final norm through the kernel module's ``rms_norm``: transformers'
    ``LlamaRMSNorm.forward`` with its calls made from C++, the same bits (a decode step's
    ~8 ATen calls and the module's Python took ~0.1-0.15 ms after the layers' weights had
    gone through the caches); None where the stage is not native or the norm not Llama's."""
    if stack is None or norm is None or not _llama_norm(norm):
        return None
    run = getattr(intpack.module(), "rms_norm", None)
    if run is None:
        return None
    weight, eps = norm.weight, float(norm.variance_epsilon)
    return lambda hidden: run(hidden, weight, eps)


def _packed(layer: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in layer.modules())


def native_stack(layers, programs, layer_types) -> NativeStack | None:
    """The native engine's stack of a stage's layers, or None where it does not apply:
    layers with packed low-bit weights on the CPU, every one with a ``LayerStep``, full (not
    sliding) attention, head and hidden dimensions of whole 16-lane blocks. Waits for the
    kernel module (built once per machine): which engine a stage runs is settled before its
    first pass and never changes, so every pass of it computes alike."""
    if not layers or not all(_packed(layer) for layer in layers):
        return None
    if any(t != "full_attention" for t in layer_types):
        return None
    weight = next(p for p in layers[0].parameters())
    if weight.device.type != "cpu" or not packed.start(weight.device):
        return None
    if not packed.settled():
        logger.info("native engine: waiting for the kernel module's one-time build on this machine")
    if packed.wait() is None:
        return None
    kernels = intpack.module()
    if kernels is None or not hasattr(kernels, "native_stack"):
        return None
    steps = []
    for layer, program in zip(layers, programs, strict=True):
        step = layer_step(layer, program.attn, program.layout)
        whole = program.head_dim % 16 == 0 and layer.input_layernorm.weight.shape[-1] % 16 == 0
        if step is None or program.extra.get("sliding_window") is not None or not whole:
            return None
        steps.append(step)
    return NativeStack(kernels, steps, [p.layer_idx for p in programs], [p.scaling for p in programs])  # fmt: skip

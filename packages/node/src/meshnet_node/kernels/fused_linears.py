"""Sibling projections of one input multiplied as one product (docs/adr/0037).

An attention module projects its input three times (``q_proj``, ``k_proj``, ``v_proj``) and
a gated MLP twice (``gate_proj``, ``up_proj``), each a product with its own small weight. In
a decode step each product is one row against a weight the CPU reads from memory: its cost
is mostly starting the call (the weight's first cache lines, the OpenMP team, torch's
dispatch), not the arithmetic. ``fuse_siblings`` concatenates such a group's weights into
one ``nn.Linear`` and puts a ``FusedPart`` in each member's place: the first member called
with an input computes the whole group's product, the others take their slice of it. On a
2-core AMD EPYC (Zen 4) SmolLM2's 30 layers' projections took 15.7 ms a token as seven
products per layer and 13.7 ms as four (bench/README.md, "Fused projections").

A group is fused only where the fused product gives each row the members' own one-row
products, bit for bit: the first group of a shape is checked for every row count up to
``row_stable.MAX_ROWS`` on order-revealing inputs, with the torch threads the node computes
with, and the fused Linear carries the row limit found (ADR-0038); a shape whose one-row
product already differs stays apart, and the log says so once. Memory does not grow: the
members' weights become views of the fused one. A prompt chunk's rows (``in_prompt``) take
each member's own product of all rows, as the unsplit model does: fusing serves decode.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from meshnet_node.kernels.row_stable import grouped, in_prompt, row_limit

logger = logging.getLogger(__name__)
_apart: set[tuple] = set()  # shapes whose fused product differs (logged once each)

# Children of one module that read the same input, in the order families call them.
GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek's MLA: both read the layer's input
)


class FusedGroup:
    """One product for a group of sibling projections, handed out slice by slice.

    The product of the last input is kept per thread (passes of two threads never share a
    slice) until every member took its slice; a member called with another input computes
    the group's product for that one."""

    def __init__(self, fused: nn.Linear, sizes: Sequence[int]) -> None:
        self.fused = fused
        bounds, start = [], 0
        for size in sizes:
            bounds.append((start, start + size))
            start += size
        self.bounds = tuple(bounds)
        self._kept = threading.local()  # .input, .parts: the last product's slices

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        kept = self._kept
        parts = getattr(kept, "parts", None)
        if parts is None or kept.input is not x or parts[index] is None:
            product = self.fused(x)
            parts = [product[..., a:b].contiguous() for a, b in self.bounds]
            kept.input, kept.parts = x, parts
        out, parts[index] = parts[index], None
        if all(p is None for p in parts):
            kept.input = kept.parts = None  # nothing of this input left to hand out
        return out


class FusedPart(nn.Module):
    """Stands in for one member of a ``FusedGroup``: its slice of the group's product.

    ``weight`` and ``bias`` are views of the fused ones (plain attributes: the parameters
    are the fused module's, counted once)."""

    def __init__(self, group: FusedGroup, index: int) -> None:
        super().__init__()
        a, b = group.bounds[index]
        self.group, self.index = group, index
        self.weight = group.fused.weight.detach()[a:b]
        bias = group.fused.bias
        self.bias = None if bias is None else bias.detach()[a:b]
        self.in_features, self.out_features = group.fused.in_features, b - a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunk = in_prompt()
        if chunk:  # a prompt: the member's own product per chunk, as the unsplit model's
            return grouped(x, self.weight, self.bias, chunk)
        return self.group.part(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused"


def _members(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    children = module._modules
    found = [children.get(name) for name in names]
    if not all(type(child) is nn.Linear for child in found):
        return None
    first = found[0]
    same = all(
        c.in_features == first.in_features
        and c.weight.dtype is first.weight.dtype
        and c.weight.device == first.weight.device
        and (c.bias is None) == (first.bias is None)
        and not c._forward_hooks and not c._forward_pre_hooks
        for c in found
    )  # fmt: skip
    return found if same else None  # type: ignore[return-value]


def _stacked(members: Sequence[nn.Linear]) -> nn.Linear:
    first = members[0]
    fused = nn.Linear(first.in_features, sum(m.out_features for m in members),
                      bias=first.bias is not None, device="meta")  # fmt: skip
    with torch.inference_mode(False), torch.no_grad():  # plain tensors, as loaded weights
        fused.weight = nn.Parameter(torch.cat([m.weight for m in members]), requires_grad=False)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in members]), requires_grad=False)
    return fused


def _fused(members: Sequence[nn.Linear], threads: int) -> nn.Linear | None:
    """The members stacked into one Linear, if that shape's fused product gives each row the
    members' own one-row products with ``threads`` (``row_stable.row_limit``: checked once
    per shape, on an order-revealing probe of it). The Linear carries its row limit."""
    fused = _stacked(members)
    limit = row_limit(fused.weight, fused.bias, members, threads)
    if limit == 0:
        shape = (tuple(m.out_features for m in members), fused.in_features, fused.weight.dtype)
        if shape not in _apart:  # said once per shape
            _apart.add(shape)
            logger.info("projections %s x %d (%s) stay apart: a fused product differs", *shape)
        return None
    fused.row_limit = limit
    return fused


def _install(module: nn.Module, names: tuple[str, ...], fused: nn.Linear) -> None:
    sizes = [module._modules[name].out_features for name in names]
    group = FusedGroup(fused, sizes)
    module.add_module("fused_" + "_".join(names), fused)
    for index, name in enumerate(names):
        module._modules[name] = FusedPart(group, index)


def fuse_siblings(layers: Iterable[nn.Module], threads: int | None = None) -> int:
    """Fuse every group of ``GROUPS`` found among one module's ``nn.Linear`` children under
    ``layers``, where the fused product is checked to be the members' own with the torch
    threads the node computes with (``threads``; None: this thread's count). Returns how
    many groups were fused."""
    threads = threads or torch.get_num_threads()
    count = 0
    for layer in layers:
        for module in list(layer.modules()):
            for names in GROUPS:
                members = _members(module, names)
                fused = None if members is None else _fused(members, threads)
                if fused is not None:
                    _install(module, names, fused)
                    count += 1
    return count

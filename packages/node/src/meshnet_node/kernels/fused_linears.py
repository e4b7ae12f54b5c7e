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
    are the fused module's, counted once). A packed group's part keeps ``own`` instead, the
    member over its rows of the fused weight (a plain attribute too), and its ``packed``."""

    def __init__(self, group: FusedGroup, index: int, own: nn.Module | None = None) -> None:
        super().__init__()
        a, b = group.bounds[index]
        self.group, self.index = group, index
        self.in_features, self.out_features = group.fused.in_features, b - a
        self.__dict__["own"] = own  # not a child: its tensors are the fused module's
        if own is not None:
            self.packed = own.packed
            return
        self.weight = group.fused.weight.detach()[a:b]
        bias = group.fused.bias
        self.bias = None if bias is None else bias.detach()[a:b]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunk = in_prompt()
        if chunk:  # a prompt: the member's own product per chunk, as the unsplit model's
            own = self.__dict__["own"]
            return own(x) if own is not None else grouped(x, self.weight, self.bias, chunk)
        return self.group.part(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused"


def _members(module: nn.Module, names: tuple[str, ...]) -> list[nn.Module] | None:
    """The group's children if they can be one product: ``nn.Linear`` modules alike, or
    packed ones of one type (a ``stack`` classmethod: ``PackedLinear``)."""
    children = module._modules
    found = [children.get(name) for name in names]
    first = found[0]
    if first is None or any(type(child) is not type(first) for child in found):
        return None
    if any(c._forward_hooks or c._forward_pre_hooks for c in found):
        return None
    if type(first) is not nn.Linear:
        packed = callable(getattr(type(first), "stack", None))
        return found if packed and all(c.in_features == first.in_features for c in found) else None  # type: ignore[return-value]  # fmt: skip
    same = all(
        c.in_features == first.in_features
        and c.weight.dtype is first.weight.dtype
        and c.weight.device == first.weight.device
        and (c.bias is None) == (first.bias is None)
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
        _stays_apart(members, fused.weight.dtype)
        return None
    fused.row_limit = limit
    return fused


def _fused_packed(members: Sequence[nn.Module]) -> tuple[nn.Module, list[nn.Module]] | None:
    """Packed members stacked into one (``PackedLinear.stack``) and each over its rows of it,
    if the stacked product gives every member's outputs bit for bit on a probe of 1 and 3
    rows (the packed kernels sum each output on its own, whatever the rows: ADR-0031)."""
    made = type(members[0]).stack(members)
    if made is None:
        return None
    fused, parts = made
    dtype = next(t.dtype for t in fused.buffers() if t.is_floating_point())
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 3):
            x = torch.randn(rows, fused.in_features, generator=gen).to(dtype)
            if not torch.equal(fused(x), torch.cat([m(x) for m in members], dim=-1)):
                _stays_apart(members, dtype)
                return None
    return fused, parts


def _stays_apart(members: Sequence[nn.Module], dtype: torch.dtype) -> None:
    shape = (tuple(m.out_features for m in members), members[0].in_features, dtype)
    if shape not in _apart:  # said once per shape
        _apart.add(shape)
        logger.info("projections %s x %d (%s) stay apart: a fused product differs", *shape)


def _install(module: nn.Module, names: tuple[str, ...], fused: nn.Module,
             parts: Sequence[nn.Module] | None = None) -> None:  # fmt: skip
    sizes = [module._modules[name].out_features for name in names]
    group = FusedGroup(fused, sizes)
    module.add_module("fused_" + "_".join(names), fused)
    for index, name in enumerate(names):
        module._modules[name] = FusedPart(group, index, None if parts is None else parts[index])


def fuse_siblings(layers: Iterable[nn.Module], threads: int | None = None) -> int:
    """Fuse every group of ``GROUPS`` found among one module's ``nn.Linear`` (or packed)
    children under ``layers``, where the fused product is checked to be the members' own
    with the torch threads the node computes with (``threads``; None: this thread's count).
    Returns how many groups were fused."""
    threads = threads or torch.get_num_threads()
    count = 0
    for layer in layers:
        for module in list(layer.modules()):
            for names in GROUPS:
                members = _members(module, names)
                if members is None:
                    continue
                if type(members[0]) is nn.Linear:
                    fused = _fused(members, threads)
                    made = None if fused is None else (fused, None)
                else:
                    made = _fused_packed(members)
                if made is not None:
                    _install(module, names, *made)
                    count += 1
    return count

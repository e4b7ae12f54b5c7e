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

A group is fused only where the fused product is the members' own, bit for bit: each
output of a product is its own sum over the input, which no kernel here orders by the
weight's height, but that is checked, not assumed. Before the first group of a shape is
fused, ``bit_for_bit`` multiplies random inputs of 1 to 128 rows by its weights both ways,
with the torch threads the node computes with (a kernel may split a small weight's sums
between threads); groups of a shape that disagrees anywhere stay as they were, and the log
says so once. Memory does not grow: the members' weights become views of the fused one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Children of one module that read the same input, in the order families call them.
GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek's MLA: both read the layer's input
)
# A decode step, batched steps and verification passes .. a prompt chunk. Each row count
# and shape checked leaves oneDNN ~0.4 MB of compiled kernels (measured): a few, not all.
CHECK_ROWS = (1, 2, 3, 4, 8, 16, 32, 128)

_verdicts: dict[tuple, bool] = {}  # shape signature -> fused equals separate
_verdicts_lock = threading.Lock()


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


def _signature(members: Sequence[nn.Linear], threads: int) -> tuple:
    first = members[0].weight
    sizes = tuple(m.out_features for m in members)
    bias = members[0].bias is not None
    return (sizes, first.shape[1], first.dtype, first.device.type, bias, threads)


def bit_for_bit(parts: Sequence[nn.Linear], fused: nn.Linear, threads: int | None = None) -> bool:
    """Whether ``fused`` (the parts stacked) gives each part's own product, bit for bit, for
    random inputs of every row count in ``CHECK_ROWS``, computed with ``threads`` torch
    threads (None: this thread's count)."""
    weight = fused.weight
    gen = torch.Generator().manual_seed(0)
    sizes = [p.out_features for p in parts]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or before)
        for rows in CHECK_ROWS:
            x = torch.randn(1, rows, weight.shape[1], generator=gen)
            x = x.to(device=weight.device, dtype=weight.dtype)
            together = nn.functional.linear(x, weight, fused.bias).split(sizes, dim=-1)
            for part, got in zip(parts, together, strict=True):
                if not torch.equal(nn.functional.linear(x, part.weight, part.bias), got):
                    return False
    finally:
        torch.set_num_threads(before)
    return True


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
    """The members stacked into one Linear, if that shape's fused product is theirs with
    ``threads`` (checked on the first group of each shape, with its own weights)."""
    key = _signature(members, threads)
    with _verdicts_lock:
        verdict = _verdicts.get(key)
        if verdict is False:
            return None
        fused = _stacked(members)
        if verdict is None:
            verdict = _verdicts[key] = bit_for_bit(members, fused, threads)
            if not verdict:
                logger.info("projections %s x %d (%s) stay apart: a fused product differs",
                            key[0], key[1], key[2])  # fmt: skip
        return fused if verdict else None


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

"""The modules a packed layer runs: a Linear and a family's routed experts over packed weights.

Both keep the packed tensors as buffers (so ``.to(device)``, the meta check and memory counts
see them) and hand the arithmetic to ``PackedWeight.matmul``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from meshnet_node.lowbit.packed import PackedWeight, rows_of, stacked


def _hold(module: nn.Module, prefix: str, weight: PackedWeight) -> None:
    """Register a packed weight's tensors as ``module``'s buffers."""
    for name, tensor in weight.tensors().items():
        module.register_buffer(f"{prefix}{name}", tensor, persistent=False)


def _rebind(module: nn.Module, weights: dict[str, PackedWeight]) -> None:
    """Point each packed weight at ``module``'s buffers again, after ``.to()`` and friends
    replaced them (``_apply``)."""
    for prefix, weight in weights.items():
        for name in weight.tensors():
            setattr(weight, name, getattr(module, f"{prefix}{name}"))


class PackedLinear(nn.Module):
    """``nn.Linear`` over a packed weight (and GPT-2's ``Conv1D``, whose weight is stored
    transposed: it is packed as ``[out, in]`` like any other)."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        _hold(self, "packed_", weight)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def stack(
        cls, members: Sequence[PackedLinear]
    ) -> tuple[PackedLinear, list[PackedLinear]] | None:
        """Sibling projections of one input as one ``PackedLinear`` (``fused_linears``), and
        each member again over its rows of it (its own product, for prompt chunks). None:
        their weights do not stack."""
        if len({m.bias is None for m in members}) > 1:
            return None
        weight = stacked([m.packed for m in members])
        if weight is None:
            return None
        bias = None if members[0].bias is None else torch.cat([m.bias for m in members])
        fused, parts, start = cls(weight, bias), [], 0
        for member in members:
            end = start + member.out_features
            part_bias = None if bias is None else fused.bias.detach()[start:end]
            parts.append(cls(rows_of(weight, start, end), part_bias))
            start = end
        return fused, parts

    def hold(self, weight: PackedWeight) -> None:
        """Hold ``weight`` in place of the current one: the same matrix in another form
        (``lowbit.cuda_int4``), its tensors the module's buffers instead."""
        for name in self.packed.tensors():
            delattr(self, f"packed_{name}")
        self.packed = weight
        _hold(self, "packed_", weight)

    def _weights(self) -> dict[str, PackedWeight]:
        return {"packed_": self.packed}

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        _rebind(self, self._weights())
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (B*T, in)
        out = self.packed.matmul(rows)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.packed.fmt}"


class PackedExperts(nn.Module):
    """A family's routed experts (transformers' ``*Experts`` modules: Mixtral, Qwen2/3-MoE,
    DeepSeek-V3, GLM-4.5, gpt-oss) with one packed weight per expert and projection.

    Routing is the family module's: the same one-hot mask, the same order of experts and
    tokens, the same weighting and ``index_add_``; only the two products per expert read packed
    weights. ``gate_up`` holds each expert's parts of the first projection (gate then up, or
    one interleaved matrix for gpt-oss) joined along the output; the activation between the
    projections is the family module's own ``_apply_gate`` (its weights removed), so clamps,
    biases and GLU variants stay transformers'. A token computes only with its routed experts.
    """

    def __init__(
        self,
        family_module: nn.Module,
        gate_up: list[list[PackedWeight]],
        down: list[PackedWeight],
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        for name, _ in list(family_module.named_parameters(recurse=False)):
            delattr(family_module, name)  # the fused bf16 tensors this module replaces
        self.activation = family_module
        self.num_experts = len(down)
        self.gate_up, self.down = gate_up, down
        for e in range(self.num_experts):
            for p, part in enumerate(gate_up[e]):
                _hold(self, f"e{e}_gu{p}_", part)
            _hold(self, f"e{e}_down_", down[e])
        self.gate_up_bias = _frozen(gate_up_bias)  # (E, 2I) gpt-oss
        self.down_bias = _frozen(down_bias)  # (E, H)

    def _weights(self) -> dict[str, PackedWeight]:
        out = {}
        for e in range(self.num_experts):
            for p, part in enumerate(self.gate_up[e]):
                out[f"e{e}_gu{p}_"] = part
            out[f"e{e}_down_"] = self.down[e]
        return out

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        _rebind(self, self._weights())
        return self

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        parts = [part.matmul(x) for part in self.gate_up[e]]
        gate_up = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # (rows, 2I)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias[e].to(gate_up.dtype)
        out = self.down[e].matmul(self.activation._apply_gate(gate_up))  # (rows, H)
        if self.down_bias is not None:
            out = out + self.down_bias[e].to(out.dtype)
        return out

    def forward(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)  # (T, H)
        with torch.no_grad():
            # one class more than there are experts: some routers mark unused slots with E
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            mask = mask.permute(2, 1, 0)  # (E+1, k, T)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit:
            e = int(expert[0])
            if e == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            out = self._expert(e, hidden_states[token_idx])
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


def _frozen(tensor: torch.Tensor | None) -> nn.Parameter | None:
    return None if tensor is None else nn.Parameter(tensor, requires_grad=False)

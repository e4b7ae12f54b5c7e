"""What a layer range costs in memory, from the checkpoint: shared by node preflight and placement.

Quantization applies to the 2-D weights inside decoder layers (Linear / GPT-2 Conv1D);
embeddings, norms and biases stay at the compute precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.precision import Precision

# Loading briefly holds one extra tensor, plus allocator slack: keep a margin.
OVERHEAD_FRACTION = 0.10
OVERHEAD_MIN_BYTES = 64 * 1024**2


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


_SCALES = ("weight_scale_inv", "_scales")


def kv_elements_per_token_layer(config: dict) -> int:
    """K and V elements one token adds to one layer's cache, as the cache holds them.

    Multi-head latent attention (DeepSeek-V3, Kimi K2) caches one compressed latent per token
    and layer, shared by all heads: ``kv_lora_rank`` + the ``qk_rope_head_dim`` rotary key
    (576 elements for DeepSeek-V3, against 2 x 128 x 192 expanded)."""
    hidden = config.get("hidden_size", config.get("n_embd"))
    heads = config.get("num_attention_heads", config.get("n_head"))
    if config.get("kv_lora_rank"):
        return config["kv_lora_rank"] + config.get("qk_rope_head_dim", 0)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return 2 * kv_heads * head_dim


@dataclass(frozen=True)
class ModelCosts:
    """Per-layer parameter counts of one model, enough to price any layer range."""

    num_layers: int
    layer_quantizable: tuple[int, ...]  # numel of quantizable weights, per layer
    layer_other: tuple[int, ...]  # numel of everything else, per layer
    head_numel: int  # embeddings (and learned positions)
    tail_numel: int  # final norm + lm_head (or the tied embedding)
    tied_numel: int  # numel shared by head and tail when embeddings are tied
    kv_elements: int  # per token per layer
    moe: bool = False  # has expert weights (fused 3D tensors once loaded)

    def refusal(self, precision: Precision) -> str | None:
        """Why this model cannot be served at ``precision`` (None: it can)."""
        if self.moe and precision.is_quantized:
            return (
                f"{precision.value} is not supported for Mixture-of-Experts models yet: "
                "bitsandbytes quantizes nn.Linear layers only, and most of an MoE's weights are "
                "experts (fused 3D tensors), so the memory would not be saved; serve it in "
                "bfloat16 or float32"
            )
        return None

    @classmethod
    def from_index(cls, index: CheckpointIndex) -> ModelCosts:
        n = index.num_layers
        quantizable, other = [0] * n, [0] * n
        for name, info in index.tensors.items():
            layer = index.layer_of(name)
            if layer is None or layer >= n or name.endswith(_SCALES):
                continue  # scales of FP8 / MXFP4 weights are consumed when they dequantize
            numel = _numel(info.shape) * (2 if name.endswith("_blocks") else 1)  # 2 FP4 a byte
            if name.endswith(".weight") and len(info.shape) == 2:
                quantizable[layer] += numel
            else:
                other[layer] += numel
        head = index.tensors_for(LayerRange(0, 1))
        tail = index.tensors_for(LayerRange(n - 1, n))
        extras = lambda names: sum(  # noqa: E731 - tiny local helper
            _numel(index.tensors[t].shape) for t in names if index.layer_of(t) is None
        )
        shared = set(head) & set(tail)
        return cls(
            num_layers=n,
            layer_quantizable=tuple(quantizable),
            layer_other=tuple(other),
            head_numel=extras(head),
            tail_numel=extras(tail),
            tied_numel=sum(
                _numel(index.tensors[t].shape) for t in shared if index.layer_of(t) is None
            ),
            kv_elements=kv_elements_per_token_layer(index.config),
            moe=any(".experts." in name for name in index.tensors),
        )

    @cached_property
    def _prefix(self) -> tuple[list[int], list[int]]:
        """Prefix sums of the per-layer counts: a range is priced in O(1) (placement is hot)."""
        q, o = [0], [0]
        for layer_q, layer_o in zip(self.layer_quantizable, self.layer_other, strict=True):
            q.append(q[-1] + layer_q)
            o.append(o[-1] + layer_o)
        return q, o

    def weight_bytes(self, layers: LayerRange, precision: Precision) -> int:
        """Resident bytes of the range's tensors at ``precision``."""
        prefix_q, prefix_o = self._prefix
        q = prefix_q[layers.end] - prefix_q[layers.start]
        o = prefix_o[layers.end] - prefix_o[layers.start]
        if layers.is_head():
            o += self.head_numel
        if layers.is_tail(self.num_layers):
            o += self.tail_numel
            if layers.is_head():
                o -= self.tied_numel  # one tensor serves both roles
        lin = (
            precision.linear_bytes_per_param
            if precision.is_quantized
            else precision.other_bytes_per_param
        )
        return int(q * lin + o * precision.other_bytes_per_param)

    def kv_bytes(self, num_layers: int, tokens: int, precision: Precision) -> int:
        act_bytes = 4 if precision is Precision.FLOAT32 else 2
        return num_layers * tokens * self.kv_elements * act_bytes

    def shard_bytes(self, layers: LayerRange, precision: Precision, kv_tokens: int) -> int:
        """Everything a node needs for ``layers``: weights, KV budget and a load margin."""
        weights = self.weight_bytes(layers, precision)
        overhead = max(OVERHEAD_MIN_BYTES, int(OVERHEAD_FRACTION * weights))
        return weights + self.kv_bytes(len(layers), kv_tokens, precision) + overhead

    def max_layers_from(
        self, start: int, limit: int, memory_bytes: int, precision: Precision, kv_tokens: int
    ) -> int:
        """Largest k <= limit such that ``[start, start + k)`` fits in ``memory_bytes`` (0 if none)."""
        if self.refusal(precision) is not None:
            return 0
        lo, hi = 0, min(limit, self.num_layers - start)
        while lo < hi:  # shard_bytes grows with k: binary search
            mid = (lo + hi + 1) // 2
            if (
                self.shard_bytes(LayerRange(start, start + mid), precision, kv_tokens)
                <= memory_bytes
            ):
                lo = mid
            else:
                hi = mid - 1
        return lo

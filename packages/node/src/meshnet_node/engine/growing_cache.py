"""A session's KV cache that grows in place (docs/adr/0052).

transformers' ``DynamicLayer.update`` concatenates: every step copies the layer's whole
cache into a new tensor, so a token at position L costs O(L) copying per layer, per hop
(SmolLM2 at 2,000 positions: 15 MB a step on each stage of 10 layers, about as much memory
traffic as the stage's bf16 weights), and a batched step of 16 sessions spends ~10% of its
pass in those copies at 64 positions already.

``GrowingLayer`` keeps each of a full-attention layer's keys and values, once it holds
``FROM`` positions, in a buffer with room for ``GROW`` more, writes a step's rows into it
and hands out views of the positions held: a copy of the whole only every ``GROW``
positions. The views are what
attention reads, with the same bits as the contiguous tensors (torch's SDPA reads by
strides; the families' tests compare split against unsplit transformers bit for bit).
A crop keeps the buffer unless it would waste more than ``2 * GROW`` positions (a finished
session cut back to its cached blocks); sliding-window layers keep transformers' own.
The KV budget counts positions held; the room beyond is at most ``GROW`` positions a layer.

A batched decode step appends every row's one position at once (``update_rows``: one C++
call for all the rows of a layer, ``rows_grow`` in the packed module): its rows go into
buffers whatever their length, since there the per-row calls from Python, not the copies,
were the cost (~15 us a row and layer, 2.5 ms of a 16-session pass of 10 layers). A short
cache's buffer gets room for as many positions as it holds, up to ``GROW``: at most twice
what the KV budget counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import Cache, DynamicLayer

from meshnet_node.kernels import intpack

GROW = 128  # positions of room a buffer gets beyond what it holds (one prefix-cache block)
FROM = 256  # a layer holding fewer positions concatenates: at that length it costs less


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` whose keys and values are views of buffers with room to grow, once
    it holds ``FROM`` positions (below, a concatenation copies less than a view's set-up
    costs: ~5 us a call)."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None
    lane = False  # its buffers are a decode graph's lane (ADR-0056): a crop keeps them

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        buffer, keys = self._key_buffer, self.keys
        if buffer is not None and keys is not None and keys.data_ptr() == buffer.data_ptr():
            length = keys.shape[-2]
            end = length + key_states.shape[-2]
            if end <= buffer.shape[-2] and self.values.data_ptr() == self._value_buffer.data_ptr():  # type: ignore[union-attr]
                buffer.narrow(-2, length, end - length).copy_(key_states)
                self._value_buffer.narrow(-2, length, end - length).copy_(value_states)  # type: ignore[union-attr]
                self.keys = buffer.narrow(-2, 0, end)
                self.values = self._value_buffer.narrow(-2, 0, end)  # type: ignore[union-attr]
                return self.keys, self.values
        if not self.is_initialized or keys.dim() != key_states.dim() or (
            keys.shape[-2] + key_states.shape[-2] < FROM
        ):  # fmt: skip
            self._key_buffer = self._value_buffer = None
            return super().update(key_states, value_states)
        self.keys, self._key_buffer = _grown(keys, key_states)
        self.values, self._value_buffer = _grown(self.values, value_states)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if not self.is_initialized or self._key_buffer is None:
            return
        if (
            self._key_buffer.shape[-2] - self.keys.shape[-2] > 2 * GROW and not self.lane
        ):  # give the room back
            self.keys, self.values = self.keys.clone(), self.values.clone()
            self._key_buffer = self._value_buffer = None

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


def _grown(held: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer with ``held`` then ``new`` and room for ``GROW`` more positions, and the
    view of what it holds."""
    length, end = held.shape[-2], held.shape[-2] + new.shape[-2]
    buffer = new.new_empty((*new.shape[:-2], end + GROW, new.shape[-1]))
    buffer.narrow(-2, 0, length).copy_(held)
    buffer.narrow(-2, length, end - length).copy_(new)
    return buffer.narrow(-2, 0, end), buffer


def update_rows(caches: Sequence[Cache], keys: torch.Tensor, values: torch.Tensor,
                layer_idx: int, *args, **kwargs) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Row ``b`` of ``keys`` and ``values`` (B, kv_heads, 1, D) appended to ``caches[b]``'s
    layer ``layer_idx``, as ``caches[b].update(..., *args, **kwargs)`` appends it: each
    row's keys and values after the update. The rows' ``GrowingLayer``s (which take no
    arguments beyond the rows) take theirs in one call of the packed module; any other
    cache, or no module, the per-row updates."""
    layers = _growing(caches, layer_idx, keys, values)
    kernel = intpack.module() if layers is not None else None
    if kernel is None or not hasattr(kernel, "rows_grow"):
        return [cache.update(keys[b : b + 1], values[b : b + 1], layer_idx, *args, **kwargs)
                for b, cache in enumerate(caches)]  # fmt: skip
    held_k, held_v, buf_k, buf_v = kernel.rows_grow(
        keys, values, [layer.keys for layer in layers], [layer.values for layer in layers],
        [layer._key_buffer for layer in layers], [layer._value_buffer for layer in layers], GROW,
    )  # fmt: skip
    for layer, k, v, kb, vb in zip(layers, held_k, held_v, buf_k, buf_v, strict=True):
        layer.keys, layer.values, layer._key_buffer, layer._value_buffer = k, v, kb, vb
    return list(zip(held_k, held_v, strict=True))


def _growing(caches: Sequence[Cache], layer_idx: int, keys: torch.Tensor,
             values: torch.Tensor) -> list | None:  # fmt: skip
    """Each cache's layer ``layer_idx`` where the rows are one-token rows and every layer
    is a held ``GrowingLayer`` of their dtype and device in a plain ``DynamicCache`` (no
    offloading), else None."""
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[2] != 1 or values.shape[2] != 1:
        return None
    if keys.device.type != "cpu":  # the C++ copies host memory
        return None
    layers = []
    for cache in caches:
        if type(cache) is not DynamicCache or cache.offloading or len(cache.layers) <= layer_idx:
            return None
        layer = cache.layers[layer_idx]
        if type(layer) is not GrowingLayer or not layer.is_initialized:
            return None
        held = layer.keys
        if held.dim() != 4 or held.dtype != keys.dtype or held.device != keys.device:
            return None
        layers.append(layer)
    return layers


def session_cache(config: PreTrainedConfig) -> DynamicCache:
    """transformers' cache for ``config``, its full-attention layers growing in place."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]  # fmt: skip
    return cache

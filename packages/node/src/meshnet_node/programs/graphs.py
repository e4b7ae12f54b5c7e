"""A session's one-token decode steps replayed from a captured CUDA graph (docs/adr/0056).

On a GPU a decode step is launch-bound: each layer's ``DecodeProgram`` is ~20 kernel
launches, a few microseconds of Python and driver each, while the step's arithmetic takes
less. A captured graph replays the whole range of layers as one launch. A graph bakes in
the addresses and shapes it read and wrote, so a step is replayed only where they stay:

- the session's keys and values live in **buffers of a fixed capacity** (``bucket`` of
  the positions held: a function of the position alone, so every stage of a split and the
  unsplit model attend over the same capacity); a step writes its row at the position
  (``index_copy_`` from a position tensor) and attends over the whole buffer with a mask
  built in the graph from that tensor;
- the step's input and output are the graph's own tensors: the step copies into and out
  of them.

The session's cache stays transformers' ``DynamicCache`` of ``GrowingLayer``s: each layer's
``keys`` is the view of its buffer that the positions held fill, so every other pass
(prompt chunks, batched steps, drafts, crops) reads and writes the same buffers as before,
and a replay checks first that they are still the graph's (a layer that grew out of its
buffer, or was cut back, gets new ones and a new graph).

``Recorder`` is the one seam: ``CudaRecorder`` captures with ``torch.cuda.CUDAGraph``;
``EagerRecorder`` (any device) replays by running the body again, so the same bookkeeping
runs and is tested on a CPU. A stage whose capture fails (a torch operation that cannot be
captured, a family's rotary that reads a tensor's value) logs it once and runs its steps
as before.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from meshnet_node.programs.decode import DecodeProgram

logger = logging.getLogger(__name__)

SMALLEST = 256  # the smallest capacity: a buffer per layer of 256 positions
FULL = "full_attention"


def bucket(positions: int, limit: int | None = None) -> int:
    """The capacity of buffers holding ``positions``: the power of two at least as large,
    from ``SMALLEST``, at most ``limit`` (the model's context) when that is enough."""
    capacity = SMALLEST
    while capacity < positions:
        capacity *= 2
    return max(positions, min(capacity, limit)) if limit is not None else capacity


class Recorder(Protocol):
    """Makes a replayable step out of a body that reads and writes only tensors that
    outlive it."""

    def capture(self, body: Callable[[], None]) -> Callable[[], None]: ...


class CudaRecorder:
    """``torch.cuda.CUDAGraph`` captures sharing one memory pool: a stage's graphs run one
    at a time, on its compute thread, and keep nothing in the pool between replays (their
    inputs, outputs and caches are allocated outside it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        # A warm-up on a side stream first (cuBLAS and the allocator set up outside the
        # capture); it computes the step the replay then computes again, the same bits.
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            body()
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the node's other threads (the hop's copies) keep using the device
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            body()
        return graph.replay


class EagerRecorder:
    """Replays by running the body again: the graph path's bookkeeping on any device (the
    tests' CPU recorder). ``captures`` counts the graphs made."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        self.captures += 1
        return body


@dataclass(eq=False)
class _Graph:
    """One session's captured step from local layer ``first``: its own input, position and
    output tensors, and the buffers it writes."""

    first: int
    capacity: int
    hidden: torch.Tensor  # (1, 1, H)
    position_ids: torch.Tensor  # (1, 1) long
    out: torch.Tensor  # (1, 1, H)
    keys: list[torch.Tensor]  # each layer's key buffer (1, kv_heads, capacity, D), from first
    values: list[torch.Tensor]
    replay: Callable[[], None] = lambda: None
    holder: int = 0  # which binding to a session's cache holds it (0: none)

    def holds(self, layers: Sequence, position: int) -> bool:
        """Whether ``layers`` (from ``first``) still hold ``position`` positions in this
        graph's buffers."""
        for layer, kb, vb in zip(layers, self.keys, self.values, strict=True):
            keys, values = layer.keys, layer.values
            if (
                layer._key_buffer is not kb or layer._value_buffer is not vb
                or keys.data_ptr() != kb.data_ptr() or values.data_ptr() != vb.data_ptr()
                or keys.shape[-2] != position or values.shape[-2] != position
            ):  # fmt: skip
                return False
        return True


class _StaticKV:
    """What a ``DecodeProgram`` calls ``cache``: writes the step's keys and values at the
    position into the buffers and returns them whole (the mask hides what is past it)."""

    __slots__ = ("graph",)

    def __init__(self, graph: _Graph) -> None:
        self.graph = graph

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        graph = self.graph
        index = graph.position_ids[0]  # (1,)
        kb, vb = graph.keys[layer_idx - graph.first], graph.values[layer_idx - graph.first]
        kb.index_copy_(2, index, keys)
        vb.index_copy_(2, index, values)
        return kb, vb


class DecodeGraphs:
    """A stage's one-token steps, replayed from graphs where they can be.

    ``programs``: the stage's ``DecodeProgram``s (local layer order); ``layer_types``: each
    layer's attention type (graphs only where every layer a step runs is full attention);
    ``rotary``: ``(hidden, position_ids, layer_types) -> {type: (cos, sin)}``, the stage's
    position embeddings; ``limit``: the model's context.

    A graph and its buffers serve one session at a time. When the session's cache goes (its
    session closed) or outgrows them, they wait, up to ``IDLE`` per first layer and
    capacity, for the next session to copy its positions in: a stream of requests captures
    its graphs once."""

    IDLE = 2

    def __init__(
        self, programs: Sequence[DecodeProgram], layer_types: Sequence[str],
        rotary: Callable[[torch.Tensor, torch.Tensor, list[str]], dict], recorder: Recorder,
        limit: int | None = None,
    ) -> None:  # fmt: skip
        self.programs, self.layer_types = list(programs), list(layer_types)
        self.rotary, self.recorder, self.limit = rotary, recorder, limit
        self.broken = False  # a capture failed: steps run as before, for good
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> graph
        # (first, capacity) -> graphs no session holds; deques: a cache's finalizer may
        # give one back from whichever thread drops the cache
        self._idle: dict[tuple[int, int], deque[_Graph]] = {}
        self._holders = itertools.count(1)

    def step(self, hidden: torch.Tensor, position: int, cache, first: int) -> torch.Tensor | None:
        """``hidden`` (1, 1, H) at ``position`` through local layers ``first..``, appended
        to ``cache`` as a ``DecodeProgram`` step appends it: the output (1, 1, H), or None
        where this step cannot be replayed (the caller runs it as before)."""
        if self.broken or position < 1 or any(t != FULL for t in self.layer_types[first:]):
            return None
        layers = _held_layers(cache, first, position)
        if layers is None:
            return None
        capacity = bucket(position + 1, self.limit)
        graph = self._graphs.get(cache)
        if graph is None or graph.first != first or graph.capacity != capacity or not graph.holds(layers, position):  # fmt: skip
            graph = self._place(cache, layers, hidden, position, first, capacity)
            if graph is None:
                return None
        graph.hidden.copy_(hidden)
        graph.position_ids.fill_(position)
        graph.replay()
        end = position + 1
        for layer, kb, vb in zip(layers, graph.keys, graph.values, strict=True):
            layer.keys, layer.values = kb.narrow(-2, 0, end), vb.narrow(-2, 0, end)
        return graph.out.clone()

    def _place(self, cache, layers: list, hidden: torch.Tensor, position: int, first: int,
               capacity: int) -> _Graph | None:  # fmt: skip
        """An idle graph of ``capacity`` (else a new one) holding ``layers``' positions,
        the rest of its buffers zero, bound to ``cache`` in place of any it had."""
        idle = self._idle.setdefault((first, capacity), deque())
        try:
            graph = idle.pop()
        except IndexError:
            graph = self._capture(layers, hidden, position, first, capacity)
            if graph is None:
                return None
        rest = capacity - position
        for layer, kb, vb in zip(layers, graph.keys, graph.values, strict=True):
            for held, buffer in ((layer.keys, kb), (layer.values, vb)):
                buffer.narrow(-2, 0, position).copy_(held)
                buffer.narrow(-2, position, rest).zero_()
        for layer, kb, vb in zip(layers, graph.keys, graph.values, strict=True):
            layer._key_buffer, layer._value_buffer = kb, vb
            layer.keys, layer.values = kb.narrow(-2, 0, position), vb.narrow(-2, 0, position)
        old = self._graphs.get(cache)
        if old is not None:
            self._release(old, old.holder)
        graph.holder = next(self._holders)
        self._graphs[cache] = graph
        weakref.finalize(cache, self._release, graph, graph.holder)
        return graph

    def _release(self, graph: _Graph, holder: int) -> None:
        """``graph`` is free again, unless another holder has it since."""
        if graph.holder != holder:
            return
        graph.holder = 0
        idle = self._idle.setdefault((graph.first, graph.capacity), deque())
        if len(idle) < self.IDLE:
            idle.append(graph)

    def _capture(self, layers: list, hidden: torch.Tensor, position: int, first: int,
                 capacity: int) -> _Graph | None:  # fmt: skip
        """A new graph of ``capacity`` for steps from ``first`` (None, for good, where the
        step cannot be captured)."""
        keys, values = [], []
        for layer in layers:
            for held, into in ((layer.keys, keys), (layer.values, values)):
                into.append(held.new_zeros((*held.shape[:-2], capacity, held.shape[-1])))
        graph = _Graph(
            first, capacity, hidden.clone(),
            torch.full((1, 1), position, dtype=torch.long, device=hidden.device),
            torch.empty_like(hidden), keys, values,
        )  # fmt: skip
        try:
            graph.replay = self.recorder.capture(self._body(graph))
        except Exception:
            logger.warning("decode steps cannot be captured as a graph here; they run as before",
                           exc_info=True)  # fmt: skip
            self.broken = True
            return None
        return graph

    def _body(self, graph: _Graph) -> Callable[[], None]:
        """The step as one function of the graph's tensors."""
        programs, types = self.programs[graph.first :], self.layer_types[graph.first :]
        kv, rotary = _StaticKV(graph), self.rotary
        positions = torch.arange(graph.capacity, device=graph.hidden.device).view(1, 1, 1, -1)
        lowest = torch.finfo(graph.hidden.dtype).min

        def body() -> None:
            embeddings = rotary(graph.hidden, graph.position_ids, types)
            past = positions > graph.position_ids.view(1, 1, 1, 1)  # (1, 1, 1, capacity)
            mask = torch.zeros(past.shape, dtype=graph.hidden.dtype, device=past.device)
            mask = mask.masked_fill(past, lowest)
            state = graph.hidden
            for program, layer_type in zip(programs, types, strict=True):
                state = program(state, kv, mask, embeddings[layer_type])
            graph.out.copy_(state)

        return body


def _held_layers(cache, first: int, position: int) -> list | None:
    """``cache``'s layers from ``first``, where each holds ``position`` positions of full
    attention as (1, kv_heads, positions, D) tensors that a buffer can take."""
    layers = getattr(cache, "layers", None)
    if layers is None or getattr(cache, "offloading", False) or len(layers) <= first:
        return None
    held = layers[first:]
    for layer in held:
        keys = getattr(layer, "keys", None)
        if (
            not hasattr(layer, "_key_buffer") or not getattr(layer, "is_initialized", False)
            or keys is None or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[-2] != position
            or layer.values.shape[-2] != position
        ):  # fmt: skip
            return None
    return list(held)

"""One-token decode steps replayed from captured CUDA graphs (docs/adr/0056).

On a GPU a decode step is launch-bound: each layer's ``DecodeProgram`` is ~20 kernel
launches, a few microseconds of Python and driver each, while the step's arithmetic takes
less. A captured graph replays the whole range of layers as one launch. A graph bakes in
the addresses and shapes it read and wrote, so a step is replayed only where they stay:

- each session's keys and values live in a *lane*: buffers of a fixed capacity (``bucket``
  of the positions held: a function of the position alone, so every stage of a split and
  the unsplit model attend over the same capacity); a step writes its row at the position
  (``index_copy_`` from a position tensor) and attends over the whole buffer with a mask
  built in the graph from that tensor;
- a graph serves a tuple of lanes (one session's step, or a batched step of distinct
  sessions, a row each), whichever sessions hold them; the step's input and output are
  the graph's own tensors: the step copies into and out of them.

The session's cache stays transformers' ``DynamicCache`` of ``GrowingLayer``s: each layer's
``keys`` is the view of its lane's buffer that the positions held fill, so every other
pass (prompt chunks, drafts, crops) reads and writes the same buffers as before, and a
replay checks first that they are still the lane's (a layer that grew out of it, or was
cut back to a copy, takes another lane).

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
from collections import OrderedDict, deque
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
class _Lane:
    """KV buffers of ``capacity`` positions for local layers ``first..`` of one session at
    a time (``holder``: which binding to a session's cache holds it; 0: none)."""

    first: int
    capacity: int
    keys: list[torch.Tensor]  # each layer's key buffer (1, kv_heads, capacity, D)
    values: list[torch.Tensor]
    holder: int = 0

    def holds(self, layers: Sequence, position: int) -> bool:
        """Whether ``layers`` (from ``first``) still hold ``position`` positions in these
        buffers."""
        for layer, kb, vb in zip(layers, self.keys, self.values, strict=True):
            keys, values = layer.keys, layer.values
            if (
                layer._key_buffer is not kb or layer._value_buffer is not vb
                or keys.data_ptr() != kb.data_ptr() or values.data_ptr() != vb.data_ptr()
                or keys.shape[-2] != position or values.shape[-2] != position
            ):  # fmt: skip
                return False
        return True

    def bind(self, layers: Sequence, position: int) -> None:
        """Take ``layers``' ``position`` positions (the rest of the buffers zero) and make the
        buffers theirs."""
        rest = self.capacity - position
        for layer, kb, vb in zip(layers, self.keys, self.values, strict=True):
            for held, buffer in ((layer.keys, kb), (layer.values, vb)):
                buffer.narrow(-2, 0, position).copy_(held)
                buffer.narrow(-2, position, rest).zero_()
        for layer, kb, vb in zip(layers, self.keys, self.values, strict=True):
            layer._key_buffer, layer._value_buffer = kb, vb
            layer.keys, layer.values = kb.narrow(-2, 0, position), vb.narrow(-2, 0, position)
            layer.lane = True  # a rewind's crop keeps the buffers (a rejected guess or draft)


@dataclass(eq=False)
class _Graph:
    """A captured step of one row per lane: its own input, position and output tensors."""

    lanes: tuple[_Lane, ...]
    hidden: torch.Tensor  # (B, 1, H)
    position_ids: torch.Tensor  # (B, 1) long
    out: torch.Tensor  # (B, 1, H)
    replay: Callable[[], None] = lambda: None


class _RowKV:
    """What a ``DecodeProgram`` calls a row's ``cache``: writes the row's keys and values at
    its position into its lane and returns the buffers whole (the mask hides what is past
    the position)."""

    __slots__ = ("lane", "index")

    def __init__(self, lane: _Lane, index: torch.Tensor) -> None:
        self.lane, self.index = lane, index  # index: (1,) long, the row's position

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        lane = self.lane
        kb, vb = lane.keys[layer_idx - lane.first], lane.values[layer_idx - lane.first]
        kb.index_copy_(2, self.index, keys)
        vb.index_copy_(2, self.index, values)
        return kb, vb


@dataclass(frozen=True)
class _Row:
    """A row's ``SessionContext`` as ``DecodeProgram.rows`` reads it."""

    cache: _RowKV
    mask: torch.Tensor  # (1, 1, 1, capacity)
    position_embeddings: tuple[torch.Tensor, torch.Tensor]


class DecodeGraphs:
    """A stage's one-token steps, replayed from graphs where they can be: one session's
    step, or a batched step of distinct sessions (a row each).

    ``programs``: the stage's ``DecodeProgram``s (local layer order); ``layer_types``: each
    layer's attention type (graphs only where every layer a step runs is full attention);
    ``rotary``: ``(hidden, position_ids, layer_types) -> {type: (cos, sin)}``, the stage's
    position embeddings; ``limit``: the model's context.

    A session's keys and values live in a *lane* of buffers; a graph is captured for a
    tuple of lanes and replayed whatever sessions hold them. When a session's cache goes
    (its session closed) or outgrows its lane, the lane waits, up to ``IDLE`` per first
    layer and capacity, for the next session to copy its positions in: a stream of
    requests captures once, and a batch of the same sessions step after step replays one
    graph. At most ``GRAPHS`` graphs are kept (the least recently replayed go)."""

    IDLE = 2
    GRAPHS = 32

    def __init__(
        self, programs: Sequence[DecodeProgram], layer_types: Sequence[str],
        rotary: Callable[[torch.Tensor, torch.Tensor, list[str]], dict], recorder: Recorder,
        limit: int | None = None,
    ) -> None:  # fmt: skip
        self.programs, self.layer_types = list(programs), list(layer_types)
        self.rotary, self.recorder, self.limit = rotary, recorder, limit
        self.broken = False  # a capture failed: steps run as before, for good
        self._lanes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> lane
        # (first, capacity) -> lanes no session holds; deques: a cache's finalizer may give
        # one back from whichever thread drops the cache
        self._idle: dict[tuple[int, int], deque[_Lane]] = {}
        self._graphs: OrderedDict[tuple[int, ...], _Graph] = OrderedDict()  # by lanes' ids
        self._holders = itertools.count(1)

    def step(self, hidden: torch.Tensor, position: int, cache, first: int) -> torch.Tensor | None:
        """``hidden`` (1, 1, H) at ``position`` through local layers ``first..``, appended
        to ``cache`` as a ``DecodeProgram`` step appends it: the output (1, 1, H), or None
        where this step cannot be replayed (the caller runs it as before)."""
        return self.rows(hidden, [position], [cache], first)

    def rows(self, hidden: torch.Tensor, positions: Sequence[int], caches: Sequence,
             first: int) -> torch.Tensor | None:  # fmt: skip
        """One-token steps of distinct sessions, row ``b`` of ``hidden`` (B, 1, H) at
        ``positions[b]`` appended to ``caches[b]``, through local layers ``first..``: the
        output (B, 1, H), or None where they cannot be replayed."""
        if self.broken or any(t != FULL for t in self.layer_types[first:]):
            return None
        if min(positions) < 1 or len({id(c) for c in caches}) != len(caches):
            return None
        held = [_held_layers(cache, first, p) for cache, p in zip(caches, positions, strict=True)]
        if any(layers is None for layers in held):
            return None
        lanes = []
        for cache, layers, position in zip(caches, held, positions, strict=True):
            lane = self._lanes.get(cache)
            capacity = bucket(position + 1, self.limit)
            if lane is None or lane.first != first or lane.capacity != capacity or not lane.holds(layers, position):  # fmt: skip
                lane = self._place(cache, layers, position, first, capacity)
            lanes.append(lane)
        graph = self._graph(tuple(lanes), hidden, positions)
        if graph is None:
            return None
        graph.hidden.copy_(hidden)
        graph.position_ids.copy_(torch.tensor(positions).view(-1, 1))
        graph.replay()
        for layers, lane, position in zip(held, lanes, positions, strict=True):
            end = position + 1
            for layer, kb, vb in zip(layers, lane.keys, lane.values, strict=True):
                layer.keys, layer.values = kb.narrow(-2, 0, end), vb.narrow(-2, 0, end)
        return graph.out.clone()

    def _place(self, cache, layers: list, position: int, first: int, capacity: int) -> _Lane:
        """An idle lane of ``capacity`` (else a new one) holding ``layers``' positions,
        bound to ``cache`` in place of any it had. That one is idle first: a session whose
        layers left their lane (a copy) takes it back, its graphs with it (copying a view of
        a buffer onto itself changes nothing)."""
        old = self._lanes.get(cache)
        if old is not None:
            self._release(old, old.holder)
        idle = self._idle.setdefault((first, capacity), deque())
        try:
            lane = idle.pop()
        except IndexError:
            lane = _Lane(first, capacity, *(
                [held.new_zeros((*held.shape[:-2], capacity, held.shape[-1])) for held in kind]
                for kind in ([lay.keys for lay in layers], [lay.values for lay in layers])
            ))  # fmt: skip
        lane.bind(layers, position)
        lane.holder = next(self._holders)
        self._lanes[cache] = lane
        weakref.finalize(cache, self._release, lane, lane.holder)
        return lane

    def _release(self, lane: _Lane, holder: int) -> None:
        """``lane`` is free again, unless another holder has it since; beyond ``IDLE`` idle
        ones it goes, with its graphs (popped whole: a finalizer may run on another
        thread)."""
        if lane.holder != holder:
            return
        lane.holder = 0
        idle = self._idle.setdefault((lane.first, lane.capacity), deque())
        if len(idle) < self.IDLE:
            idle.append(lane)
            return
        for key in [k for k in list(self._graphs) if id(lane) in k]:
            self._graphs.pop(key, None)

    def _graph(self, lanes: tuple[_Lane, ...], hidden: torch.Tensor,
               positions: Sequence[int]) -> _Graph | None:  # fmt: skip
        """The graph of a row per lane: kept, else captured (None, for good, where the step
        cannot be captured)."""
        key = tuple(id(lane) for lane in lanes)
        graph = self._graphs.get(key)
        if graph is not None and graph.lanes == lanes:
            self._graphs.move_to_end(key)
            return graph
        position_ids = torch.tensor(positions, device=hidden.device).view(-1, 1)
        graph = _Graph(lanes, hidden.clone(), position_ids, torch.empty_like(hidden))
        try:
            graph.replay = self.recorder.capture(self._body(graph))
        except Exception:
            logger.warning("decode steps cannot be captured as a graph here; they run as before",
                           exc_info=True)  # fmt: skip
            self.broken = True
            return None
        self._graphs[key] = graph
        while len(self._graphs) > self.GRAPHS:
            self._graphs.popitem(last=False)
        return graph

    def _body(self, graph: _Graph) -> Callable[[], None]:
        """The step as one function of the graph's tensors: one session's through each
        layer's program, a batch's through each program's rows."""
        types = self.layer_types[graph.lanes[0].first :]
        programs, rotary = self.programs[graph.lanes[0].first :], self.rotary
        device, dtype = graph.hidden.device, graph.hidden.dtype
        spans = [
            torch.arange(lane.capacity, device=device).view(1, 1, 1, -1) for lane in graph.lanes
        ]
        lowest = torch.finfo(dtype).min

        def body() -> None:
            embeddings = rotary(graph.hidden, graph.position_ids, types)
            masks, kvs = [], []
            for b, (lane, span) in enumerate(zip(graph.lanes, spans, strict=True)):
                index = graph.position_ids[b]  # (1,)
                past = span > index.view(1, 1, 1, 1)  # (1, 1, 1, capacity)
                masks.append(
                    torch.zeros(past.shape, dtype=dtype, device=device).masked_fill(past, lowest)
                )
                kvs.append(_RowKV(lane, index))
            state = graph.hidden
            if len(kvs) == 1:
                for program, layer_type in zip(programs, types, strict=True):
                    state = program(state, kvs[0], masks[0], embeddings[layer_type])
            else:
                rows = {t: [_Row(kv, mask, (cos[b : b + 1], sin[b : b + 1]))
                            for b, (kv, mask) in enumerate(zip(kvs, masks, strict=True))]
                        for t, (cos, sin) in embeddings.items()}  # fmt: skip
                for program, layer_type in zip(programs, types, strict=True):
                    state = program.rows(state, rows[layer_type])
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

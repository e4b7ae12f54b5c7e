"""A CPU shard's weights in one arena of 2 MiB pages (docs/adr/0048).

A decode step reads every weight of its stage once, a few hundred KiB per product spread
over pages of 4 KiB: a translation miss every 4 KiB, each a page walk, and two nested ones
in a virtual machine. torch's allocator asks for huge pages only for allocations of 2 MiB
and more (and only with ``THP_MEM_ALLOC_ENABLE``): a small model's packed projections are
0.2-1.1 MiB each. Here every parameter and buffer of the stage's modules moves into one
private anonymous mapping, aligned to 2 MiB and marked ``MADV_HUGEPAGE`` before its pages
are first touched, so the kernel backs it with huge pages where it has them (transparent
huge pages ``always`` or ``madvise``; ``never`` leaves ordinary pages, as before).
Measured on the 2-core AMX Xeon (KVM): SmolLM2 Q4_1's 120 int4 products of a token, cold,
2.71 -> 2.36 ms and 2.84 -> 2.49 ms (one process, interleaved).

Tensors keep their values, shapes, strides and which of them share memory (a fused
product's parts stay views of it): each storage is copied once, and every tensor over it
becomes the same view of the copy. Storages move one by one, and freed memory goes back
to the OS as the copies fill: memory does not double. Nothing moves off the CPU, nor anything small.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
SMALLEST = 64 << 10  # storages below this stay where they are
# Shards whose weights are fewer stay where they are: a few times what the TLB reaches on
# ordinary pages (~8 MiB), and the move's passing memory (one part-filled huge page, the
# storage in copy, what was freed since the last release) would be a large share of them.
LEAST_WEIGHTS = 64 << 20
ALIGN = 64  # each storage starts on a cache line (and on any element's alignment)


def _storages(modules: nn.Module) -> dict[int, int]:
    """The CPU storages of ``modules``' parameters and buffers worth moving: address ->
    bytes."""
    found: dict[int, int] = {}
    for tensor in [*modules.parameters(), *modules.buffers()]:
        if tensor.device.type != "cpu" or tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() >= SMALLEST:
            found.setdefault(storage.data_ptr(), storage.nbytes())
    return found


def hold_in_huge_pages(modules: nn.Module, release: Callable[[], None] | None = None) -> int:
    """Move ``modules``' weights into one huge-page arena; the bytes moved (0: nothing was,
    where the platform has no ``MADV_HUGEPAGE`` or the weights are under 64 MiB). ``release``
    hands freed memory back to the OS (``loader.release_freed_memory``): called every
    1/64th of the weights moved, so the old copies go back as the new ones fill (glibc keeps
    freed small blocks in its heap until then)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    storages = _storages(modules)
    total = sum(-(-n // ALIGN) * ALIGN for n in storages.values())
    if advice is None or total < LEAST_WEIGHTS:
        return 0
    arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arena.madvise(advice)  # before any page is touched: faults take huge pages
    except OSError as exc:  # a kernel without transparent huge pages: ordinary pages
        logger.info("weights stay in ordinary pages: %s", exc)
    base = torch.frombuffer(arena, dtype=torch.uint8)  # keeps the mapping alive
    start = (-base.data_ptr()) % HUGE_PAGE
    placed: dict[int, int] = {}  # old storage address -> its copy's byte offset in the arena
    every, since = max(HUGE_PAGE, total // 64), 0

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu" or tensor.is_meta:
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in storages:
            return tensor
        at = placed.get(key)
        if at is None:
            nonlocal start, since
            if release is not None and since >= every:
                release()  # the storages moved so far, back to the OS
                since = 0
            at = placed[key] = start
            nbytes = storage.nbytes()
            old = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
            base[at : at + nbytes].copy_(old)
            start += -(-nbytes // ALIGN) * ALIGN
            since += nbytes
        size = tensor.element_size()
        return torch.empty(0, dtype=tensor.dtype).set_(
            base.untyped_storage(), (at + tensor.storage_offset() * size) // size,
            tensor.size(), tensor.stride(),
        )  # fmt: skip

    with torch.no_grad():
        modules._apply(move)
        _plain_attributes(modules, move)
    return sum(storages.values())


def _plain_attributes(modules: nn.Module, move) -> None:
    """Tensors and modules a module keeps as plain attributes, outside its parameters,
    buffers and children (a fused product's parts: views of the fused weight,
    ``kernels.fused_linears.FusedPart``), moved as the rest: else they would keep the old
    memory alive beside its copy."""
    tree = set(modules.modules())
    for module in tree:
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                module.__dict__[name] = move(value)
            elif isinstance(value, nn.Module) and value not in tree:
                value._apply(move)

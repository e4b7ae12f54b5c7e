"""A node's chunk order (ADR-0053): the chunk whose turn comes gathers the rest of its prompt
call, waiting for chunks still on the way, and stops at the call's end or the prompt's last
(sampled) chunk; a chunk that overtook its session's opening waits for it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from meshnet_common.errors import Conflict, NotFound
from meshnet_node.dataplane.chunk_order import ChunkOrder
from meshnet_node.dataplane.steps import Step
from meshnet_node.settings import NodeSettings

QUICK = NodeSettings(turn_timeout_s=0.2, open_timeout_s=0.2)


def chunk(position: int, *, sample: bool = False, key: str = "k") -> Step:
    return Step("s", key, position, chunk=position // 128, sample=sample)


def rows(n: int = 128) -> torch.Tensor:
    return torch.zeros(1, n, 4)


def gathered(run) -> list[int]:
    return [member.req.position for member in run]


def test_a_call_waits_for_its_chunks_still_on_the_way():
    async def main() -> list[int]:
        order = ChunkOrder(lambda sid: object(), QUICK)
        first = order.enter(chunk(0), rows())
        order.enter(chunk(128), rows())
        gathering = asyncio.ensure_future(order.call_chunks(first, 1024))
        await asyncio.sleep(0.02)
        assert not gathering.done()  # chunk 256 (the prompt's last) is not here yet
        order.enter(chunk(256, sample=True), rows(44))
        await order.advance("s")
        return gathered(await gathering)

    assert asyncio.run(main()) == [0, 128, 256]


@pytest.mark.parametrize(("call", "want"), [(256, [0, 128]), (128, [0])])
def test_a_call_ends_at_its_size(call, want):
    async def main() -> list[int]:
        order = ChunkOrder(lambda sid: object(), QUICK)
        first = order.enter(chunk(0), rows())
        for position in (128, 256):
            order.enter(chunk(position, sample=position == 256), rows())
        return gathered(await order.call_chunks(first, call))

    assert asyncio.run(main()) == want


def test_a_chunk_of_another_key_is_not_taken_and_a_missing_one_times_out():
    async def main() -> None:
        order = ChunkOrder(lambda sid: object(), QUICK)
        first = order.enter(chunk(0), rows())
        order.enter(chunk(128, key="other"), rows())
        assert gathered(await order.call_chunks(first, 1024)) == [0]
        lone = order.enter(chunk(512), rows())
        with pytest.raises(Conflict, match="never arrived"):
            await order.call_chunks(lone, 1024)

    asyncio.run(main())


def test_a_chunk_that_overtook_the_opening_waits_for_it():
    async def main() -> None:
        sessions: dict[str, object] = {}
        order = ChunkOrder(sessions.get, QUICK)
        waiting = asyncio.ensure_future(order.wait_for_open(chunk(128)))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        sessions["s"] = object()  # the first chunk opened it
        await order.advance("s")
        await waiting
        with pytest.raises(NotFound):  # never opened: refused, and forgotten
            await order.wait_for_open(Step("gone", "k", 128, chunk=1))
        assert not order.watched("gone")

    asyncio.run(main())

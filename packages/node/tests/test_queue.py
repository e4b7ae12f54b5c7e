"""The wait queue of a head: bounded, with a deadline, fair between clients, FIFO within."""

from __future__ import annotations

import asyncio

import pytest

from meshnet_node.head.queue import QueueFull, RequestQueue


def test_turns_go_round_the_clients_and_keep_each_clients_order():
    async def run() -> list[str]:
        queue = RequestQueue(max_waiting=10, timeout_s=5, poll_s=60)
        order: list[str] = []

        async def request(client: str, name: str) -> None:
            await queue.wait(client, queue.clock() + 5)
            order.append(name)

        tasks = [asyncio.ensure_future(request(c, n)) for c, n in
                 [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1")]]  # fmt: skip
        await asyncio.sleep(0)
        assert queue.waiting == 5 and queue.busy()
        for _ in range(5):
            queue.wake()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert queue.waiting == 0
        return order

    assert asyncio.run(run()) == ["a1", "b1", "c1", "a2", "a3"]  # one client's burst waits


def test_a_request_that_found_no_room_keeps_its_place():
    async def run() -> list[str]:
        queue = RequestQueue(timeout_s=5, poll_s=60)
        order: list[str] = []

        async def request(name: str, again: bool) -> None:
            await queue.wait("a", queue.clock() + 5, again=again)
            order.append(name)

        late = asyncio.ensure_future(request("later", False))
        await asyncio.sleep(0)
        retry = asyncio.ensure_future(request("retried", True))
        await asyncio.sleep(0)
        queue.wake()
        await asyncio.sleep(0)
        queue.wake()
        await asyncio.gather(late, retry)
        return order

    assert asyncio.run(run()) == ["retried", "later"]


def test_a_full_queue_and_a_timeout_answer_503_with_retry_after():
    async def run() -> None:
        queue = RequestQueue(max_waiting=1, timeout_s=0.05, poll_s=60)
        first = asyncio.ensure_future(queue.wait("a", queue.clock() + 0.05))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as full:
            await queue.wait("b", queue.clock() + 1)
        assert full.value.status == 503 and full.value.code == "queue_full"
        assert int(full.value.headers["retry-after"]) >= 1
        with pytest.raises(QueueFull) as late:
            await first
        assert late.value.code == "queue_timeout" and queue.waiting == 0

    asyncio.run(run())


def test_the_poller_gives_turns_while_someone_waits():
    async def run() -> None:
        queue = RequestQueue(timeout_s=2, poll_s=0.01)
        await queue.wait("a", queue.clock() + 2)  # woken by the poller, nobody else
        assert queue.waiting == 0

    asyncio.run(run())

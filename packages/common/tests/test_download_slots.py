"""Shard downloads hold their slots for a bounded time, and a range's manifest is hashed
once however many ask for it at the same time (docs/adr/0032)."""

from __future__ import annotations

import asyncio
import threading

from fastapi import FastAPI
from fastapi.testclient import TestClient

from meshnet_common.layers import LayerRange
from meshnet_common.models import shardfiles
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.shardfiles import ShardSource
from meshnet_common.web.download_slots import (
    FLOOR_BYTES_PER_S,
    MIN_HOLD_S,
    PER_PEER,
    START_S,
    DownloadSlots,
)
from meshnet_common.web.http import install_error_handlers
from meshnet_common.web.shards import ShardServer, shards_router


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_slot_held_past_its_deadline_is_taken_back():
    clock = Clock()
    slots = DownloadSlots(2, clock=clock)
    first = slots.try_acquire(10)
    second = slots.try_acquire(100 * 2**20)  # 100 MiB: 100 s at the floor rate
    assert first and second and slots.try_acquire(10) is None
    slots.begin(first)
    slots.begin(second)
    slots.sent(second, 30 * 2**20)  # the second reader keeps the floor rate
    clock.now = MIN_HOLD_S  # the first reader stalled: its slot goes to the next
    assert slots.overdue(first) and not slots.overdue(second)
    third = slots.try_acquire(10)
    assert third is not None and slots.in_use == 2
    slots.release(first)  # late release of a reclaimed lease frees nothing twice
    assert slots.in_use == 2 and slots.try_acquire(10) is None
    assert slots.overdue(first)  # taken back: its download stops at its next chunk
    slots.release(second)
    assert slots.try_acquire(10) is not None


def test_a_reader_below_the_floor_rate_loses_its_slot_however_large_the_file():
    clock = Clock()
    slots = DownloadSlots(1, clock=clock)
    lease = slots.try_acquire(100 * 2**30)  # 100 GiB: the old deadline was 28 hours away
    slots.begin(lease)
    chunk = 1 << 16
    steps = 0
    while not slots.overdue(lease):  # a reader taking a 64 KiB chunk every second
        clock.now += 1.0
        slots.sent(lease, chunk)
        steps += 1
    # 64 KiB/s against a floor of 1 MiB/s: it falls MIN_HOLD_S behind in ~64 s
    assert steps <= MIN_HOLD_S / (1 - chunk / FLOOR_BYTES_PER_S) + 1
    assert slots.try_acquire(10) is not None  # its slot went to the next reader


def test_a_reader_at_the_floor_rate_keeps_its_slot_to_the_end():
    clock = Clock()
    slots = DownloadSlots(1, clock=clock)
    size = 600 * FLOOR_BYTES_PER_S
    lease = slots.try_acquire(size)
    slots.begin(lease)
    for _ in range(600):  # ten minutes at exactly the floor rate
        clock.now += 1.0
        assert not slots.overdue(lease)
        slots.sent(lease, FLOOR_BYTES_PER_S)
    assert not slots.overdue(lease)


def test_one_address_holds_at_most_its_share_of_slots():
    slots = DownloadSlots(4, per_peer=PER_PEER, clock=Clock())
    mine = [slots.try_acquire(10, peer="10.0.0.5") for _ in range(PER_PEER)]
    assert all(mine) and slots.try_acquire(10, peer="10.0.0.5") is None
    assert slots.try_acquire(10, peer="10.0.0.6") is not None  # others still get one
    slots.release(mine[0])
    assert slots.try_acquire(10, peer="10.0.0.5") is not None


def test_a_slot_whose_download_never_begins_is_taken_back_soon():
    clock = Clock()
    slots = DownloadSlots(1, clock=clock)
    lease = slots.try_acquire(100 * 2**20)  # its client left before the body started
    clock.now = START_S - 1
    assert slots.try_acquire(10) is None
    clock.now = START_S
    assert slots.overdue(lease) and slots.try_acquire(10) is not None


def test_waiting_for_a_slot_is_bounded():
    slots = DownloadSlots(1)
    held = slots.try_acquire(10)
    assert asyncio.run(slots.acquire(10, wait_s=0.2)) is None
    slots.release(held)
    assert asyncio.run(slots.acquire(10, wait_s=0.2)) is not None


def test_a_download_that_finds_no_slot_gets_503(tiny_snapshot, monkeypatch):
    monkeypatch.setattr("meshnet_common.web.download_slots.WAIT_S", 0.2)
    snapshot = tiny_snapshot("llama")
    app = FastAPI()
    install_error_handlers(app)
    app.state.shards = ShardServer(lambda _model: snapshot, max_concurrent=1)
    app.include_router(shards_router())
    params = {"model": "meshnet-tiny/llama", "start": 0, "end": 2, "file": "config.json"}
    with TestClient(app) as client:
        assert client.get("/v1/shards/download", params=params).status_code == 200
        app.state.shards.slots.try_acquire(10)  # a stalled reader holds the only slot
        resp = client.get("/v1/shards/download", params=params)
        assert resp.status_code == 503
        assert "download slot" in resp.json()["error"]["message"]


def test_a_manifest_is_hashed_once_for_concurrent_requests(tiny_snapshot, monkeypatch):
    source = ShardSource(
        CheckpointIndex.load(tiny_snapshot("llama")), "meshnet-tiny/llama", LayerRange(0, 3), "r"
    )
    passes = []
    original = shardfiles.ShardSource._compute_manifest

    def counted(self):
        passes.append(1)
        return original(self)

    monkeypatch.setattr(shardfiles.ShardSource, "_compute_manifest", counted)
    results = []
    threads = [threading.Thread(target=lambda: results.append(source.manifest()))
               for _ in range(8)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(passes) == 1 and len(results) == 8
    assert all(r is results[0] for r in results)

"""Manifests cost the peer that asks, not the server (docs/adr/0032): each (model, revision,
range) is hashed once and kept, however many other ranges were asked for since; a fresh one
is hashed inside a download slot, one at a time per peer; a peer whose fresh ones of the
window are used up gets 429. Windows are counted on a fake clock."""

from __future__ import annotations

import asyncio
import threading
from itertools import combinations
from pathlib import Path

import httpx
from fastapi import FastAPI

from meshnet_common.models import shardfiles
from meshnet_common.web.http import install_error_handlers
from meshnet_common.web.shards import (
    FRESH_PER_WINDOW,
    FRESH_WINDOW_S,
    ShardServer,
    shards_router,
)

MODEL = "meshnet-tiny/llama"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def shard_app(snapshot: Path) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.state.shards = ShardServer(lambda _model: snapshot, max_concurrent=2)
    app.include_router(shards_router())
    app.state.shards.fresh.clock = Clock()
    return app


def client(app: FastAPI, peer: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(peer, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://tracker.test")


def manifest_of(start: int, end: int) -> dict:
    return {"model": MODEL, "start": start, "end": end}


def test_a_range_is_hashed_once_however_many_other_ranges_were_asked_for(
    tiny_snapshot, monkeypatch
):
    app = shard_app(tiny_snapshot("llama"))
    passes = []
    original = shardfiles.ShardSource._compute_manifest

    def counted(self):
        passes.append((self.layers.start, self.layers.end))
        return original(self)

    monkeypatch.setattr(shardfiles.ShardSource, "_compute_manifest", counted)
    ranges = list(combinations(range(7), 2))  # every range of the 6 layers: 21 > 16 sources
    clock = app.state.shards.fresh.clock

    async def ask_all() -> None:
        async with client(app, "10.0.0.7") as peer:
            for _ in range(3):
                for start, end in ranges:
                    resp = await peer.get("/v1/shards/manifest", params=manifest_of(start, end))
                    assert resp.status_code == 200, resp.text
                    clock.now += FRESH_WINDOW_S  # each in a window of its own

    asyncio.run(ask_all())
    assert sorted(passes) == sorted(ranges)  # each once, not once per request


def test_a_fresh_manifest_takes_a_download_slot_and_a_peers_next_one_waits_its_turn(
    tiny_snapshot, monkeypatch
):
    app = shard_app(tiny_snapshot("llama"))
    slots = app.state.shards.slots
    entered, release = threading.Event(), threading.Event()
    original = shardfiles.ShardSource._compute_manifest
    hashing = []

    def held(self):
        hashing.append((self.layers.start, self.layers.end))
        entered.set()
        release.wait(30)
        return original(self)

    monkeypatch.setattr(shardfiles.ShardSource, "_compute_manifest", held)

    async def scenario() -> None:
        async with client(app, "10.0.0.7") as peer, client(app, "10.0.0.8") as other:
            first = asyncio.create_task(peer.get("/v1/shards/manifest", params=manifest_of(0, 2)))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            assert slots.in_use == 1  # the hashing holds a download slot
            second = asyncio.create_task(peer.get("/v1/shards/manifest", params=manifest_of(0, 3)))
            while app.state.shards.fresh.queued("10.0.0.7") < 2:  # the next one waits
                await asyncio.sleep(0.01)
            assert hashing == [(0, 2)] and not second.done() and slots.in_use == 1
            release.set()
            assert (await first).status_code == 200
            assert (await second).status_code == 200 and hashing == [(0, 2), (0, 3)]
            assert slots.in_use == 0
            assert (await other.get("/v1/shards/manifest", params=manifest_of(1, 3))).is_success

    asyncio.run(scenario())


def test_a_peer_gets_a_bounded_number_of_fresh_manifests_per_window(tiny_snapshot):
    app = shard_app(tiny_snapshot("llama"))
    clock = app.state.shards.fresh.clock
    ranges = list(combinations(range(7), 2))
    assert len(ranges) > FRESH_PER_WINDOW

    async def scenario() -> None:
        async with client(app, "10.0.0.7") as peer, client(app, "10.0.0.8") as other:
            for start, end in ranges[:FRESH_PER_WINDOW]:
                assert (
                    await peer.get("/v1/shards/manifest", params=manifest_of(start, end))
                ).is_success
            refused = await peer.get("/v1/shards/manifest", params=manifest_of(*ranges[-1]))
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "manifest_busy"
            cached = await peer.get("/v1/shards/manifest", params=manifest_of(*ranges[0]))
            assert cached.is_success  # a kept manifest costs nothing: always served
            assert (
                await other.get("/v1/shards/manifest", params=manifest_of(*ranges[-1]))
            ).is_success
            clock.now += FRESH_WINDOW_S
            assert (
                await peer.get("/v1/shards/manifest", params=manifest_of(*ranges[-2]))
            ).is_success

    asyncio.run(scenario())

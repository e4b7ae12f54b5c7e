"""Several trackers over one shared store (issue 53), in-process on one MemoryStore and a
fake clock: a node registered on one tracker is known to all, its heartbeats to any tracker
keep it alive, quarantines and layer counts hold everywhere, one elected leader places and
moves nodes, and another takes over when it stops.

Each tracker is a ``create_app`` app driven on this test's event loop (its lifespan entered
by hand, its requests through ``httpx.ASGITransport``); the heartbeat loop's work is run by
hand (``housekeeping``) as the fake clock moves. Store changes reach the other trackers
within a bounded number of event-loop turns (``settle``)."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from test_tracker_api import LLAMA, AppsTransport, announcement

from meshnet_common.metrics import Metrics
from meshnet_common.protocol import DirectiveKind, Heartbeat, NodeAnnouncement, Verdict
from meshnet_tracker.app import create_app, housekeeping
from meshnet_tracker.registry import MISSED_HEARTBEATS
from meshnet_tracker.settings import TrackerSettings
from meshnet_tracker.store import MemoryStore, StoreError, replica

INTERVAL_S = 100.0  # the real heartbeat loop never turns during a test: time is the fake's
TTL_S = MISSED_HEARTBEATS * INTERVAL_S


class Swarm:
    """Trackers sharing one MemoryStore on one fake clock."""

    def __init__(self, models_dir) -> None:
        self.now = 1000.0
        self.models_dir = models_dir
        self.store = MemoryStore(clock=self.clock)
        self.apps: dict[str, object] = {}
        self.secrets: dict[str, str] = {}

    def clock(self) -> float:
        return self.now

    @contextlib.asynccontextmanager
    async def tracker(self, name: str, node: FakeTrackerNode | None = None):
        """A tracker at http://NAME.test over the shared store, as an httpx client."""
        settings = TrackerSettings(
            models_dir=self.models_dir, verify_nodes=False, operator_token="op",
            advertise_url=f"http://{name}.test", heartbeat_interval_s=INTERVAL_S,
            move_grace_s=0.0,
        )  # fmt: skip
        app = create_app(settings, node, store=self.store, clock=self.clock)
        self.apps[f"{name}.test"] = app
        async with app.router.lifespan_context(app):
            state = app.state.tracker
            await state.client.aclose()  # trackers reach each other in-process
            state.client = httpx.AsyncClient(transport=AppsTransport(self.apps))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=settings.url) as client:
                client.state = state
                yield client
        del self.apps[f"{name}.test"]

    async def pass_time(self, seconds: float) -> None:
        self.now += seconds
        self.store.expire()
        await settle()

    async def register(
        self, tracker: httpx.AsyncClient, *, movable: bool = False, **kwargs
    ) -> httpx.Response:
        body = {**announcement(**kwargs), "movable": movable}
        headers = {"x-meshnet-node-secret": self.secrets.get(body["node_id"], "")}
        resp = await tracker.post("/v1/nodes/register", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        self.secrets[body["node_id"]] = resp.json()["node_secret"]
        await settle()
        return resp

    async def beat(self, tracker: httpx.AsyncClient, node_id: str, secret: str | None = None):
        secret = self.secrets.get(node_id, "") if secret is None else secret
        beat = {"node_id": node_id, "state": "serving", "active_sessions": 0, "kv_tokens": 0,
                "memory_free_bytes": 1 << 29}  # fmt: skip
        resp = await tracker.post(
            "/v1/nodes/heartbeat", json=beat, headers={"x-meshnet-node-secret": secret}
        )
        await settle()
        return resp


class FakeTrackerNode:
    """A tracker node serving ``layers`` of LLAMA at its tracker's address (no weights)."""

    def __init__(self, node_id: str, url: str, start: int, end: int) -> None:
        self.node_id = node_id
        self.metrics = Metrics()
        body = announcement(node_id, start, end, url=url)
        self._announcement = NodeAnnouncement.model_validate(body)

    def announcement(self) -> NodeAnnouncement:
        return self._announcement

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(node_id=self.node_id, state="serving", active_sessions=0,
                         kv_tokens=0, memory_free_bytes=1 << 29)  # fmt: skip

    def probe(self, urls) -> None:
        pass

    def attach(self, state) -> None:
        pass

    def install_data_path(self, app) -> None:
        pass

    def mount(self, app) -> None:
        pass

    def ws_max_size(self) -> int:
        return 1 << 20

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


async def settle(turns: int = 50) -> None:
    """Let the trackers' store watches run (each change takes a few loop turns)."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def node_ids(tracker: httpx.AsyncClient, model: str = LLAMA) -> set[str]:
    models = {m["id"]: m for m in (await tracker.get("/v1/coverage")).json()["models"]}
    return {n["node_id"] for n in models[model]["nodes"]} if model in models else set()


async def tick(*trackers: httpx.AsyncClient) -> None:
    for tracker in trackers:
        await housekeeping(tracker.state)
        await settle()


@pytest.fixture
def swarm(models_dir, tiny_snapshot) -> Swarm:
    tiny_snapshot("llama")  # the models dir holds it
    return Swarm(models_dir)


def test_a_node_registered_on_one_tracker_is_known_to_the_other(swarm):
    async def main():
        async with swarm.tracker("a") as a, swarm.tracker("b") as b:
            await swarm.register(a, node_id="n1", start=0, end=6)
            assert await node_ids(b) == {"n1"}
            dashboard = (await b.get("/v1/dashboard")).json()
            assert "n1" in str(dashboard)
            # its secret, issued by a, is asked by b: the 401 semantics hold there too
            assert (await swarm.beat(b, "n1", secret="wrong")).status_code == 401
            resp = await swarm.beat(b, "n1")
            assert resp.status_code == 200 and resp.json()["known"] is True
            # and nobody takes its id on b without it
            body = announcement(node_id="n1", url="http://thief.test:1")
            assert (await b.post("/v1/nodes/register", json=body)).status_code == 409

    asyncio.run(main())


def test_heartbeats_to_any_tracker_keep_a_node_and_silence_expires_it_everywhere(swarm):
    async def main():
        async with swarm.tracker("b") as b:
            async with swarm.tracker("a") as a:
                await swarm.register(a, node_id="kept", start=0, end=6)
                await swarm.register(a, node_id="silent", start=0, end=6)
                for _ in range(2 * MISSED_HEARTBEATS):  # "kept" beats to b only
                    await swarm.pass_time(INTERVAL_S)
                    assert (await swarm.beat(b, "kept")).json()["known"] is True
                    await tick(a, b)
                assert await node_ids(a) == await node_ids(b) == {"kept"}
                assert "silent" in {r.node_id for r in b.state.registry.lost(TTL_S)}
            # a stopped: b alone keeps the node's lease alive
            for _ in range(2 * MISSED_HEARTBEATS):
                await swarm.pass_time(INTERVAL_S)
                assert (await swarm.beat(b, "kept")).json()["known"] is True
                await tick(b)
            assert await node_ids(b) == {"kept"}
            assert await swarm.store.get("/meshnet/swarm/nodes/kept") is not None

    asyncio.run(main())


def test_a_tracker_nodes_layers_leave_the_map_with_its_tracker(swarm):
    async def main():
        async with swarm.tracker("b") as b:
            node = FakeTrackerNode("tn", "http://a.test", 0, 3)
            async with swarm.tracker("a", node) as a:
                await swarm.register(b, node_id="n2", start=0, end=6)
                await settle()
                assert await node_ids(b) == {"tn", "n2"}
                for _ in range(2 * MISSED_HEARTBEATS):  # a beats for its own node
                    await swarm.pass_time(INTERVAL_S)
                    await swarm.beat(b, "n2")
                    await tick(a, b)
                assert await node_ids(b) == {"tn", "n2"}
                # a dies: its node's lease runs out, the map covers [0, 3) from n2
                for _ in range(MISSED_HEARTBEATS + 1):
                    await swarm.pass_time(INTERVAL_S)
                    await swarm.beat(b, "n2")
                    await tick(b)
                assert await node_ids(b) == {"n2"}
                models = {m["id"]: m for m in (await b.get("/v1/coverage")).json()["models"]}
                assert models[LLAMA]["covered"] is True

    asyncio.run(main())


def test_a_tracker_stopping_takes_its_node_off_the_map_and_hands_the_lead_over(swarm):
    async def main():
        async with swarm.tracker("b") as b:
            async with swarm.tracker("a", FakeTrackerNode("tn", "http://a.test", 0, 3)) as a:
                await swarm.register(b, node_id="n2", start=0, end=6)
                assert await node_ids(b) == {"tn", "n2"}
                await b.state.election.resign()  # a leads (b stands aside one TTL)
                for _ in range(MISSED_HEARTBEATS):
                    await swarm.pass_time(INTERVAL_S)
                    await swarm.beat(b, "n2")
                    await tick(a)
                assert a.state.leads and not b.state.leads
            await settle()
            assert await node_ids(b) == {"n2"}  # at once, no lease to wait for
            await tick(b)  # a's lease would hold the lead one more TTL: a handed it over
            assert b.state.leads

    asyncio.run(main())


def test_a_quarantine_and_a_layer_count_made_on_one_tracker_hold_on_the_other(swarm):
    async def main():
        async with swarm.tracker("a") as a, swarm.tracker("b") as b:
            await swarm.register(a, node_id="bad", start=0, end=6)
            await swarm.register(a, node_id="good", start=0, end=6)
            await swarm.register(a, node_id="o1", model="other/model", num_layers=8, end=8)
            for reporter in ("h1", "h2"):
                verdict = Verdict(
                    model_id=LLAMA, reporter=reporter, shard_start=0, shard_end=6, error=1.0,
                    tolerance=0.1, witnesses=("good",),
                )  # fmt: skip
                a.state.registry.strike("bad", verdict, quarantine_after=2)
            await a.state.sync()
            await settle()
            models = {m["id"]: m for m in (await b.get("/v1/coverage")).json()["models"]}
            states = {n["node_id"]: n["state"] for n in models[LLAMA]["nodes"]}
            assert states == {"bad": "quarantined", "good": "serving"}
            assert b.state.registry.strikes("bad") == 2
            # another id at its address is quarantined on b too
            await swarm.register(b, node_id="bad2", url="http://bad.test:8000")
            assert b.state.registry.get("bad2").quarantined
            # the layer count a learnt is b's: a node announcing another is refused there
            body = announcement(node_id="o2", model="other/model", num_layers=9, end=9)
            assert (await b.post("/v1/nodes/register", json=body)).status_code == 400
            # lifted on b (the operator's call): lifted on a
            resp = await b.delete(
                "/v1/nodes/bad/quarantine", headers={"x-meshnet-operator-token": "op"}
            )
            assert resp.status_code == 200
            await settle()
            assert a.state.registry.get("bad").quarantined is None

    asyncio.run(main())


def test_one_leader_moves_nodes_and_another_takes_over_when_it_stops(swarm):
    async def main():
        async with swarm.tracker("a") as a, swarm.tracker("b") as b:
            for _ in range(3):
                await tick(a, b)
                assert [t.state.leads for t in (a, b)] == [True, False]
            # layers [3, 6) uncovered, three movable nodes on [0, 3): the leader moves one
            for node_id in ("m1", "m2", "m3"):
                await swarm.register(b, node_id=node_id, start=0, end=3, movable=True)
            await tick(b)
            assert not (await swarm.store.get_prefix("/meshnet/swarm/directives/")).items
            await tick(a)  # the leader plans; its directive goes to whoever the node beats
            moved = [n for n in ("m1", "m2", "m3") if await directives(swarm, b, n)]
            assert len(moved) == 1
            # a stops (no more beats, no more steps): b takes over once a's lease runs out
            await swarm.pass_time(TTL_S + 1)
            for node_id in ("m1", "m2", "m3"):
                await swarm.beat(b, node_id)
            await tick(b)
            assert b.state.leads and not a.state.election.is_leader
            assert (await a.state.election.leader()).startswith("http://b.test#")

    asyncio.run(main())


def test_directives_of_a_new_leader_reach_a_node_beating_to_the_old_one(swarm):
    async def main():
        async with swarm.tracker("a") as a, swarm.tracker("b") as b:
            await tick(a, b)
            await a.state.election.resign()  # a hands over and stays as a follower
            await tick(b, a)
            assert [t.state.leads for t in (a, b)] == [False, True]
            for node_id in ("m1", "m2"):
                await swarm.register(a, node_id=node_id, start=0, end=3, movable=True)
            await tick(a)
            assert not (await swarm.store.get_prefix("/meshnet/swarm/directives/")).items
            await tick(b)
            got = {n: await directives(swarm, a, n) for n in ("m1", "m2")}
            assert sorted(map(len, got.values())) == [0, 2]
            kinds = [d["kind"] for d in max(got.values(), key=len)]
            assert kinds == [DirectiveKind.LOAD_SHARD.value, DirectiveKind.DROP_SHARD.value]
            # delivered once
            assert not (await swarm.store.get_prefix("/meshnet/swarm/directives/")).items

    asyncio.run(main())


async def directives(swarm: Swarm, tracker: httpx.AsyncClient, node_id: str) -> list[dict]:
    resp = await swarm.beat(tracker, node_id)
    assert resp.status_code == 200, resp.text
    return resp.json()["directives"]


def test_an_assignment_asked_of_a_follower_is_the_leaders_placement(swarm):
    async def main():
        async with swarm.tracker("a") as a, swarm.tracker("b") as b:
            ask = {"node_id": "j1", "memory_bytes": 1 << 30, "device": "cpu", "kv_tokens": 1024,
                   "quantization": "float32", "dtype": "float32"}  # fmt: skip
            assert a.state.leads  # the first to start leads from the start
            resp = await b.post("/v1/nodes/assign", json=ask)
            assert resp.status_code == 200, resp.text
            assert resp.json()["shard"]["model_id"] in a.state.costs
            # the leader placed it: the range is pending there, so the next node gets another
            assert "j1" in a.state.balancer._pending and "j1" not in b.state.balancer._pending
            assert resp.json()["sources"][-1] == "http://a.test"  # the leader's own copy
            # between leaders (a resigned, b not stepped yet): a clear 503, nothing placed
            await a.state.election.resign()
            resp = await b.post("/v1/nodes/assign", json={**ask, "node_id": "j2"})
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_leader"
            assert "j2" not in a.state.balancer._pending

    asyncio.run(main())


def test_without_a_store_a_tracker_writes_nothing_anywhere(models_dir):
    app = create_app(TrackerSettings(models_dir=models_dir, verify_nodes=False))
    state = app.state.tracker
    assert state.replica is None and state.election is None and state.leads


class FlakyStore(MemoryStore):
    """A MemoryStore whose watches (``flaky``, in the order they began) can be told to fail
    on their next event (a lost connection, a compacted revision): that event goes unseen."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.flaky: list[FlakyWatch] = []

    def watch(self, prefix, *, start_revision=None):
        watch = FlakyWatch(super().watch(prefix, start_revision=start_revision))
        self.flaky.append(watch)
        return watch


class FlakyWatch:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.broken = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        event = await self.inner.__anext__()
        if self.broken:
            raise StoreError("watch lost")
        return event

    async def aclose(self):
        await self.inner.aclose()


def test_a_tracker_that_lost_its_watch_reads_the_store_again(swarm, monkeypatch):
    monkeypatch.setattr(replica, "RESYNC_S", 0.0)
    swarm.store = FlakyStore(clock=swarm.clock)

    async def main():
        async with swarm.tracker("a") as a, swarm.tracker("b") as b:
            await swarm.register(a, node_id="n1", start=0, end=6)
            await swarm.register(a, node_id="n2", start=0, end=6)
            assert await node_ids(b) == {"n1", "n2"}
            swarm.store.flaky[1].broken = True  # b's (a began first): b misses n1 leaving
            headers = {"x-meshnet-node-secret": swarm.secrets["n1"]}
            assert (await a.delete("/v1/nodes/n1", headers=headers)).status_code == 200
            await settle()
            assert await node_ids(b) == {"n2"}
            await swarm.register(a, node_id="n3", start=0, end=6)  # and follows on
            assert await node_ids(b) == {"n2", "n3"}

    asyncio.run(main())

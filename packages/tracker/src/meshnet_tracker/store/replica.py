"""One tracker's registry kept in step with the swarm's shared store (issue 53).

Each tracker writes what changed in its own registry under the swarm prefix, and applies
what the others wrote:

- ``nodes/<id>``: a node's record (announcement, state, secret, load figures), put under a
  lease of MISSED_HEARTBEATS heartbeat intervals that whichever tracker the node beats to
  keeps alive (the lease id travels in the value). The lease running out is the node's
  departure on every tracker (dropped as a silent node is: the restart grace holds); a node
  that leaves is put once more marked ``left``, then deleted.
- ``verdicts/<id>``: the verdicts counted against a node and its quarantine.
- ``models/<id>``: a model's layer count as the tracker that learnt it knows it.
- ``directives/<id>``: LOAD/DROP directives of the leader, taken by whichever tracker the
  node beats to next (under the node's lease: they go with it).

Each value names its writer; a tracker skips its own (no echo). Times travel as ages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

from meshnet_common.protocol import Directive, NodeAnnouncement, NodeState, Verdict
from meshnet_tracker.registry import MISSED_HEARTBEATS, NodeRecord, Registry
from meshnet_tracker.store.base import Event, Store, StoreError

logger = logging.getLogger(__name__)

PREFIX = "/meshnet/swarm/"
RESYNC_S = 1.0  # after a watch failed, this long before the next snapshot
STOP_WAIT_S = 0.1  # between cancellations of the watch when stopping


class RegistryReplica:
    """Publishes ``registry``'s changes to ``store`` and applies the other trackers'."""

    def __init__(
        self, store: Store, registry: Registry, writer: str, *, prefix: str = PREFIX,
        adopted: Callable[[NodeRecord], None] = lambda record: None,
    ) -> None:  # fmt: skip
        self.store = store
        self.registry = registry
        self.writer = writer
        self.prefix = prefix
        self.adopted = adopted  # told of each record another tracker wrote
        self.ttl_s = MISSED_HEARTBEATS * registry.heartbeat_interval_s
        self._leases: dict[str, int] = {}  # node id -> its lease in the store
        self._dirty: dict[tuple[str, str], None] = {}  # (kind, node id), in order
        self._models: dict[str, int] = {}  # layer counts as last written or read
        self._applying = False
        self._task: asyncio.Task | None = None
        registry.on_change = self._changed

    def _changed(self, kind: str, node_id: str) -> None:
        if not self._applying:
            self._dirty[(kind, node_id)] = None

    def key(self, kind: str, name: str) -> str:
        return f"{self.prefix}{kind}/{name}"

    # -- reading the store --------------------------------------------------------------
    async def start(self) -> None:
        """Load what the store holds, then follow its changes in the background."""
        revision = await self._load()
        self._task = asyncio.ensure_future(self._follow(revision))

    async def _load(self, *, resync: bool = False) -> int:
        """Apply what the store holds; ``resync`` (the watch was lost): drop the other
        trackers' nodes the store no longer holds (their deletes went by unseen)."""
        snapshot = await self.store.get_prefix(self.prefix)
        for key, value in snapshot.items.items():
            await self.apply(Event("put", key, value, snapshot.revision))
        if resync:
            for record in self.registry.records():
                mine = ("node", record.node_id) in self._dirty  # not written yet
                key = self.key("nodes", record.node_id)
                if not (record.local or mine or key in snapshot.items):
                    self.registry.drop(record.node_id)
        return snapshot.revision

    async def _follow(self, revision: int) -> None:
        while True:
            try:
                async with contextlib.aclosing(
                    self.store.watch(self.prefix, start_revision=revision + 1)
                ) as events:
                    async for event in events:
                        revision = event.revision
                        await self.apply(event)
                return  # the store closed
            except StoreError as exc:
                logger.warning("shared store: %s; reading it again", exc.message)
                await asyncio.sleep(RESYNC_S)
                with contextlib.suppress(StoreError):
                    revision = await self._load(resync=True)

    async def stop(self) -> None:
        """Stop following the store. Cancelled again while it runs on: a watch whose event
        arrived as the cancellation did may swallow it (``asyncio.wait_for`` before 3.12)."""
        task, self._task = self._task, None
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=STOP_WAIT_S)

    async def apply(self, event: Event) -> None:
        """One change another tracker made (a tracker's own are skipped); a value this
        tracker cannot read is logged and skipped."""
        kind, _, name = event.key[len(self.prefix) :].partition("/")
        if kind == "nodes" and event.value is None:
            if await self.store.get(event.key) is None:  # not put again meanwhile
                self._leases.pop(name, None)
                self.registry.drop(name)
            return
        if kind not in ("nodes", "verdicts", "models") or event.value is None:
            return  # the election's key, directives (taken when asked for)
        self._applying = True
        try:
            data = json.loads(event.value)
            if data.get("writer") != self.writer:
                self._apply(kind, name, data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning(
                "shared store: %s unreadable (%s: %s)", event.key, type(exc).__name__, exc
            )
        finally:
            self._applying = False

    def _apply(self, kind: str, name: str, data: dict) -> None:
        if kind == "nodes":
            self._apply_node(name, data)
        elif kind == "verdicts":
            strikes = {k: Verdict.model_validate(v) for k, v in data["strikes"].items()}
            self.registry.set_verdicts(name, strikes, data["reason"], data["urls"])
        else:
            self._models[name] = data["num_layers"]
            if self.registry.num_layers(name) is None:
                now = self.registry.clock()
                self.registry.models.introduce(name, data["num_layers"], data["source"], now)

    def _apply_node(self, node_id: str, data: dict) -> None:
        self._leases[node_id] = data["lease"]
        if data.get("left"):
            self.registry.remove(node_id)
            return
        local = self.registry.get(node_id)
        if local is not None and local.local:
            return  # this tracker's own node: it alone writes that record
        record = _record(data, self.registry.clock())
        if local is not None:
            record.slowdown = local.slowdown
        self.registry.adopt(record)
        self.adopted(record)

    # -- writing the store --------------------------------------------------------------
    async def flush(self) -> None:
        """Write what changed in this tracker's registry since the last flush."""
        while self._dirty:
            kind, node_id = next(iter(self._dirty))
            if kind == "node":
                record = self.registry.get(node_id)
                if record is not None:
                    await self._put_node(record)
            elif kind == "left":
                await self._leave(node_id)
            else:
                strikes, reason, urls = self.registry.verdicts_of(node_id)
                value = {
                    "strikes": {k: v.model_dump(mode="json") for k, v in strikes.items()},
                    "reason": reason, "urls": urls,
                }  # fmt: skip
                await self._put(self.key("verdicts", node_id), value)
            self._dirty.pop((kind, node_id), None)
        await self._flush_models()

    async def _put(self, key: str, value: dict, lease: int | None = None) -> None:
        value = {**value, "writer": self.writer}
        await self.store.put(key, json.dumps(value).encode(), lease=lease)

    async def _lease(self, node_id: str) -> int:
        """The node's lease, renewed (or a new one when it ran out)."""
        lease = self._leases.get(node_id)
        if lease is None or not await self.store.keepalive(lease):
            lease = self._leases[node_id] = await self.store.grant(self.ttl_s)
        return lease

    async def _put_node(self, record: NodeRecord) -> None:
        lease = await self._lease(record.node_id)
        value = _value(record, self.registry.clock())
        await self._put(self.key("nodes", record.node_id), {**value, "lease": lease}, lease)

    async def _leave(self, node_id: str) -> None:
        lease = self._leases.pop(node_id, None)
        if lease is None:
            return
        with contextlib.suppress(StoreError):  # its lease may have run out already
            await self._put(self.key("nodes", node_id), {"left": True, "lease": lease}, lease)
        await self.store.revoke(lease)

    async def _flush_models(self) -> None:
        table = self.registry.models
        for model_id, num_layers in list(table.layers.items()):
            if self._models.get(model_id) != num_layers:
                self._models[model_id] = num_layers
                value = {"num_layers": num_layers, "source": table.source_of(model_id)}
                await self._put(self.key("models", model_id), value)

    # -- directives ---------------------------------------------------------------------
    async def send_directives(self, directives: dict[str, list[Directive]]) -> None:
        """The leader's directives, for whichever tracker each node beats to next."""
        for node_id, queued in directives.items():
            value = {"directives": [d.model_dump(mode="json") for d in queued]}
            lease = self._leases.get(node_id)
            try:
                await self._put(self.key("directives", node_id), value, lease)
            except StoreError:  # the node's lease ran out: it is gone, and they with it
                logger.warning("directives for %s dropped: the node is gone", node_id)

    async def take_directives(self, node_id: str) -> tuple[Directive, ...]:
        """The directives waiting for ``node_id``, taken (each is delivered once)."""
        key = self.key("directives", node_id)
        value = await self.store.get(key)
        if value is None or not await self.store.delete(key):
            return ()  # none, or another tracker took them first
        return tuple(Directive.model_validate(d) for d in json.loads(value)["directives"])


def _value(record: NodeRecord, now: float) -> dict:
    """A record as the store keeps it; its times as ages (each tracker has its own clock)."""
    return {
        "announcement": record.announcement.model_dump(mode="json"),
        "state": record.state.value, "secret": record.secret,
        "called_back": record.called_back, "source": record.source,
        "age": now - record.since, "quarantined": record.quarantined,
        "active_sessions": record.active_sessions, "kv_tokens": record.kv_tokens,
        "memory_free_bytes": record.memory_free_bytes,
        "tokens_generated": record.tokens_generated, "tokens_served": record.tokens_served,
        "tokens_per_s": record.tokens_per_s, "layer_ms": record.layer_ms,
        "links": [list(link) for link in record.links], "prefix": list(record.prefix),
    }  # fmt: skip


def _record(data: dict, now: float) -> NodeRecord:
    """A record another tracker wrote (``_value``), as heard from now."""
    return NodeRecord(
        announcement=NodeAnnouncement.model_validate(data["announcement"]),
        state=NodeState(data["state"]), last_heartbeat=now, secret=data["secret"],
        called_back=data["called_back"], source=data["source"], since=now - data["age"],
        quarantined=data["quarantined"], active_sessions=data["active_sessions"],
        kv_tokens=data["kv_tokens"], memory_free_bytes=data["memory_free_bytes"],
        tokens_generated=data["tokens_generated"], tokens_served=data["tokens_served"],
        tokens_per_s=data["tokens_per_s"], layer_ms=data["layer_ms"],
        links=tuple((url, ms) for url, ms in data["links"]), prefix=tuple(data["prefix"]),
    )  # fmt: skip

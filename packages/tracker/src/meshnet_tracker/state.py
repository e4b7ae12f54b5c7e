"""The tracker's live state: registry, known models and (optionally) its own node."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import httpx

from meshnet_common.coverage_wait import COVERAGE_PENDING
from meshnet_common.errors import ModelError, ModelNotCovered, NotFound
from meshnet_common.memory import ModelCosts
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.models_dir import (
    ModelEntry,
    ModelScan,
    scan_models_dir,
    snapshot_fingerprint,
)
from meshnet_common.protocol import MAX_PROBES, NodeState
from meshnet_common.trust.identity import issue
from meshnet_common.trust.manifest_keys import ManifestSigner
from meshnet_tracker.balancer import Balancer
from meshnet_tracker.coverage import ModelCoverage
from meshnet_tracker.heads import LocalNode
from meshnet_tracker.registry import Registry
from meshnet_tracker.routing import Hop, PrefixAffinity, choose_route, keep_or_switch, renew
from meshnet_tracker.settings import TrackerSettings
from meshnet_tracker.store.election import Election
from meshnet_tracker.store.replica import RegistryReplica

logger = logging.getLogger(__name__)

# One route request in this many, per (model, head), takes a chain through a node that no
# head timed lately and that has served for EXPLORE_AFTER_S, where there is one: measured
# compute needs a route to compare with. A node that just joined is left to routing as
# usual for that long (routes do not flap when a replica arrives).
EXPLORE_EVERY = 8
EXPLORE_AFTER_S = 60.0


class ModelsScan(NamedTuple):
    """A rescan's findings (``TrackerState.scan_models_dir``), applied on the event loop."""

    scan: ModelScan
    changed: list[tuple[ModelEntry, tuple, ModelCosts]]  # entry, fingerprint, costs


@dataclass
class TrackerState:
    """Everything the tracker's routes need."""

    settings: TrackerSettings
    registry: Registry
    node: LocalNode | None  # the tracker node (meshnet_tracker.tracker_node), if any
    client: httpx.AsyncClient
    callback: httpx.AsyncClient | None = None  # registration call-backs: no credentials
    signer: ManifestSigner | None = None  # the tracker key: certifies nodes (docs/adr/0032)
    costs: dict[str, ModelCosts] = field(default_factory=dict)  # models we can place nodes on
    demand: Counter = field(default_factory=Counter)  # requests per model
    balancer: Balancer = field(init=False)
    # With --store: the registry shared with the swarm's other trackers, and the election of
    # the one that places and moves nodes (issue 53). None: this tracker is alone.
    replica: RegistryReplica | None = None
    election: Election | None = None

    indexed: dict[str, tuple] = field(default_factory=dict)  # model -> snapshot fingerprint
    _known: dict = field(default_factory=dict)  # the models dir as last read (scan_models_dir)
    _scan_turn: asyncio.Lock = field(default_factory=asyncio.Lock)  # one scan at a time
    _scans_begun: int = 0
    _problems: set[str] = field(default_factory=set)  # models-dir problems already logged
    # The route each (model, head) got last: kept unless a clearly better one appears.
    _last_routes: dict[tuple[str, str | None], list] = field(default_factory=dict)
    _asked: Counter = field(default_factory=Counter)  # route requests per (model, head)
    # The chain each recent prompt prefix went down: its hops hold its blocks (ADR-0035).
    affinity: PrefixAffinity = field(default_factory=PrefixAffinity)

    def __post_init__(self) -> None:
        self.balancer = Balancer(
            self.registry, self.costs, self.demand,
            move_grace_s=self.settings.move_grace_s, joining_ttl_s=self.settings.joining_ttl_s,
            restart_grace_s=self.settings.restart_grace_s, clock=self.registry.clock,
        )  # fmt: skip

    @property
    def leads(self) -> bool:
        """Whether this tracker places and moves nodes: alone, or the elected leader."""
        return self.election is None or self.election.is_leader

    def plan_moves(self) -> int:
        """Moves are the leader's to plan: two trackers never send conflicting directives."""
        return self.balancer.plan_moves() if self.leads else 0

    async def sync(self) -> None:
        """With a shared store: write this registry's changes there, and the leader's
        directives for whichever tracker each node beats to next."""
        if self.replica is None:
            return
        await self.replica.flush()
        if self.leads:
            await self.replica.send_directives(self.balancer.take_directives())

    def adopted(self, record) -> None:
        """Another tracker registered ``record``: serving, it is pending here no more."""
        if record.state == NodeState.SERVING:
            self.balancer.registered(record.node_id)

    async def directives_for(self, node_id: str) -> tuple:
        """The directives waiting for ``node_id`` here or (with a store) in the store."""
        mine = self.balancer.directives_for(node_id)
        if self.replica is None:
            return mine
        return (*mine, *await self.replica.take_directives(node_id))

    def certify(self, node_id: str, public_key: str | None) -> str | None:
        """A certificate of ``public_key`` for ``node_id`` (docs/adr/0032): issued at each
        registration and renewed by each heartbeat answer; None without a key."""
        if public_key is None or self.signer is None or public_key in self.registry.revocations:
            return None
        return issue(self.signer, node_id, public_key)

    def index_models_dir(self) -> None:
        """Make every model in the models dir (or, without one, the ``--model-id`` the CLI
        pinned to a commit of the HF cache) known to the coverage map and to placement."""
        self.rescan_models_dir()

    @property
    def models_source(self) -> str:
        """Where the known models come from, as the logs name it."""
        return "models dir" if self.settings.models_dir is not None else "HF cache"

    def rescan_models_dir(self) -> None:
        """Index the models dir again: new snapshots become placeable, changed ones are
        re-indexed, removed ones are forgotten (once no node holds them). The same scan as
        ``meshnet-models list``."""
        self.apply_scan(self.scan_models_dir(dict(self.indexed)))

    async def rescan(self) -> None:
        """``rescan_models_dir`` off the event loop (the tracker node decodes on it), one
        scan at a time: a caller that waited while a scan began after it arrived takes that
        scan's findings, so a burst of assignments costs two scans at most. A scan that
        fails for a reason no check names is one logged line; the tracker carries on."""
        arrived = self._scans_begun
        async with self._scan_turn:
            if self._scans_begun > arrived:
                return  # a scan that began after this call arrived has been applied
            self._scans_begun += 1
            try:
                found = await asyncio.to_thread(self.scan_models_dir, dict(self.indexed))
            except Exception as exc:  # noqa: BLE001 - the tracker outlives a bad models dir
                logger.error(
                    "%s: scan failed (%s: %s)", self.models_source, type(exc).__name__, exc
                )
                return
            self.apply_scan(found)

    def scan_models_dir(self, indexed: dict[str, tuple]) -> ModelsScan | None:
        """The file work of a rescan: reads headers and stats files, touches no state, so
        the tracker runs it on a worker thread (it takes milliseconds per model, and the
        tracker node's event loop is on every decode step). ``indexed``: the fingerprints
        known so far; a snapshot whose files did not change is not re-indexed."""
        scan = self._scan()
        if scan is None:
            return None
        changed: list[tuple[ModelEntry, tuple, ModelCosts]] = []
        for entry in scan.entries:
            fingerprint = snapshot_fingerprint(entry.path)
            if indexed.get(entry.model_id) == fingerprint:
                continue
            try:
                costs = ModelCosts.from_index(CheckpointIndex.load(entry.path))
            except ModelError as exc:
                logger.warning("%s: %s", self.models_source, exc)
                continue
            changed.append((entry, fingerprint, costs))
        return ModelsScan(scan, changed)

    def _scan(self) -> ModelScan | None:
        """The models dir's snapshots; without one, the tracker's model in the HF cache at
        the commit the CLI pinned (``settings.revision``: a moved branch changes nothing)."""
        if self.settings.models_dir is not None:
            try:
                return scan_models_dir(self.settings.models_dir, self._known)
            except ModelError as exc:
                logger.warning("models dir: %s", exc)
                return None
        if self.settings.model_id is None:
            return None
        from meshnet_common.models.hub.cache import scan_hub_model  # huggingface_hub: lazily

        return scan_hub_model(self.settings.model_id, self.settings.revision)

    def apply_scan(self, found: ModelsScan | None) -> None:
        """What a scan found, made known to the coverage map and to placement."""
        if found is None:
            return
        scan = found.scan
        present = {entry.model_id for entry in scan.entries}
        for entry, fingerprint, costs in found.changed:
            change = "changed" if entry.model_id in self.indexed else "found"
            self.indexed[entry.model_id] = fingerprint
            self.registry.note_model(entry.model_id, entry.num_layers)
            self.costs[entry.model_id] = costs
            logger.info(
                "%s: %s %s (%d layers) at %s",
                self.models_source, change, entry.model_id, entry.num_layers, entry.path,
            )  # fmt: skip
        for model_id in sorted(set(self.indexed) - present):
            del self.indexed[model_id]
            self.costs.pop(model_id, None)
            forgotten = self.registry.forget_model(model_id)
            logger.info(
                "%s: %s removed%s", self.models_source, model_id,
                "" if forgotten else " (still on the map: nodes serve it)",
            )  # fmt: skip
        problems = {p.message for p in scan.problems}
        for problem in sorted(problems - self._problems):
            logger.warning("%s: %s", self.models_source, problem)
        self._problems = problems

    def model(self, model_id: str) -> ModelCoverage:
        coverage = self.registry.coverage()
        if model_id not in coverage:
            raise NotFound(
                f"model {model_id!r} is unknown; known: {', '.join(coverage) or 'none'}",
                param="model",
                code="model_not_found",
            )
        return coverage[model_id]

    def route(
        self, model_id: str, *, head: str | None = None, exclude_urls: frozenset[str] = frozenset(),
        prefix: str | None = None,
    ) -> list[Hop]:  # fmt: skip
        """A chain for ``model_id``; nodes at ``exclude_urls`` (failed hops) are avoided.
        ``prefix`` (``affinity.prefix_key``): the chain that prefix went down last, while it
        still serves, holds its blocks and is taken (docs/adr/0035)."""
        model = self.model(model_id)
        try:
            if not model.serving:
                raise ModelNotCovered(
                    f"no node serves {model_id}; missing layers: [0, {model.num_layers})",
                    code="model_not_covered",
                )
            exclude = {n.node_id for n in model.nodes if n.url in exclude_urls}
            chosen = choose_route(model, head=head, exclude=exclude)
        except ModelNotCovered as exc:
            # Expected back: every layer is on the map or on its way (a node loading, a move
            # under way, or a node the caller failed on that is still heartbeating as far as
            # the map knows: it may be restarting). Callers wait for it (--coverage-wait).
            if exc.code != "not_head" and self.balancer.coverage_on_its_way(model_id):
                raise ModelNotCovered(
                    f"{exc}; coverage is expected back (nodes of the missing layers are "
                    "loading or restarting)", code=COVERAGE_PENDING,
                ) from exc  # fmt: skip
            raise
        cached = renew(model, self.affinity.chain(prefix), exclude)
        if cached is not None and (head is None or cached[0].node.node_id == head):
            return cached
        key = (model_id, head)
        previous = self._last_routes.get(key)
        if previous is not None and not exclude & {h.node.node_id for h in previous}:
            chosen = keep_or_switch(model, previous, chosen)
        self._last_routes[key] = chosen
        self._asked[key] += 1
        if self._asked[key] % EXPLORE_EVERY == 0:  # now and then, time another replica
            return self._explore(model, head, exclude, chosen) or chosen
        return chosen

    def _explore(self, model, head: str | None, exclude: set[str], chosen: list[Hop]):
        """A chain through a node no head timed lately, avoiding one hop of ``chosen`` (None:
        none such). A node that claims more speed than it has draws every route; without a
        route around it, its lie looks like the overhead every route pays (docs/adr/0032).
        Not kept as the last route: the next request goes back to ``chosen``."""
        ids = {h.node.node_id for h in chosen}
        settled = self.registry.clock() - EXPLORE_AFTER_S
        unmeasured = {r.node_id for r in self.registry.records() if r.since <= settled}
        unmeasured &= {n.node_id for n in model.serving}
        unmeasured -= ids | self.registry.measured(model.model_id)
        if not unmeasured:
            return None
        for hop in chosen[1:] if head is not None else chosen:
            try:
                other = choose_route(model, head=head, exclude=exclude | {hop.node.node_id})
            except ModelNotCovered:
                continue
            if unmeasured & {h.node.node_id for h in other}:
                return other
        return None

    def probe_targets(self, node_id: str) -> tuple[str, ...]:
        """The nodes that could follow ``node_id`` in a route of its model (serving the
        layer where its range ends): the links it should time for route choice."""
        records = {r.node_id: r for r in self.registry.records()}
        record = records.get(node_id)
        if record is None:
            return ()
        shard = record.announcement.shard
        end = shard.layers.end
        targets = sorted(
            r.announcement.url for r in records.values()
            if r.node_id != node_id and r.announcement.shard.model_id == shard.model_id
            and r.announcement.shard.layers.start <= end < r.announcement.shard.layers.end
        )  # fmt: skip
        return tuple(targets[:MAX_PROBES])

    def resolve_model(self, name: str) -> str:
        """The model id a client's ``model`` names: the id itself, or a served name a node of
        that model declared (--served-model-name)."""
        if self.registry.num_layers(name) is not None:
            return name
        for record in self.registry.records():
            if name in record.announcement.served_names:
                return record.announcement.shard.model_id
        return name

    def model_cards(self) -> list[dict]:
        """/v1/models: one entry per served name of each covered model, as its head nodes
        answer it (the earliest snapshot time, the smallest context any node accepts)."""
        cards = []
        records = self.registry.records()
        for model in self.registry.coverage().values():
            if not model.covered:
                continue
            mine = [
                r.announcement for r in records
                if r.announcement.shard.model_id == model.model_id and r.state == "serving"
            ]  # fmt: skip
            heads = [a for a in mine if a.shard.shard_start == 0] or mine
            names = next((a.served_names for a in heads if a.served_names), ()) or (model.model_id,)
            lens = [a.max_model_len for a in heads if a.max_model_len]
            created = min((a.created for a in heads if a.created), default=0)
            for name in names:
                cards.append({
                    "id": name, "object": "model", "created": created, "owned_by": "meshnet",
                    "root": model.model_id, "max_model_len": min(lens) if lens else None,
                    "meshnet": {"num_layers": model.num_layers, "nodes": len(model.serving)},
                })  # fmt: skip
        return cards

    def hop_url(self, hop: Hop, own_url: str) -> str:
        """Where a hop is reached; the tracker node at ``own_url`` (the tracker's address as
        the caller knows it: a tracker bound to 0.0.0.0 has no one address of its own)."""
        if self.node is not None and hop.node.node_id == self.node.node_id:
            return own_url
        return hop.node.url

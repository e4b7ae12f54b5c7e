"""The tracker node: a node runtime serving the first layers inside the tracker process.

The one tracker module that imports the node package (``pip install 'meshnet-tracker[node]'``);
the tracker imports it only when started with ``--model-id``, so a plain tracker never loads
torch. It implements ``heads.LocalNode``: the tracker routes through its own coverage map
(``attach``) and calls the head in-process (``answer``)."""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import Request
from fastapi.responses import Response

from meshnet_common.metrics import Metrics
from meshnet_common.protocol import Heartbeat, NodeAnnouncement, Verdict
from meshnet_node.cpu_threads import apart, dedicate, describe
from meshnet_node.dataplane.forward import install_forward_path
from meshnet_node.dataplane.lane_wait import spin_window_s
from meshnet_node.dataplane.stream_server import max_message_bytes
from meshnet_node.head.routes import HANDLERS
from meshnet_node.runtime import (
    NodeRuntime,
    build_runtime,
    mount_node,
    start_background,
    stop_background,
)
from meshnet_node.settings import NodeSettings
from meshnet_node.swarm.host_turns import host_cpus, node_turns
from meshnet_node.verification.verifier import Replica
from meshnet_tracker.settings import TrackerSettings

NODE_ID = "tracker-node"
logger = logging.getLogger(__name__)


class TrackerNode:
    """A ``NodeRuntime`` as the tracker's ``LocalNode``."""

    def __init__(self) -> None:
        self.runtime: NodeRuntime | None = None
        self._state = None  # the tracker's state, for routes (set by ``attach``)
        self._audits = 0  # verdicts its audits reported (each counts: ``report``)

    @classmethod
    def build(
        cls, tracker: TrackerSettings, snapshot: Path, url: str, spin: str = ""
    ) -> TrackerNode:
        """Load ``[0, --shard-end)`` of the snapshot with the tracker's shard knobs (once per
        process: its compute thread gets the process's torch threads; ``spin``: how OpenMP
        waits here, logged with them)."""
        node = cls()
        settings = NodeSettings.exactly(  # the tracker's env is not a node's (no --tracker)
            **tracker.shard_values(), model_path=snapshot, host=tracker.host,
            port=tracker.port, advertise_url=url, node_id=NODE_ID,
        )  # fmt: skip
        node.runtime = apart(  # the load's OpenMP team ends with it (docs/adr/0036)
            lambda: build_runtime(settings, route_provider=node._routes, view=node)
        )
        scheduler = node.runtime.service.scheduler
        threads = dedicate(scheduler, settings.threads)
        node.runtime.service.links.lane_spin_s = spin_window_s(
            settings.lane_spin_ms, threads, host_cpus()
        )
        device = node.runtime.service.stage.shard.device.type
        scheduler.turns = node_turns(settings, threads, device)  # shared with the host's nodes
        logger.info("tracker node: %s", describe(threads, 0, spin, scheduler.turns))
        return node

    @classmethod
    def of(cls, runtime: NodeRuntime) -> TrackerNode:
        """Wrap a runtime built elsewhere (tests); its route provider must be ``_routes``."""
        node = cls()
        node.runtime = runtime
        return node

    async def _routes(self, model_id: str, exclude: frozenset[str] = frozenset()):
        hops = self._state.route(model_id, head=self.node_id, exclude_urls=exclude)
        return tuple(h.node.url for h in hops[1:])

    async def replicas(self, model_id: str) -> list[Replica]:
        """Audits' view of the map (``SwarmView``): the tracker's own."""
        model = self._state.registry.coverage().get(model_id)
        if model is None:
            return []
        return [Replica(n.node_id, n.url, n.layers.start, n.layers.end, n.quantization,
                        n.dtype, n.quant_group_size)
                for n in model.serving]  # fmt: skip

    async def report(self, node_id: str, verdict: Verdict) -> None:
        """A verdict of this head's audits, counted in the tracker's own registry. The
        tracker trusts its own audits: each counts (docs/adr/0032), where a remote reporter
        counts once."""
        registry = self._state.registry
        if registry.get(node_id) is not None:
            self._audits += 1
            registry.strike(
                node_id, verdict, quarantine_after=self._state.settings.quarantine_after,
                key=f"{verdict.reporter}#audit-{self._audits}",
            )  # fmt: skip

    @property
    def node_id(self) -> str:
        return self.runtime.node_id

    @property
    def metrics(self) -> Metrics:
        return self.runtime.service.metrics

    @property
    def layers(self):
        return self.runtime.service.stage.shard.layers

    def announcement(self) -> NodeAnnouncement:
        return self.runtime.announcement()

    def heartbeat(self) -> Heartbeat:
        self._certify()  # renewed with every beat, as a node's heartbeat answer does
        return self.runtime.heartbeat()

    def _certify(self) -> None:
        """The tracker node's certificate, from the tracker key itself (docs/adr/0032)."""
        runtime = self.runtime
        runtime.identity.adopt(self._state.certify(runtime.node_id, runtime.identity.key.public))

    def probe(self, urls: tuple[str, ...]) -> None:
        """The next hops whose links this node times (as a node's heartbeat reply says)."""
        self.runtime.service.links.set_probe_urls(urls)

    def attach(self, state) -> None:
        self._state = state
        # its audit answers are signed with the secret its own record holds (docs/adr/0032)
        self.runtime.audit_secret = lambda: state.registry.secret_of(self.runtime.node_id)
        if state.signer is not None:  # its calls to peers are signed (docs/adr/0032)
            self.runtime.peers.tracker_key = state.signer.public()
            self._certify()

    def install_data_path(self, app) -> None:
        install_forward_path(app)

    def mount(self, app) -> None:
        mount_node(app, self.runtime, openai_routes=False)  # the tracker's own take OpenAI calls

    def ws_max_size(self) -> int:
        return max_message_bytes(self.runtime.service.settings.max_body_bytes)  # hop streams

    async def start(self) -> None:
        await start_background(self.runtime)

    async def stop(self) -> None:
        await stop_background(self.runtime)

    async def answer(
        self, path: str, request: Request, rest: tuple[str, ...], body: bytes
    ) -> Response:
        return await HANDLERS[path](self.runtime.openai, request, rest, raw=body)

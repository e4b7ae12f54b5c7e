"""Assemble the tracker app: public API, node API, and (optionally) its own node."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

import httpx
from fastapi import FastAPI

from meshnet_common.metrics import Metrics
from meshnet_common.models.models_dir import resolve_snapshot
from meshnet_common.trust.identity import CallChecker
from meshnet_common.trust.manifest_keys import ManifestSigner
from meshnet_common.web import tls
from meshnet_common.web.auth import install_access, swarm_headers
from meshnet_common.web.http import install_error_handlers, install_observability
from meshnet_common.web.shards import ShardServer, shards_router, watch_shard_server
from meshnet_common.web.swarm_client import swarm_async_client
from meshnet_tracker.api.admission import MAX_ANSWER
from meshnet_tracker.api.dashboard import dashboard_router, watch_swarm
from meshnet_tracker.api.nodes import nodes_router
from meshnet_tracker.api.public import public_router
from meshnet_tracker.heads import LocalNode
from meshnet_tracker.registry import MISSED_HEARTBEATS, Registry
from meshnet_tracker.settings import TrackerSettings
from meshnet_tracker.state import TrackerState
from meshnet_tracker.store.base import Store, StoreError
from meshnet_tracker.store.election import Election
from meshnet_tracker.store.replica import PREFIX, RegistryReplica
from meshnet_tracker.store.spec import open_store

logger = logging.getLogger(__name__)


def create_app(
    settings: TrackerSettings, node: LocalNode | None = None, *, store: Store | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:  # fmt: skip
    """The tracker's FastAPI app; ``node`` makes it a tracker node serving those layers.
    ``store`` (else the one ``--store`` names, else none): the registry shared with the
    swarm's other trackers. ``clock``: the registry's and the election's (tests)."""
    owns_store = store is None and settings.store is not None
    if owns_store:
        store = open_store(settings.store)  # plain etcd:// (etcds:// client files: not yet flags)
    registry = Registry(settings.heartbeat_interval_s, clock=clock)
    client = swarm_async_client(  # identity answers under a byte limit (docs/adr/0032)
        timeout=httpx.Timeout(settings.proxy_timeout_s, connect=5.0),
        headers=swarm_headers(settings.swarm_token),  # heads accept our route header
        verify=tls.client_context(),
    )
    # Registration call-backs dial URLs a registering party named: no swarm token, no
    # redirects (docs/adr/0032).
    callback = swarm_async_client(
        max_bytes=MAX_ANSWER, verify=tls.client_context(), follow_redirects=False
    )
    # The tracker key: it signs weight manifests and certifies nodes' keys (docs/adr/0032).
    signer = (
        ManifestSigner.from_file(settings.signing_key) if settings.signing_key
        else ManifestSigner.generate()
    )  # fmt: skip
    logger.info("manifests and node certificates are signed with key %s (--tracker-key)",
                signer.public().text)  # fmt: skip
    state = TrackerState(
        settings=settings, registry=registry, node=node, client=client, callback=callback,
        signer=signer,
    )  # fmt: skip
    if store is not None:
        # Its id in the store: its URL (a follower sends assignments there) and a nonce.
        me = f"{settings.url}#{secrets.token_hex(6)}"
        state.replica = RegistryReplica(store, registry, me, adopted=state.adopted)
        ttl_s = MISSED_HEARTBEATS * settings.heartbeat_interval_s
        state.election = Election(store, PREFIX + "election", me, ttl_s, clock=clock)
    state.index_models_dir()
    if node is not None:
        node.attach(state)  # the tracker node routes through this coverage map

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        if state.replica is not None:
            await state.replica.start()  # the swarm as the store holds it, then its changes
            await _step(state)  # a lone tracker leads from the start
        tasks = [asyncio.ensure_future(_prune_loop(state))]
        if node is not None:
            await node.start()
            registry.register(node.announcement(), local=True)
        await _sync(state)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if node is not None:
                if state.replica is not None:  # its layers leave every tracker's map now
                    registry.remove(node.node_id)
                    await _sync(state)
                await node.stop()
            await _leave_store(state, store if owns_store else None)
            await client.aclose()
            await callback.aclose()

    app = FastAPI(title="meshnet tracker", lifespan=lifespan)
    app.state.tracker = state
    app.state.manifest_key = signer.public()
    app.state.max_request_bytes = settings.max_request_bytes
    if settings.models_dir is not None:
        models_dir = settings.models_dir
        app.state.shards = ShardServer(
            lambda model_id: resolve_snapshot(models_dir, model_id),
            max_concurrent=settings.max_concurrent_downloads,
            fault=settings.fault_inject,
            signer=signer,
        )
    install_error_handlers(app)
    if node is not None:
        node.install_data_path(app)  # the tracker node's data path; inside auth and observability
    # keys, swarm token, nodes' identity; CORS outside them (preflights carry no key)
    peers = CallChecker(signer.public(), serves_nodes=node is not None)
    peers.answers_at([settings.url])  # a signed call must be aimed at this tracker
    peers.revoked = registry.revocations  # removed and quarantined nodes' keys
    install_access(app, settings, peers=peers)
    # A tracker node reports its own layers and the swarm's numbers in one registry.
    metrics = node.metrics if node is not None else Metrics()
    install_observability(app, metrics)  # outermost: sees the 401s too
    watch_swarm(metrics, state)
    watch_shard_server(metrics, app)
    app.include_router(dashboard_router())
    app.include_router(public_router())
    app.include_router(nodes_router())
    app.include_router(shards_router())
    if node is not None:
        node.mount(app)  # node info; the tracker's own routes take the OpenAI calls
    return app


async def _prune_loop(state: TrackerState) -> None:
    """Every heartbeat interval: expire silent nodes, plan moves; rescan the models dir on
    its own (slower) timer."""
    loop = asyncio.get_running_loop()
    interval = state.settings.heartbeat_interval_s
    rescan_s = state.settings.models_rescan_s
    last = last_scan = loop.time()
    while True:
        await asyncio.sleep(interval)
        now = loop.time()
        stalled = now - last - interval
        last = now
        if stalled > interval:
            # This loop could not run (the process was busy or suspended): the heartbeats sent
            # meanwhile may still be unread. Count none of that time against the nodes.
            logger.warning("tracker loop stalled for %.1fs; heartbeat expiry paused", stalled)
            state.registry.forgive(stalled)
        if rescan_s > 0 and now - last_scan >= rescan_s:
            last_scan = now
            await state.rescan()  # on a worker thread: the tracker node decodes on this loop
        await housekeeping(state)


async def housekeeping(state: TrackerState) -> None:
    """One heartbeat interval's work: the tracker node's own beat, expiry, the election
    (with a store), moves (the leader's), and this registry's changes to the store."""
    if state.node is not None:  # the tracker node reports its load like any node
        state.registry.heartbeat(state.node.heartbeat())
        state.node.probe(state.probe_targets(state.node.node_id))
    state.registry.prune()
    await _step(state)
    state.plan_moves()
    await _sync(state)


async def _step(state: TrackerState) -> None:
    if state.election is not None:
        try:
            await state.election.step()
        except StoreError as exc:  # the leadership lapses by the lease's own clock
            logger.warning("leader election: %s", exc.message)


async def _sync(state: TrackerState) -> None:
    try:
        await state.sync()
    except StoreError as exc:  # written again with the next change
        logger.warning("shared store: %s", exc.message)


async def _leave_store(state: TrackerState, owned: Store | None) -> None:
    """A tracker stopping hands the leadership over at once and stops following the store
    (``owned``: the store it opened, closed too). Its nodes' leases run on: they beat on."""
    if state.replica is not None:
        await state.replica.stop()
    if state.election is not None:
        with contextlib.suppress(StoreError):
            await state.election.resign()
    if owned is not None:
        await owned.close()

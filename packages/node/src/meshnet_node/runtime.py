"""Build a node from its settings: preflight, load, wire up services, assemble the app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import torch
from fastapi import FastAPI
from transformers import AutoTokenizer, GenerationConfig

from meshnet_common.errors import MeshnetError, NotFound
from meshnet_common.memory import ModelCosts
from meshnet_common.metrics import Metrics
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.protocol import DirectiveKind, Heartbeat, NodeAnnouncement, NodeState, ShardSpec
from meshnet_common.trust.identity import CallChecker, Identity
from meshnet_common.web.auth import install_access
from meshnet_common.web.http import install_error_handlers, install_observability
from meshnet_common.web.serve import refreeze_heap
from meshnet_common.web.shards import shards_router, watch_shard_server
from meshnet_node.api import Readiness, head_router, node_router, status_router
from meshnet_node.caching.store import PrefixCache, heartbeat_figures
from meshnet_node.cpu_threads import apart
from meshnet_node.dataplane.forward import install_forward_path
from meshnet_node.dataplane.gauges import watch_service
from meshnet_node.dataplane.lane_ends import start_lanes
from meshnet_node.dataplane.service import NodeService
from meshnet_node.engine.faults import noisy_outputs, slow_compute
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.preflight import preflight, resolve_device, resolve_precision_for
from meshnet_node.engine.stage import Stage
from meshnet_node.head.generation import HeadGenerator, gguf_generation_config
from meshnet_node.head.queue import RequestQueue
from meshnet_node.head.serving import OpenAIServing, RouteProvider
from meshnet_node.model_files import draft_snapshot, snapshot_created, tokenizer_source
from meshnet_node.programs.graphs import CudaRecorder
from meshnet_node.settings import NodeSettings
from meshnet_node.speculation.draft_model import DraftModel
from meshnet_node.speculation.drafting import SpeculationSettings
from meshnet_node.swarm.drain import Drain
from meshnet_node.swarm.joining import local_snapshot, resolve_model_path
from meshnet_node.swarm.membership import Membership, TrackerClient
from meshnet_node.verification.head_audit import build_head_auditor
from meshnet_node.verification.verifier import SwarmView, build_verifier

logger = logging.getLogger(__name__)

SESSION_SWEEP_S = 10.0


@dataclass
class NodeRuntime:
    """Everything a running node owns."""

    settings: NodeSettings
    node_id: str
    service: NodeService
    openai: OpenAIServing | None
    memory_declared_bytes: int
    tracker: TrackerClient | None = None
    route_provider: RouteProvider | None = None
    membership: Membership | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    resharding: asyncio.Task | None = None
    reached_at: str | None = None  # the URL the tracker reaches this node at (its answer)
    # False: the server is not listening yet when the app starts (meshnet-node): the node
    # registers as serving once it is (``serving``), since the tracker calls it back.
    listening_at_start: bool = True
    on_refused: Callable[[str], None] | None = None  # the tracker refused this node
    state: NodeState = NodeState.SERVING  # LEAVING once it drains (docs/adr/0024)
    drain: Drain | None = None  # set where the process can exit (meshnet-node)
    view: SwarmView | None = None  # the map and verdicts, for audits (docs/adr/0026)
    # This node's secret, issued by the tracker: it signs its audit answers (docs/adr/0032)
    audit_secret: Callable[[], str | None] = lambda: None
    # Its key and certificate (its calls to peers), and the checker of peers' calls to it
    # (docs/adr/0032): the same objects its Membership keeps up to date.
    identity: Identity = field(default_factory=Identity)
    peers: CallChecker = field(default_factory=CallChecker)

    @property
    def url(self) -> str:
        return self.reached_at or announced_url(self.settings)

    def adopt_url(self, url: str) -> None:
        """The tracker said where it reaches this node; log it when it is not the bind URL."""
        if url != self.reached_at and url != announced_url(self.settings):
            logger.info("the tracker reaches this node at %s (listening on %s:%d)",
                        url, self.settings.host, self.settings.port)  # fmt: skip
        self.reached_at = url

    def serving(self) -> None:
        """The server listens: register as serving (the tracker may call back now)."""
        if self.membership is not None:
            self.membership.serve(self.announcement, self.heartbeat)

    def quarantine(self, reason: str | None) -> None:
        """The tracker's word on this node (docs/adr/0026): quarantined, it runs no step."""
        was = self.service.quarantined
        self.service.quarantined = None if reason is None else (self.url, reason)
        if reason is not None and was is None:
            logger.error("quarantined by the tracker: %s", reason)
        elif reason is None and was is not None:
            logger.warning("no longer quarantined: serving steps again")

    def refused(self, message: str) -> None:
        if self.on_refused is not None:
            self.on_refused(message)

    def own_snapshot(self, model_id: str) -> Path:
        """What this node can serve to peers: its own (possibly partial) snapshot."""
        if model_id != self.settings.model_id:
            raise NotFound(f"this node serves {self.settings.model_id}, not {model_id}")
        return self.settings.model_path

    def announcement(self) -> NodeAnnouncement:
        shard = self.service.stage.shard
        return NodeAnnouncement(
            node_id=self.node_id,
            url=announced_url(self.settings),
            url_explicit=self.settings.advertise_url is not None,
            movable=self.settings.movable,
            shard=ShardSpec(
                model_id=self.settings.model_id,
                shard_start=shard.layers.start,
                shard_end=shard.layers.end,
            ),
            num_layers=shard.num_layers,
            **self.settings.precision_fields(shard.precision, shard.dtype_name),
            device=str(shard.device),
            memory_declared_bytes=self.memory_declared_bytes,
            memory_free_bytes=int(psutil.virtual_memory().available),
            kv_budget_tokens=self.settings.kv_budget_tokens,
            state=self.state,
            served_names=self.settings.served_model_name,
            max_model_len=self.openai.context_window if self.openai is not None else None,
            created=snapshot_created(self.settings.model_path),
        )

    def heartbeat(self) -> Heartbeat:
        stages = [s for s in (self.service.stage, self.service.retiring) if s is not None]
        return Heartbeat(
            node_id=self.node_id,
            state=self.state,
            active_sessions=sum(len(s.sessions) for s in stages),
            kv_tokens=sum(s.sessions.tokens_held for s in stages),
            memory_free_bytes=int(psutil.virtual_memory().available),
            tokens_generated=self.service.tokens_generated,
            tokens_served=self.service.tokens_served,
            layer_ms=self.service.layer_ms,
            links={url: round(ms, 3) for url, ms in self.service.links.rtt_ms.items()},
            route_times=self.openai.generator.route_times.report() if self.openai else (),
            **heartbeat_figures([s.sessions.prefix for s in stages]),
        )


def bind_url(host: str, port: int, tls_cert=None) -> str:
    """``http://HOST:PORT`` (``https`` with a TLS certificate), an IPv6 host in brackets."""
    scheme = "https" if tls_cert is not None else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def announced_url(settings: NodeSettings) -> str:
    """What the node tells the tracker: --advertise-url, else its bind address (which the
    tracker replaces when it is a wildcard, or loopback seen from another host)."""
    return (
        settings.advertise_url or bind_url(settings.host, settings.port, settings.tls_cert)
    ).rstrip("/")


def load_stage(settings: NodeSettings) -> Stage:
    """Preflight the memory, then materialize only the shard (exits via exceptions)."""
    index = CheckpointIndex.load(settings.model_path)
    precision, dtype = resolve_precision_for(settings, index)  # auto: the shipped format
    preflight(
        index,
        settings.layers,
        precision,
        device=settings.device,
        kv_budget_tokens=settings.kv_budget_tokens,
        declared_gb=settings.memory_gb,
        dtype=dtype,
        group_size=settings.quant_group_size,
    )
    shard = load_shard(
        settings.model_path, settings.layers, precision, settings.device,
        dtype=getattr(torch, dtype),
        group_size=settings.quant_group_size,
        widen_bf16=settings.widen_bf16,
        bf16_kernel=settings.bf16_kernel, threads=settings.threads,
    )  # fmt: skip
    return Stage(
        shard, max_chunk_tokens=settings.chunk_tokens, kv_budget_tokens=settings.kv_budget_tokens,
        prompt_call_tokens=settings.prompt_call_tokens,
        idle_timeout_s=settings.session_idle_timeout_s, max_sessions=settings.max_sessions,
        output_fault=noisy_outputs(settings.test_only_perturb),  # tests only; None: a real node
        prefix_cache=PrefixCache() if settings.prefix_cache else None, engine=settings.engine,
        graphs=CudaRecorder(shard.device)
        if settings.cuda_graphs and shard.device.type == "cuda" else None,  # ADR-0056
    )  # fmt: skip


def build_runtime(
    settings: NodeSettings,
    *,
    route_provider: RouteProvider | None = None,
    metrics: Metrics | None = None,
    membership: Membership | None = None,
    memory_declared_bytes: int | None = None,
    view: SwarmView | None = None,
) -> NodeRuntime:
    """Load the shard and build the services; ``route_provider`` overrides asking the tracker.

    ``metrics``: the registry to report into (the CLI's, which already counted the fetch).
    ``membership``: the one that announced this node as joining (meshnet-node), if any.
    ``memory_declared_bytes``: what the node declares; default --memory-gb, else what the
    shard needs (weights + KV budget + margin), never the whole host's memory.
    ``view``: where audits find replicas and report verdicts (default: the tracker).
    """
    if settings.device == "auto":
        settings = settings.replace(device=resolve_device(settings.device))
    stage = load_stage(settings)
    identity = membership.identity if membership is not None else Identity()
    peers = membership.peers if membership is not None else CallChecker.pinned(settings.tracker_key)
    peers.answers_at([announced_url(settings)])  # a signed call must name this node
    service = NodeService(
        stage, settings, model_id=settings.model_id, metrics=metrics, identity=identity,
        before_pass=slow_compute(settings.step_delay_ms),  # tests only; None: a real node
    )  # fmt: skip
    if settings.direct_answers:
        url = announced_url(settings)
        if urlsplit(url).hostname not in ("0.0.0.0", "::"):  # a URL tails can dial
            service.answer_url = url
    watch_service(service)
    node_id = settings.node_id or f"node-{uuid.uuid4().hex[:12]}"
    tracker = None
    if settings.tracker_url:  # its Membership's trackers: both ask the current one
        trackers = membership.trackers if membership is not None else settings.tracker_urls
        tracker = TrackerClient(trackers, swarm_token=settings.swarm_token, identity=identity)
    if route_provider is None:
        route_provider = _tracker_routes(tracker, node_id, service)
    view = view or tracker
    service.head_audit = build_head_auditor(settings, service, view, node_id)  # ADR-0032
    openai = build_openai(settings, service, route_provider, build_verifier(
        settings, service, view, node_id))  # fmt: skip
    if memory_declared_bytes is None:
        if settings.memory_gb is not None:
            memory_declared_bytes = int(settings.memory_gb * 1024**3)
        else:
            index = CheckpointIndex.load(settings.model_path)
            precision, dtype = resolve_precision_for(settings, index)
            memory_declared_bytes = ModelCosts.from_index(index).shard_bytes(
                settings.layers, precision, settings.kv_budget_tokens,
                dtype=dtype, group_size=settings.quant_group_size,
            )  # fmt: skip
    return NodeRuntime(
        settings, node_id, service, openai, memory_declared_bytes, tracker, route_provider,
        membership=membership, view=view, identity=identity, peers=peers,
    )  # fmt: skip


def build_openai(
    settings: NodeSettings, service: NodeService, route_provider: RouteProvider, verifier=None
) -> OpenAIServing | None:
    """OpenAI serving for a head stage (tokenizer + generator); None elsewhere."""
    if not service.stage.shard.is_head:
        return None
    folder, gguf = tokenizer_source(settings.model_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
    try:
        if gguf:  # a GGUF's token ids are in its metadata: the config read from it
            generation_config = gguf_generation_config(service.stage.shard.config, tokenizer)
        else:
            generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:
        generation_config = None
    # auto: an older default, kept as a name; verification is exact in every precision now
    mode = "greedy" if settings.speculative == "auto" else settings.speculative
    draft = None
    if settings.draft_model and mode != "off":
        draft = DraftModel(
            draft_snapshot(settings), target_tokenizer=tokenizer,
            dtype=service.stage.shard.activation_dtype,
        )  # fmt: skip
    generator = HeadGenerator(
        service, tokenizer, generation_config,
        speculation=SpeculationSettings(
            mode, settings.max_draft_tokens, settings.speculative_max_running,
            settings.guess_steps,
        ),
        draft_model=draft, coverage_wait_s=settings.coverage_wait_s, verifier=verifier,
    )  # fmt: skip
    return OpenAIServing(
        settings.model_id, generator, route_provider,
        served_names=settings.served_model_name, max_model_len=settings.max_model_len,
        created=snapshot_created(settings.model_path), reasoning_parser=settings.reasoning_parser,
        queue=RequestQueue(
            max_waiting=settings.max_queued_requests, timeout_s=settings.queue_timeout_s
        ),
    )  # fmt: skip


def _tracker_routes(
    tracker: TrackerClient | None, node_id: str, service: NodeService
) -> RouteProvider:
    async def provider(model_id: str, exclude: frozenset[str] = frozenset()) -> tuple[str, ...]:
        if service.stage.shard.is_tail:
            return ()  # this node holds the whole model
        if tracker is None:
            from meshnet_common.errors import ModelNotCovered

            raise ModelNotCovered("no tracker configured to find the rest of the chain")
        route = await tracker.route(model_id, node_id, exclude)
        return tuple(hop.url for hop in route.hops[1:])

    return provider


def mount_node(app: FastAPI, runtime: NodeRuntime, *, openai_routes: bool = True) -> None:
    """Attach a node's routes and state to ``app`` (a node app, or the tracker's)."""
    app.state.node = runtime.service
    app.state.runtime = runtime
    app.include_router(node_router())
    if openai_routes:
        app.include_router(head_router())  # answers 404 while this node is not a head


async def start_background(runtime: NodeRuntime) -> None:
    """Session expiry and (when a tracker is set) membership, on its own thread."""

    async def sweep() -> None:
        while True:
            await asyncio.sleep(SESSION_SWEEP_S)
            runtime.service.stage.sessions.expire_idle()

    async def probe() -> None:  # the links to the next hops the tracker named, twice a beat
        while True:
            await asyncio.sleep(max(0.5, runtime.settings.heartbeat_interval_s / 2))
            await runtime.service.links.probe_links()

    runtime.tasks.append(asyncio.ensure_future(sweep()))
    runtime.tasks.append(asyncio.ensure_future(probe()))
    settings = runtime.settings
    await start_lanes(runtime.service, settings)  # docs/adr/0058
    if settings.tracker_url is None:
        return
    membership = runtime.membership
    if membership is None:  # no joining announcement was made (e.g. built in-process)
        trackers = runtime.tracker.trackers if runtime.tracker else settings.tracker_urls
        membership = runtime.membership = Membership(
            trackers, runtime.announcement, runtime.heartbeat,
            settings.heartbeat_interval_s, swarm_token=settings.swarm_token,
            identity=runtime.identity, peers=runtime.peers,
        )  # fmt: skip
    loop = asyncio.get_running_loop()
    # Called on the membership thread: the work itself belongs to the loop.
    membership.on_directives = lambda directives: loop.call_soon_threadsafe(
        apply_directives, runtime, directives
    )
    membership.on_probe = runtime.service.links.set_probe_urls
    membership.on_quarantine = lambda why: loop.call_soon_threadsafe(runtime.quarantine, why)
    membership.on_url = runtime.adopt_url
    if membership.url is not None:  # answered to the joining announcement already
        runtime.adopt_url(membership.url)
    membership.on_refused = lambda message: loop.call_soon_threadsafe(runtime.refused, message)
    if runtime.tracker is not None:  # verdicts carry the node's proof of id (docs/adr/0032)
        runtime.tracker.node_secret = lambda: membership.secret
    runtime.audit_secret = lambda: membership.secret
    membership.start()
    if runtime.listening_at_start:
        runtime.serving()


async def stop_background(runtime: NodeRuntime) -> None:
    for task in runtime.tasks:
        task.cancel()
    for task in runtime.tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    if runtime.membership is not None:
        await asyncio.to_thread(runtime.membership.stop, node_id=runtime.node_id)
    if runtime.tracker is not None:
        await runtime.tracker.aclose()
    if runtime.openai is not None and runtime.openai.generator.verifier is not None:
        await runtime.openai.generator.verifier.aclose()
    if runtime.service.head_audit is not None:
        await runtime.service.head_audit.aclose()
    await runtime.service.aclose()


def create_app(runtime: NodeRuntime) -> FastAPI:
    """The node's FastAPI app (background work starts with the server)."""
    readiness = Readiness(runtime)  # GET /ready: on the map (watches its registrations)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        readiness.watch()  # the membership that announced this node joining, if any
        await start_background(runtime)
        readiness.watch()  # or the one started just now
        try:
            yield
        finally:
            await stop_background(runtime)

    app = FastAPI(title="meshnet node", lifespan=lifespan)
    install_error_handlers(app)
    install_forward_path(app)  # inside auth and observability
    peers = runtime.peers if runtime.settings.tracker_url else None  # docs/adr/0032
    install_access(app, runtime.settings, peers=peers)  # keys, swarm token, CORS
    install_observability(app, runtime.service.metrics)  # outermost: sees the 401s too
    watch_shard_server(runtime.service.metrics, app)
    app.state.max_request_bytes = runtime.settings.max_request_bytes
    mount_node(app, runtime)
    app.include_router(shards_router())  # peers fetch this node's shard (app.state.shards)
    app.include_router(status_router(readiness))  # /ready, /version

    @app.get("/health")
    async def health():
        shard = runtime.service.stage.shard
        return {
            "status": "ok",
            "node_id": runtime.node_id,
            "model_id": runtime.settings.model_id,
            "shard_start": shard.layers.start,
            "shard_end": shard.layers.end,
        }

    return app


def apply_directives(runtime: NodeRuntime, directives) -> None:
    """LOAD_SHARD: load the new range beside the old one, then switch; DROP_SHARD: the old
    range is freed once its in-flight sessions end. Runs in the background."""
    load = next((d for d in directives if d.kind == DirectiveKind.LOAD_SHARD), None)
    if load is None or (runtime.resharding is not None and not runtime.resharding.done()):
        return
    runtime.resharding = asyncio.ensure_future(reshard(runtime, load.shard))


async def reshard(runtime: NodeRuntime, spec: ShardSpec) -> None:
    """Move this node to ``spec`` without failing any request in flight."""
    settings = runtime.settings
    try:
        model_path = await asyncio.to_thread(_locate_shard, runtime, spec)
        new_settings = settings.with_shard(spec.model_id, spec.layers, model_path)
        logger.info("resharding to %s layers %s", spec.model_id, spec.layers)
        # on a thread that ends with the load, its OpenMP team too (docs/adr/0036, 0039)
        stage = await asyncio.to_thread(apart, lambda: load_stage(new_settings))
    except (MeshnetError, ValueError, OSError) as exc:
        logger.error("cannot load %s layers %s: %s", spec.model_id, spec.layers, exc)
        return
    service = runtime.service
    runtime.settings = new_settings
    service.settings = new_settings
    service.model_id = spec.model_id
    service.swap(stage)
    verifier = build_verifier(new_settings, service, runtime.view, runtime.node_id)
    runtime.openai = build_openai(new_settings, service, runtime.route_provider, verifier)
    if runtime.membership is not None:
        runtime.membership.register_again()  # on the membership thread, before its next beat
    logger.info("now serving %s layers %s", spec.model_id, spec.layers)
    retiring = service.retiring
    while retiring is not None and len(retiring.sessions):
        await asyncio.sleep(1.0)
        retiring.sessions.expire_idle()
    if service.retiring is retiring:
        service.retiring = None  # DROP_SHARD: the old layers are freed
        refreeze_heap()  # frozen at start-up: the collector may reach them again once
    logger.info("dropped the previous shard")


def _locate_shard(runtime: NodeRuntime, spec: ShardSpec) -> Path:
    """A snapshot holding ``spec``: the current one, else found or fetched as at start-up
    (the models dir, the HF cache, the revision's folder of --cache-dir)."""
    settings = runtime.settings
    index = CheckpointIndex.load(settings.model_path)
    held = {index.layer_of(n) for n in index.tensors}
    if spec.model_id == settings.model_id and all(layer in held for layer in spec.layers):
        return settings.model_path
    elsewhere = settings.replace(  # --revision names the first model's revision
        model_path=None, revision=settings.revision if spec.model_id == settings.model_id else None
    )
    trackers = runtime.tracker.trackers if runtime.tracker is not None else None
    return resolve_model_path(
        elsewhere, spec.model_id, spec.layers, metrics=runtime.service.metrics,
        local=local_snapshot(elsewhere, spec.model_id, spec.layers, trackers),
        identity=runtime.identity, trackers=trackers,
    )  # fmt: skip

"""The tracker's live dashboard: ``GET /`` (a static page + script) and ``GET /v1/dashboard``.

The page is plain HTML, CSS and one script shipped inside this package (no build step, no
CDN: swarms often run offline). The script polls ``/v1/dashboard`` once a second and
redraws; the JSON is a snapshot of the registry, so a killed node shows as a gap within
3 missed heartbeats without reloading the page (ADR-0009).
"""

from __future__ import annotations

import time
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from meshnet_common.errors import NotFound
from meshnet_common.metrics import Metrics
from meshnet_common.precision import describe_precision
from meshnet_tracker.registry import NodeRecord
from meshnet_tracker.state import TrackerState

ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def _asset(name: str) -> str:
    return resources.files("meshnet_tracker").joinpath("static", name).read_text("utf-8")


def _node(record: NodeRecord, now: float) -> dict:
    announcement = record.announcement
    return {
        "node_id": record.node_id,
        "url": announcement.url,
        "model_id": announcement.shard.model_id,
        "shard_start": announcement.shard.shard_start,
        "shard_end": announcement.shard.shard_end,
        "num_layers": announcement.num_layers,
        "state": record.shown_state,
        "quarantined": record.quarantined,  # why, or None (docs/adr/0026)
        "quantization": announcement.quantization.value,
        "dtype": announcement.compute_dtype,
        "quant_group_size": announcement.quant_group_size,
        # as the page shows it: "int4 g64", "fp8", "bfloat16", "int8 · float32"
        "precision": describe_precision(
            announcement.quantization, announcement.compute_dtype, announcement.quant_group_size
        ),
        "device": announcement.device,
        "memory_declared_bytes": announcement.memory_declared_bytes,
        "memory_free_bytes": record.memory_free_bytes,
        "active_sessions": record.active_sessions,
        "kv_tokens": record.kv_tokens,
        "kv_budget_tokens": announcement.kv_budget_tokens,
        "tokens_per_s": round(record.tokens_per_s, 2),
        "tokens_served": record.tokens_served or 0,
        "slowdown": round(record.slowdown, 2),  # compute measured against its claim (ADR-0032)
        # the prefix cache (docs/adr/0035): blocks held, and of the sessions that asked for
        # cached blocks, those that got them
        "prefix_cache": dict(zip(("blocks", "lookups", "hits"), record.prefix, strict=True)),
        "last_heartbeat_s": round(max(0.0, now - record.last_heartbeat), 2),
        "local": record.local,
        "movable": announcement.movable,  # the tracker may move it (placed, or --allow-rebalance)
    }


def dashboard_snapshot(state: TrackerState) -> dict:
    """Everything the page shows, from one read of the registry."""
    registry = state.registry
    records = registry.records()
    coverage = registry.coverage()
    now = registry.clock()
    models = [
        {
            "id": model.model_id,
            "num_layers": model.num_layers,
            "covered": model.covered,
            "gaps": [g.as_list() for g in model.gaps()],
            "layer_counts": model.layer_counts(),
            "serving_nodes": len(model.serving),
        }
        for model in coverage.values()
    ]
    nodes = sorted(
        (_node(r, now) for r in records),
        key=lambda n: (n["model_id"], n["shard_start"], n["shard_end"], n["node_id"]),
    )
    return {
        "tracker": {
            "heartbeat_interval_s": registry.heartbeat_interval_s,
            "time": time.time(),
        },
        "models": models,
        "nodes": nodes,
    }


def watch_swarm(metrics: Metrics, state: TrackerState) -> None:
    """Swarm gauges on the tracker's ``/metrics``, read from the registry at scrape time."""

    def nodes():
        counts: dict[tuple[str, str], int] = {}
        for record in state.registry.records():
            key = (record.announcement.shard.model_id, record.shown_state)
            counts[key] = counts.get(key, 0) + 1
        return [({"model": m, "state": s}, n) for (m, s), n in sorted(counts.items())]

    def uncovered():
        return [
            ({"model": model.model_id}, sum(len(g) for g in model.gaps()))
            for model in state.registry.coverage().values()
        ]

    def moves():
        counts = state.balancer.move_counts
        return [({"model": m, "reason": r}, n) for (m, r), n in sorted(counts.items())]

    metrics.watch("swarm_nodes", "Nodes in the registry, by model and state", nodes)
    metrics.watch(
        "rebalance_moves", "Nodes the tracker moved to another range, by model and reason",
        moves, kind="counter",
    )  # fmt: skip
    metrics.watch(
        "rebalance_passes", "Passes of the balancer over the map (one per heartbeat interval)",
        lambda: state.balancer.passes, kind="counter",
    )  # fmt: skip
    metrics.watch("swarm_uncovered_layers", "Layers no serving node holds, by model", uncovered)
    metrics.watch(
        "swarm_verdicts", "Verdicts heads reported against nodes that computed wrong",
        lambda: state.registry.verdicts, kind="counter",
    )  # fmt: skip


def dashboard_router() -> APIRouter:
    router = APIRouter()
    page = _asset("index.html")
    assets = {name: _asset(name) for name in ASSETS}

    @router.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(page, headers={"cache-control": "no-cache"})

    @router.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in assets:
            raise NotFound(f"no dashboard asset {name!r}")
        return Response(
            assets[name], media_type=ASSETS[name], headers={"cache-control": "no-cache"}
        )

    @router.get("/v1/dashboard")
    async def dashboard(request: Request):
        return dashboard_snapshot(request.app.state.tracker)

    return router

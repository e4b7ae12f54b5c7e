"""Tracker routes for nodes: register, heartbeat, leave, and route lookup."""

from __future__ import annotations

from fastapi import APIRouter, Request

from meshnet_common.errors import InvalidRequest, NotFound
from meshnet_common.protocol import (
    Heartbeat,
    HeartbeatResponse,
    NodeAnnouncement,
    RegisterResponse,
    RouteHop,
    RouteResponse,
)
from meshnet_node.http_utils import parse_model
from meshnet_tracker.state import TrackerState


def _state(request: Request) -> TrackerState:
    return request.app.state.tracker


def nodes_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/nodes/register")
    async def register(request: Request) -> RegisterResponse:
        state = _state(request)
        announcement = await parse_model(request, NodeAnnouncement, limit=64 * 1024)
        try:
            announcement.shard.layers.check_within(announcement.num_layers)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="shard") from exc
        known = state.registry.num_layers(announcement.shard.model_id)
        if known is not None and known != announcement.num_layers:
            raise InvalidRequest(
                f"{announcement.shard.model_id} has {known} layers, not {announcement.num_layers}",
                param="num_layers",
            )
        state.registry.register(announcement)
        return RegisterResponse(
            node_id=announcement.node_id,
            heartbeat_interval_s=state.registry.heartbeat_interval_s,
        )

    @router.post("/v1/nodes/heartbeat")
    async def heartbeat(request: Request) -> HeartbeatResponse:
        beat = await parse_model(request, Heartbeat, limit=16 * 1024)
        return HeartbeatResponse(known=_state(request).registry.heartbeat(beat))

    @router.delete("/v1/nodes/{node_id}")
    async def leave(node_id: str, request: Request):
        if not _state(request).registry.remove(node_id):
            raise NotFound(f"unknown node {node_id!r}")
        return {"removed": node_id}

    @router.get("/v1/route")
    async def route(model: str, request: Request, head: str | None = None) -> RouteResponse:
        hops = _state(request).route(model, head=head)
        return RouteResponse(
            model_id=model,
            hops=tuple(
                RouteHop(
                    node_id=h.node.node_id,
                    url=h.node.url,
                    shard_start=h.start_layer,
                    shard_end=h.node.layers.end,
                )
                for h in hops
            ),
        )

    return router

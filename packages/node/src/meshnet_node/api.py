"""Node HTTP routes: node info, readiness and version, and (on a head) the OpenAI endpoints
and vLLM's tokenizer endpoints.

The data path (``POST /v1/forward``, ``DELETE /v1/sessions/{id}``) is answered before
routing: see forward_path.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from meshnet_common.config.cli import package_version
from meshnet_common.errors import InvalidRequest, ModelNotCovered, NotFound, Unauthorized
from meshnet_common.protocol import H_OPERATOR_TOKEN, H_ROUTE, NodeAnnouncement, NodeState
from meshnet_common.tokenize_protocol import DETOKENIZE_PATH, TOKENIZE_PATH
from meshnet_common.web.auth import has_swarm_token, same_secret
from meshnet_common.web.hosts import url_is_loopback
from meshnet_common.web.http import error_body
from meshnet_node.caching.api import prefix_router
from meshnet_node.dataplane.service import NodeService
from meshnet_node.dataplane.steps import parse_route
from meshnet_node.head.routes import (
    handle_chat,
    handle_completions,
    handle_detokenize,
    handle_tokenize,
)
from meshnet_node.head.serving import OpenAIServing
from meshnet_node.swarm.drain import busy
from meshnet_node.verification.audit import audit_router


def _service(request: Request) -> NodeService:
    return request.app.state.node


def node_router() -> APIRouter:
    """Routes every node serves (the tracker node mounts them too)."""
    router = APIRouter()
    router.include_router(audit_router())  # a replica's side of verification (ADR-0026)
    router.include_router(prefix_router())  # a hop's side of the prefix cache (ADR-0035)

    @router.get("/v1/node")
    async def info(request: Request):
        service = _service(request)
        shard = service.stage.shard
        declared = service.settings.precision_fields(shard.precision, shard.dtype_name)
        return {
            "model_id": service.model_id,
            "shard_start": shard.layers.start,
            "shard_end": shard.layers.end,
            "num_layers": shard.num_layers,
            "quantization": shard.precision.value,
            "dtype": declared["dtype"],
            "quant_group_size": declared["quant_group_size"],
            "device": str(shard.device),
            "active_sessions": len(service.stage.sessions),
            "kv_tokens": service.stage.sessions.tokens_held,
            "state": request.app.state.runtime.state.value,
        }

    @router.post("/v1/node/drain", status_code=202)
    async def drain(request: Request):
        """Leave the swarm gracefully (docs/adr/0024): an operator action (docs/adr/0032),
        so it takes this node's --operator-token, not the swarm token every node holds."""
        runtime = request.app.state.runtime
        token = runtime.settings.operator_token
        if not same_secret(token, request.headers.get(H_OPERATOR_TOKEN)):
            hint = "" if token else " (start it with one; SIGTERM drains it locally)"
            raise Unauthorized(
                f"draining a node needs its --operator-token{hint}", code="operator_only"
            )
        if runtime.drain is None:
            raise InvalidRequest("this process cannot drain (it is not a meshnet-node)")
        runtime.drain.start()
        return {
            "state": runtime.state.value,
            "open": busy(runtime),
            "timeout_s": runtime.drain.timeout_s,
        }

    return router


def head_router() -> APIRouter:
    """OpenAI endpoints of a head node; the route comes from the caller or the tracker."""
    router = APIRouter()

    async def route_from(request: Request):
        raw = request.headers.get(H_ROUTE)
        if raw is None:
            return None
        # A route steers activations to other hosts: only the swarm may set it. Without a
        # token (a loopback swarm) only loopback hops, unless --insecure opened the swarm.
        settings = request.app.state.runtime.settings
        if not has_swarm_token(request, settings.swarm_token):
            raise Unauthorized("a route header needs the swarm token")
        route = parse_route(raw)
        open_swarm = settings.swarm_token is None and not settings.insecure
        off = next((hop for hop in route if not url_is_loopback(hop)), None)
        if open_swarm and off is not None:
            raise Unauthorized(f"a route to {off[:80]} needs a swarm with --swarm-token")
        return route

    def serving(request: Request) -> OpenAIServing:
        openai = request.app.state.runtime.openai
        if openai is None:
            raise NotFound("this node does not serve the first layers: ask the tracker")
        return openai

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await handle_completions(serving(request), request, await route_from(request))

    @router.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle_chat(serving(request), request, await route_from(request))

    @router.get("/v1/models")
    async def models(request: Request):
        openai = serving(request)
        return {"object": "list", "data": openai.model_cards()}

    @router.post(TOKENIZE_PATH)
    async def tokenize(request: Request):
        return await handle_tokenize(serving(request), request)

    @router.post(DETOKENIZE_PATH)
    async def detokenize(request: Request):
        return await handle_detokenize(serving(request), request)

    return router


class Readiness:
    """Whether a node is ready for traffic (``GET /ready``), apart from being alive
    (``/health``): it serves its shard on the map, i.e. the tracker accepted its serving
    announcement; a node with no tracker once it listens. Not while it drains or is
    quarantined.

    It listens to the membership's registrations: ``watch`` before the node's background
    work starts (the membership meshnet-node announced joining with) and after (the one
    started then, which only ever announces this node serving)."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.on_map = False
        self._watched = None
        self._looked = False

    def watch(self) -> None:
        membership = self.runtime.membership
        if membership is None or membership is self._watched:
            self._looked = True
            return
        made_at_start = self._looked and self._watched is None
        self._watched, self._looked = membership, True
        earlier = membership.on_registered

        def registered(announcement: NodeAnnouncement) -> None:
            self.on_map = announcement.state == NodeState.SERVING
            if earlier is not None:
                earlier(announcement)

        membership.on_registered = registered
        if made_at_start and membership.registered.is_set():  # registered serving already
            self.on_map = True

    def why_not(self) -> str | None:
        """Why the node is not ready; None when it is."""
        runtime = self.runtime
        if runtime.state != NodeState.SERVING:
            return f"this node is {runtime.state.value}: it takes no new requests"
        if runtime.service.quarantined is not None:
            return "this node is quarantined by the tracker: it serves no steps"
        if runtime.settings.tracker_url and not self.on_map:
            return "this node is not serving on the tracker's map yet (loading or registering)"
        return None


def status_router(readiness: Readiness) -> APIRouter:
    """``GET /ready`` (readiness, beside ``/health``: liveness) and ``GET /version``."""
    router = APIRouter()

    @router.get("/ready")
    async def ready(request: Request):
        why = readiness.why_not()
        if why is None:
            return {"ready": True}
        request.state.error_code = "not_ready"  # for meshnet_errors_total
        body = error_body(why, "service_unavailable", code="not_ready")
        return JSONResponse(body, status_code=503)

    @router.get("/version")
    async def version():
        return {"version": package_version("meshnet-node")}

    return router


__all__ = ["ModelNotCovered", "Readiness", "head_router", "node_router", "status_router"]

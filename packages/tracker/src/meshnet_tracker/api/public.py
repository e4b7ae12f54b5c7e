"""Public tracker routes: health, readiness, version, coverage, models, and the OpenAI entry
point (with vLLM's /tokenize and /detokenize, answered by a head)."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from meshnet_common.config.cli import package_version
from meshnet_common.coverage_wait import wait_for_coverage
from meshnet_common.errors import InvalidRequest
from meshnet_common.logs import event
from meshnet_common.tokenize_protocol import DETOKENIZE_PATH, TOKENIZE_PATH
from meshnet_common.trust.manifest_keys import ALGORITHM, KEY_PATH
from meshnet_common.web.auth import tenant_of
from meshnet_common.web.hosts import server_url
from meshnet_common.web.http import (
    check_content_type,
    error_body,
    json_limit,
    loads_object,
    read_body,
)
from meshnet_tracker.heads import Head, RemoteHead
from meshnet_tracker.routing import prefix_key
from meshnet_tracker.state import TrackerState

logger = logging.getLogger(__name__)


def _state(request: Request) -> TrackerState:
    return request.app.state.tracker


def public_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request):
        state = _state(request)
        return {"status": "ok", "nodes": len(state.registry.records())}

    @router.get("/ready")
    async def ready(request: Request):
        """Readiness (``/health`` is liveness): some model is covered end to end."""
        covered = _covered(_state(request))
        if covered:
            return {"ready": True, "models": covered}
        request.state.error_code = "not_ready"  # for meshnet_errors_total
        message = "no model is covered end to end yet: nodes are joining or loading"
        body = error_body(message, "service_unavailable", code="not_ready")
        return JSONResponse(body, status_code=503)

    @router.get("/version")
    async def version():
        return {"version": package_version("meshnet-tracker")}

    @router.get(KEY_PATH)
    async def manifest_key(request: Request):
        """The public key the tracker signs weight manifests with (docs/adr/0032)."""
        return {"algorithm": ALGORITHM, "public_key": request.app.state.manifest_key.text}

    @router.get("/v1/coverage")
    async def coverage(request: Request):
        models = []
        for model in _state(request).registry.coverage().values():
            models.append(
                {
                    "id": model.model_id,
                    "num_layers": model.num_layers,
                    "covered": model.covered,
                    "gaps": [g.as_list() for g in model.gaps()],
                    "nodes": [
                        {
                            "node_id": n.node_id,
                            "url": n.url,
                            "shard_start": n.layers.start,
                            "shard_end": n.layers.end,
                            "state": n.state,
                            "quantization": n.quantization,
                            "dtype": n.dtype,
                            "quant_group_size": n.quant_group_size,
                        }
                        for n in model.nodes
                    ],
                }
            )
        return {"models": models}

    @router.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": _state(request).model_cards()}

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await _entry(request, "/v1/completions")

    @router.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _entry(request, "/v1/chat/completions")

    @router.post(TOKENIZE_PATH)
    async def tokenize(request: Request):
        return await _entry(request, TOKENIZE_PATH)

    @router.post(DETOKENIZE_PATH)
    async def detokenize(request: Request):
        return await _entry(request, DETOKENIZE_PATH)

    return router


def _covered(state: TrackerState) -> list[str]:
    """The models every layer of which a serving node holds."""
    return [m.model_id for m in state.registry.coverage().values() if m.covered]


def _model_of(state: TrackerState, payload: dict, generates: bool) -> str:
    """The model id a request names; the tokenizer endpoints may name none (as in vLLM):
    then the one model this tracker serves."""
    name = payload.get("model")
    if name is None and not generates:
        known = list(state.registry.coverage())
        served = _covered(state) or known
        if len(served) == 1:
            return served[0]
        which = f"this tracker serves {', '.join(served)}" if served else "no model is served"
        raise InvalidRequest(f"model is required: {which}", param="model")
    if not isinstance(name, str):
        raise InvalidRequest("model is required", param="model")
    return state.resolve_model(name)  # a served name, or the id itself


async def _entry(request: Request, path: str) -> Response:
    """Route an OpenAI request: run the head here (tracker node) or proxy to the chain's head."""
    state = _state(request)
    check_content_type(request, "application/json")
    body = await read_body(request, json_limit(request))
    payload = loads_object(body)
    generates = path.startswith("/v1/")  # not the tokenizer endpoints: no chain runs
    model_id = _model_of(state, payload, generates)
    # whose cached prompts it may share, and its chain holds the prompt's blocks (ADR-0035)
    settings = state.settings
    keyed = bool(settings.api_key or settings.api_key_file)
    tenant = tenant_of(request.headers, keyed=keyed, swarm_token=settings.swarm_token)
    prefix = prefix_key(model_id, payload, tenant) if generates else None

    async def route():
        return state.route(model_id, prefix=prefix)

    # A gap expected to heal (a node of the range loading or restarting) costs latency, not
    # the request: ask again for up to --coverage-wait (docs/adr/0023).
    hops = await wait_for_coverage(route, wait_s=state.settings.coverage_wait_s,
                                   clock=time.monotonic, sleep=asyncio.sleep)  # fmt: skip
    # Never the client's Host header: it would become a hop of the route (docs/adr/0032).
    own = state.settings.advertise_url or server_url(request.scope)
    rest = tuple(state.hop_url(h, own.rstrip("/")) for h in hops[1:])
    if generates:
        state.demand[model_id] += 1
        state.affinity.remember(prefix, tuple((h.node.node_id, h.node.layers, h.start_layer)
                                              for h in hops))  # fmt: skip
    head = hops[0].node
    event(
        logger, logging.INFO, "request routed", path=path, model=model_id, head=head.node_id,
        route=",".join(h.node.node_id for h in hops),
    )  # fmt: skip
    local = state.node is not None and head.node_id == state.node.node_id
    target: Head = state.node if local else RemoteHead(state.client, head.url, tenant=tenant)
    return await target.answer(path, request, rest, body)

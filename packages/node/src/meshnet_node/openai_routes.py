"""HTTP handlers for /v1/completions and /v1/chat/completions over an ``OpenAIServing``."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from meshnet_common.openai_protocol import ChatCompletionRequest, CompletionRequest
from meshnet_node.http_utils import (
    cancel_on_disconnect,
    check_content_type,
    json_limit,
    parse_json,
    read_body,
)
from meshnet_node.openai_serving import OpenAIServing

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def _handle(serving: OpenAIServing, request: Request, route, raw, kind: str):
    """One OpenAI call: parse, plan the jobs, then stream or answer once.

    ``raw``: the body when the caller already read it (the tracker peeks at ``model``).
    """
    if raw is None:
        check_content_type(request, "application/json")
        raw = await read_body(request, json_limit(request))
    if kind == "completions":
        body = parse_json(raw, CompletionRequest)
        jobs, stream, respond = (
            serving.completion_jobs(body),
            serving.completion_stream,
            serving.completion_response,
        )
    else:
        body = parse_json(raw, ChatCompletionRequest)
        jobs, stream, respond = serving.chat_jobs(body), serving.chat_stream, serving.chat_response
    if route is None:
        route = await serving.route_provider(serving.model_id, frozenset())
    if body.stream:
        return StreamingResponse(
            stream(body, jobs, route), media_type="text/event-stream", headers=SSE_HEADERS
        )
    choices = await cancel_on_disconnect(request, serving.run(jobs, route))
    return JSONResponse(respond(body, choices))


async def handle_completions(
    serving: OpenAIServing, request: Request, route=None, raw: bytes | None = None
):
    return await _handle(serving, request, route, raw, "completions")


async def handle_chat(
    serving: OpenAIServing, request: Request, route=None, raw: bytes | None = None
):
    return await _handle(serving, request, route, raw, "chat")

"""HTTP handlers for /v1/completions and /v1/chat/completions over an ``OpenAIServing``, and
for vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from meshnet_common.logs import event
from meshnet_common.openai_protocol import ChatCompletionRequest, CompletionRequest
from meshnet_common.protocol import H_CLIENT_ADDRESS, H_CLIENT_TENANT, H_SWARM_TOKEN
from meshnet_common.tokenize_protocol import (
    DETOKENIZE_PATH,
    TOKENIZE_PATH,
    DetokenizeRequest,
    tokenize_request_type,
)
from meshnet_common.web.auth import same_secret, tenant_of
from meshnet_common.web.http import (
    cancel_on_disconnect,
    check_content_type,
    json_limit,
    loads_object,
    parse_json,
    read_body,
)
from meshnet_node.head.serving import OpenAIServing

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

logger = logging.getLogger(__name__)


def client_of(
    request: Request, body, *, keyed: bool, swarm_token: str | None = None
) -> tuple[str, str]:
    """Who a request is for, as the wait queue takes turns: (client, user). The client is
    what the server checked, never what the request says: the tenant the tracker names beside
    the swarm token (it checked the key), else the API key this server authenticated
    (hashed; ``keyed``: the server checks keys), else the caller's address: the one the
    tracker names when it proxies (believed only beside the swarm token), else the
    connection's. The ``user`` field only takes turns within the client's share."""
    auth = request.headers.get("authorization", "")
    trusted = same_secret(swarm_token, request.headers.get(H_SWARM_TOKEN))
    tenant = request.headers.get(H_CLIENT_TENANT)
    if tenant and trusted:  # the tracker checked the key and names its tenant, not the key
        client = "key:" + tenant[:32]
    elif keyed and auth.lower().startswith("bearer ") and len(auth) > 7:
        client = "key:" + hashlib.sha256(auth[7:].encode()).hexdigest()[:16]
    else:  # no keys (or the swarm token, the tracker's own): any bearer would be a free line
        address = request.client.host if request.client else "unknown"
        forwarded = request.headers.get(H_CLIENT_ADDRESS)
        if forwarded and trusted:
            address = forwarded[:64]
        client = "addr:" + address
    return client, (getattr(body, "user", None) or "")[:64]


async def _handle(serving: OpenAIServing, request: Request, route, raw, kind: str):
    """One OpenAI call: parse, plan the jobs, then stream or answer once.

    ``raw``: the body when the caller already read it (the tracker peeks at ``model``).
    """
    raw = await _body(request, raw)
    if kind == "completions":
        body = parse_json(raw, CompletionRequest)
        stream, respond = serving.completion_stream, serving.completion_response
    else:
        body = parse_json(raw, ChatCompletionRequest)
        stream, respond = serving.chat_stream, serving.chat_response
    jobs = await serving.prepare(body)  # off the event loop, bounded in time
    client, user = client_of(
        request, body, keyed=serving.keyed_clients, swarm_token=serving.swarm_token
    )
    tenant = tenant_of(
        request.headers, keyed=serving.keyed_clients, swarm_token=serving.swarm_token
    )
    jobs = [replace(job, client=client, user=user, tenant=tenant) for job in jobs]
    # One line per request; the prompt itself only at debug level (it may be private).
    event(
        logger, logging.INFO, f"{kind} request", model=body.model, choices=len(jobs),
        prompt_tokens=sum(len(j.prompt_ids) for j in jobs),
        max_tokens=max(j.max_tokens for j in jobs), stream=bool(body.stream),
    )  # fmt: skip
    if logger.isEnabledFor(logging.DEBUG):
        prompt = body.prompt if kind == "completions" else [m.text() for m in body.messages]
        logger.debug("%s prompt: %r", kind, prompt)
    if route is None:
        route = await serving.route()
    if body.stream:
        return StreamingResponse(
            with_keepalive(stream(body, jobs, route)), media_type="text/event-stream",
            headers=SSE_HEADERS,
        )  # fmt: skip
    choices = await cancel_on_disconnect(request, serving.run(jobs, route))
    return JSONResponse(respond(body, choices))


async def _body(request: Request, raw: bytes | None) -> bytes:
    """The JSON body: ``raw`` when the caller (the tracker) read it already."""
    if raw is None:
        check_content_type(request, "application/json")
        raw = await read_body(request, json_limit(request))
    return raw


# A stream silent this long gets an SSE comment: proxies keep it open, and a client with a
# 5 s read timeout (httpx's default) does not give up on a request waiting for coverage.
KEEPALIVE_S = 2.0


async def with_keepalive(events, every_s: float = KEEPALIVE_S):
    """``events`` as they come, with an SSE comment line whenever none came for ``every_s``
    (a failover waiting for missing layers, a long prefill): clients ignore comments,
    proxies see a live connection."""
    source = events.__aiter__()
    upcoming: asyncio.Future | None = None
    try:
        while True:
            if upcoming is None:
                upcoming = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait((upcoming,), timeout=every_s)
            if not done:
                yield ": waiting\n\n"
                continue
            ready, upcoming = upcoming, None
            try:
                item = ready.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if upcoming is not None:
            upcoming.cancel()
            with contextlib.suppress(BaseException):
                await upcoming
        close = getattr(source, "aclose", None)
        if close is not None:
            await close()


async def handle_completions(
    serving: OpenAIServing, request: Request, route=None, raw: bytes | None = None
):
    return await _handle(serving, request, route, raw, "completions")


async def handle_chat(
    serving: OpenAIServing, request: Request, route=None, raw: bytes | None = None
):
    return await _handle(serving, request, route, raw, "chat")


async def handle_tokenize(
    serving: OpenAIServing, request: Request, route=None, raw: bytes | None = None
):
    """vLLM's /tokenize: a text's or a chat's token ids (``route``: unused, no chain runs)."""
    raw = await _body(request, raw)
    body = parse_json(raw, tokenize_request_type(loads_object(raw)))
    return JSONResponse(await serving.tokenize(body))


async def handle_detokenize(
    serving: OpenAIServing, request: Request, route=None, raw: bytes | None = None
):
    """vLLM's /detokenize: the text of token ids."""
    body = parse_json(await _body(request, raw), DetokenizeRequest)
    return JSONResponse(await serving.detokenize(body))


# What a head answers, by path: the tracker node's in-process entry (``answer``).
HANDLERS = {
    "/v1/completions": handle_completions,
    "/v1/chat/completions": handle_chat,
    TOKENIZE_PATH: handle_tokenize,
    DETOKENIZE_PATH: handle_detokenize,
}

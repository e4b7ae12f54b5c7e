"""The data path's requests, answered without FastAPI: ``POST /v1/forward`` (one step),
``DELETE /v1/sessions/{id}`` (free a session down the chain) and ``POST /v1/answers/{id}``
(a tail's direct answer).

Every decode step crosses ``/v1/forward`` once per hop, so its fixed cost is paid per token
per hop. FastAPI's request objects, routing, dependency and exception machinery cost
several hundred microseconds a call on this kind of host (docs/adr/0011). The functions
here take parsed headers and a body and return an ``Answer``, with the same checks and the
same OpenAI-style error bodies as every other route. Two front ends use them:

- ``meshnet_node.dataplane.stream_server``: hop streams (docs/adr/0022), the WebSocket at
  ``/v1/stream`` that nodes keep to each other, one message per request;
- ``meshnet_node.dataplane.forward``: ``ForwardPath``, an ASGI middleware in front of the
  router, for plain HTTP requests from tools and in-process apps.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import NamedTuple

from meshnet_common import wire
from meshnet_common.errors import (
    InvalidRequest,
    MeshnetError,
    NotFound,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from meshnet_common.protocol import (
    H_COMPUTE,
    H_POSITION,
    H_ROUTE,
    H_SESSION_KEY,
    validate_session_id,
)
from meshnet_common.web.auth import PEER_SCOPE_KEY
from meshnet_common.web.http import error_body
from meshnet_node.dataplane import answer_bytes, step_bytes
from meshnet_node.dataplane.links import LINK_PROBE_SESSION
from meshnet_node.dataplane.service import NodeService
from meshnet_node.dataplane.step_bytes import is_step, parse_step
from meshnet_node.dataplane.steps import parse_route
from meshnet_node.engine.sessions import opening_peer

logger = logging.getLogger(__name__)

FORWARD_PATH = "/v1/forward"
SESSIONS_PREFIX = "/v1/sessions/"
SESSIONS_ROUTE = "/v1/sessions/{session_id}"  # the metrics label, as FastAPI's route has it
ANSWERS_PREFIX = "/v1/answers/"  # a tail's direct answer to the head (ADR-0020)
ANSWERS_ROUTE = "/v1/answers/{session_id}"
_COMPUTE = H_COMPUTE.encode()


class Answer(NamedTuple):
    status: int
    body: bytes  # JSON, or a node's step answer (``answer_bytes``)
    headers: tuple[tuple[bytes, bytes], ...] = ()
    error_code: str | None = None  # for meshnet_errors_total


def error_answer(exc: BaseException) -> Answer:
    """A domain error's status and body; anything else is a 500 that names its type only."""
    if isinstance(exc, MeshnetError):
        extra = tuple(
            (k.encode(), v.encode()) for k, v in (getattr(exc, "headers", None) or {}).items()
        )
        return Answer(
            exc.status, json.dumps(exc.to_openai()).encode(), extra, exc.code or exc.error_type
        )
    logger.error("unhandled error on the data path", exc_info=exc)
    body = error_body(f"internal error: {type(exc).__name__}", "internal_error")
    return Answer(500, json.dumps(body).encode(), (), "internal_error")


def method_not_allowed(path: str, allowed: str) -> Answer:
    body = error_body(f"use {allowed} for {path}", "invalid_request_error")
    return Answer(
        405, json.dumps(body).encode(), ((b"allow", allowed.encode()),), "method_not_allowed"
    )


_FORWARD_TYPES = (wire.CONTENT_TYPE, step_bytes.CONTENT_TYPE)


def check_forward_head(headers: Mapping[str, str], limit: int) -> None:
    """What can be refused before the body is read: media type (415) and declared size (413)."""
    declared = headers.get("content-type")
    if declared and declared.split(";")[0].strip().lower() not in _FORWARD_TYPES:
        raise UnsupportedMediaType(
            f"content-type {declared.split(';')[0]!r} is not accepted here; "
            f"send {wire.CONTENT_TYPE} (a step in the headers) or {step_bytes.CONTENT_TYPE}",
            param="content-type",
        )
    length = headers.get("content-length")
    if length is not None:
        try:
            size = int(length)
        except ValueError as exc:
            raise InvalidRequest("bad content-length") from exc
        if size > limit:
            raise PayloadTooLarge(f"body of {length} bytes exceeds the limit of {limit}")


async def forward_answer(
    service: NodeService, headers: Mapping[str, str], body: bytes, peer: str | None = None
) -> Answer:
    """Run one forward step (headers and body already checked against the limits);
    ``peer``: the caller's address, whose sessions here are bounded (docs/adr/0032)."""
    opening_peer.set(peer)  # this task's step only
    # Counted once this task next waits (off the step's critical path).
    asyncio.get_running_loop().call_soon(service.metrics.wire_received.inc, len(body))
    try:
        step, tensor = parse_step(headers, body, max_bytes=service.settings.max_body_bytes)
        result = await service.handle_step(step, tensor)
        answer = result.body if is_step(body) else answer_bytes.to_json(result.body)
    except Exception as exc:  # never kill the node: an error answer
        return error_answer(exc)
    return Answer(200, answer, ((_COMPUTE, result.compute_ms.encode()),))


async def close_answer(service: NodeService, session_id: str, headers: Mapping[str, str]) -> Answer:
    """Free ``session_id`` here and on the hops after this one. A previous hop's link probe
    (closing ``LINK_PROBE_SESSION``, which nobody opened: ``HopLinks.probe_links``) is
    answered 200, so that the probes, twice a heartbeat, log no failure."""
    try:
        validate_session_id(session_id)
        route = parse_route(headers.get(H_ROUTE))
        await service.close_session(session_id, headers.get(H_SESSION_KEY), route)
    except NotFound as exc:
        if session_id == LINK_PROBE_SESSION:
            return Answer(200, b'{"probe":true}')
        return error_answer(exc)
    except Exception as exc:
        return error_answer(exc)
    return Answer(200, json.dumps({"closed": session_id}).encode())


def deliver_answer(service: NodeService, session_id: str, headers: Mapping[str, str],
                   body: bytes) -> Answer:  # fmt: skip
    """A tail's direct answer to one of this head's steps: 200 when a step waited for it,
    404 when none does (the chain's answer came first, or the session is not this head's)."""
    try:
        validate_session_id(session_id)
        raw = headers.get(H_POSITION)
        if raw is None or not (raw.isascii() and raw.isdigit()):
            raise InvalidRequest(f"header {H_POSITION} must be a position", param=H_POSITION)
        if len(body) > MAX_ANSWER_BYTES:
            raise PayloadTooLarge(f"an answer is at most {MAX_ANSWER_BYTES} bytes")
    except MeshnetError as exc:
        return error_answer(exc)
    key = headers.get(H_SESSION_KEY)
    if not service.links.deliver(session_id, key, int(raw), body, headers.get(H_COMPUTE)):
        body = error_body(f"no step of session {session_id} awaits this answer", "not_found_error")
        return Answer(404, json.dumps(body).encode(), (), "not_found_error")
    return Answer(200, b'{"delivered":true}')


MAX_ANSWER_BYTES = 1 << 20


def peer_of(scope) -> str | None:
    """The calling node: its id where the call was signed (docs/adr/0032), else its IP
    address (the port changes with every connection)."""
    node_id = scope.get(PEER_SCOPE_KEY)
    if node_id is not None:
        return f"node:{node_id}"
    client = scope.get("client")
    return client[0] if client else None

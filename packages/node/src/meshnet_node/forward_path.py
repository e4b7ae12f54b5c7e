"""``POST /v1/forward`` as a plain ASGI handler, in front of FastAPI's router.

Every decode step crosses it once per hop, so its fixed cost is paid per token per hop.
FastAPI's request objects, routing, dependency and exception machinery cost several
hundred microseconds a call here; this handler reads the body, runs the step and answers,
with the same checks and the same OpenAI-style error bodies (docs/adr/0011). It sits inside
the auth and observability middlewares, so the swarm token, request ids and metrics apply
as to any other route.
"""

from __future__ import annotations

import json
import logging

from meshnet_common import wire
from meshnet_common.errors import (
    InvalidRequest,
    MeshnetError,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from meshnet_node.http_utils import error_body
from meshnet_node.service import NodeService, parse_step

logger = logging.getLogger(__name__)

FORWARD_PATH = "/v1/forward"


class _Route:
    """What ``scope["route"]`` holds after FastAPI's router: the metrics label reads ``path``."""

    path = FORWARD_PATH


_ROUTE = _Route()
_JSON = [(b"content-type", b"application/json")]


class ForwardPath:
    """ASGI middleware answering ``POST /v1/forward`` for the node in ``app.state.node``."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != FORWARD_PATH:
            await self.app(scope, receive, send)
            return
        service: NodeService | None = getattr(scope["app"].state, "node", None)
        if service is None:  # a tracker without its own layers: no data path here
            await self.app(scope, receive, send)
            return
        scope["route"] = _ROUTE
        try:
            if scope["method"] != "POST":
                raise _MethodNotAllowed()
            headers = _Headers(scope["headers"])
            declared = headers.get("content-type")
            if declared and declared.split(";")[0].strip().lower() != wire.CONTENT_TYPE:
                raise _unsupported(declared)
            limit = service.settings.max_body_bytes
            body = await _read_body(receive, headers.get("content-length"), limit)
            service.metrics.wire_received.inc(len(body))
            step = parse_step(headers, body, max_bytes=limit)
            result = await service.handle_step(step)
        except _MethodNotAllowed:
            scope.setdefault("state", {})["error_code"] = "method_not_allowed"
            message = error_body("use POST for /v1/forward", "invalid_request_error")
            await _answer(send, 405, message, [(b"allow", b"POST")])
            return
        except MeshnetError as exc:
            scope.setdefault("state", {})["error_code"] = exc.code or exc.error_type
            extra = [
                (k.encode(), v.encode()) for k, v in (getattr(exc, "headers", None) or {}).items()
            ]
            await _answer(send, exc.status, exc.to_openai(), extra)
            return
        except Exception as exc:  # never kill the node: a 500 with the error's type
            logger.exception("unhandled error in a forward step")
            scope.setdefault("state", {})["error_code"] = "internal_error"
            message = error_body(f"internal error: {type(exc).__name__}", "internal_error")
            await _answer(send, 500, message)
            return
        payload = result.model_dump_json().encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_JSON, (b"content-length", str(len(payload)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": payload})


class _MethodNotAllowed(Exception):
    pass


class _Headers(dict):
    """Request headers by lower-case name; a repeated header keeps its first value, as
    Starlette's ``Headers.get`` does."""

    def __init__(self, raw) -> None:
        super().__init__()
        for name, value in raw:
            self.setdefault(name.decode("latin-1"), value.decode("latin-1"))


def _unsupported(declared: str) -> MeshnetError:
    return UnsupportedMediaType(
        f"content-type {declared.split(';')[0]!r} is not accepted here; send {wire.CONTENT_TYPE}",
        param="content-type",
    )


async def _read_body(receive, declared: str | None, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` without buffering it."""
    if declared is not None:
        try:
            size = int(declared)
        except ValueError as exc:
            raise InvalidRequest("bad content-length") from exc
        if size > limit:
            raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidRequest("the client went away mid-body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _answer(send, status: int, body: dict, extra=()) -> None:
    payload = json.dumps(body).encode()
    headers = [*_JSON, (b"content-length", str(len(payload)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def install_forward_path(app) -> None:
    """Answer ``/v1/forward`` before routing. Install it before the auth and observability
    middlewares, so that they wrap it."""
    app.add_middleware(ForwardPath)

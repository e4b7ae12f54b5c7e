"""HTTP plumbing shared by node and tracker apps: error mapping, bounded bodies, JSON parsing."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshnet_common.errors import (
    ClientDisconnected,
    InvalidRequest,
    MeshnetError,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)
from meshnet_common.logs import H_REQUEST_ID, accept_request_id, bind_session, request_id_var
from meshnet_common.metrics import CONTENT_TYPE, Metrics
from meshnet_common.protocol import H_SESSION

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def error_body(message: str, error_type: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def install_error_handlers(app: FastAPI) -> None:
    """One place that turns exceptions into OpenAI-style error bodies."""

    @app.exception_handler(MeshnetError)
    async def _domain(request: Request, exc: MeshnetError):
        request.state.error_code = exc.code or exc.error_type  # for meshnet_errors_total
        headers = getattr(exc, "headers", None)
        return JSONResponse(exc.to_openai(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        request.state.error_code = error_type
        return JSONResponse(error_body(str(exc.detail), error_type), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        request.state.error_code = "invalid_request_error"
        return JSONResponse(
            error_body(first.get("msg", "invalid request"), "invalid_request_error", param),
            status_code=400,
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception):
        logger.exception("unhandled error")
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", "internal_error"), status_code=500
        )


def install_observability(app: FastAPI, metrics: Metrics) -> None:
    """Request ids, request and error metrics, failure log lines, and ``GET /metrics``.

    Install it after every other middleware so that it is the outermost one: it then also
    counts what those answer themselves (a 401 from ``install_auth``).
    """
    app.state.metrics = metrics

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    app.add_middleware(ObservabilityMiddleware, metrics=metrics)


_REQUEST_ID = H_REQUEST_ID.encode()
_SESSION = H_SESSION.encode()


class ObservabilityMiddleware:
    """Pure ASGI middleware (streams pass through untouched, context variables stay set)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        offered_id = session = None
        for name, value in scope["headers"]:  # only two headers matter here: no dict
            if name == _REQUEST_ID and offered_id is None:
                offered_id = value.decode("latin-1")
            elif name == _SESSION and session is None:
                session = value.decode("latin-1")
        request_id = accept_request_id(offered_id)
        request_id_var.set(request_id)
        bind_session(session)  # a forward step names its session
        status = 500
        started = time.perf_counter()

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                header = (H_REQUEST_ID.encode(), request_id.encode())
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._record(scope, status, time.perf_counter() - started)

    def _record(self, scope, status: int, seconds: float) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"  # templates: bounded labels
        code = (scope.get("state") or {}).get("error_code")
        record_request(self.metrics, scope["method"], path, status, seconds, code)


def record_request(
    metrics: Metrics, method: str, path: str, status: int, seconds: float, code: str | None
) -> None:
    """Count one answered request (``path``: a route template) and log a failure."""
    metrics.requests.labels(path, str(status)).inc()
    metrics.request_seconds.labels(path).observe(seconds)
    if status >= 400:
        code = code or f"http_{status}"
        metrics.error(status, code)
        level = logging.WARNING if status >= 500 else logging.INFO
        if status == ClientDisconnected.status:
            logger.info("%s %s: the client went away; its generation was stopped", method, path)
        else:
            logger.log(level, "%s %s answered %d (%s)", method, path, status, code)
    else:
        logger.debug("%s %s answered %d in %.3fs", method, path, status, seconds)


class BodyDeadline:
    """Pure ASGI: a request body must arrive within ``seconds`` of its request's start
    (docs/adr/0032); a read past that raises RequestTimeout (408), so a body trickled in a
    byte at a time holds a connection that long at most. Once the body is in, ``receive``
    is the server's own again (a stream's disconnect watch is not timed)."""

    def __init__(self, app, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline, body_done, started = loop.time() + self.seconds, False, False

        async def timed_receive():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):  # no task per read: a timer only
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(
                    f"the request body did not arrive within {self.seconds:g}s"
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def send_seen(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, send_seen)
        except RequestTimeout as exc:  # read outside a route (a middleware): answer here
            if started:
                return
            body = json.dumps(exc.to_openai()).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            await send({"type": "http.response.start", "status": exc.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})


DEFAULT_JSON_LIMIT = 8 << 20  # OpenAI-style JSON bodies


def json_limit(request: Request) -> int:
    """The app's JSON body limit (``--max-request-mb``)."""
    return getattr(request.app.state, "max_request_bytes", DEFAULT_JSON_LIMIT)


def check_content_type(request: Request, *accepted: str) -> None:
    """415 for a body of another media type (a missing type is taken as the expected one)."""
    declared = request.headers.get("content-type")
    if declared and declared.split(";")[0].strip().lower() not in accepted:
        raise UnsupportedMediaType(
            f"content-type {declared.split(';')[0]!r} is not accepted here; send {accepted[0]}",
            param="content-type",
        )


async def read_body(request: Request, limit: int) -> bytes:
    """Read a request body, refusing (413) anything over ``limit`` bytes without buffering it."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {limit}")
        except ValueError as exc:
            raise InvalidRequest("bad content-length") from exc
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_model(request: Request, model: type[M], limit: int = 8 << 20) -> M:
    """Read and parse a JSON body into ``model``; errors become 400 naming the parameter."""
    return parse_json(await read_body(request, limit), model)


def loads_object(body: bytes) -> dict:
    """A JSON object from a request body; anything else (incl. absurd nesting or integers
    too long to parse) is a 400, never a 500."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise InvalidRequest(f"body is not valid JSON: {str(exc)[:200]}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object")
    return data


def parse_json(body: bytes, model: type[M]) -> M:
    """Parse JSON bytes into ``model``; errors become 400 naming the parameter."""
    data = loads_object(body)
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise InvalidRequest(f"{param}: {first.get('msg')}", param=param) from exc


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; cancel it if the client goes away (frees sessions on every hop)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                # Not a CancelledError: an abandoned request is an ordinary answer (499,
                # logged at info, counted under its own code), not a crash with a traceback.
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()

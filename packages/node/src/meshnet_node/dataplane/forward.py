"""``ForwardPath``: the data path answered before FastAPI's router, for plain HTTP requests
(tools, curl, in-process apps), and the hop streams' WebSocket handed to their server.

It sits inside the auth and observability middlewares. The answers themselves are
``meshnet_node.dataplane.handlers``', shared with the hop streams (docs/adr/0011, 0022).
"""

from __future__ import annotations

from meshnet_common.errors import InvalidRequest, MeshnetError, PayloadTooLarge
from meshnet_node.dataplane import answer_bytes
from meshnet_node.dataplane.frames import STREAM_PATH
from meshnet_node.dataplane.handlers import (
    ANSWERS_PREFIX,
    ANSWERS_ROUTE,
    FORWARD_PATH,
    MAX_ANSWER_BYTES,
    SESSIONS_PREFIX,
    SESSIONS_ROUTE,
    Answer,
    check_forward_head,
    close_answer,
    deliver_answer,
    error_answer,
    forward_answer,
    method_not_allowed,
    peer_of,
)
from meshnet_node.dataplane.service import NodeService
from meshnet_node.dataplane.stream_server import serve_stream

_JSON = (b"content-type", b"application/json")
_ANSWER = (b"content-type", answer_bytes.CONTENT_TYPE.encode())  # a node's step answer


def first_values(raw) -> dict[str, str]:
    """ASGI header pairs by lower-case name; a repeated header keeps its first value, as
    Starlette's ``Headers.get`` does."""
    headers: dict[str, str] = {}
    for name, value in raw:
        headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return headers


class _Route:
    """What ``scope["route"]`` holds after FastAPI's router: the metrics label reads ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path


_FORWARD_ROUTE = _Route(FORWARD_PATH)
_SESSIONS_ROUTE = _Route(SESSIONS_ROUTE)
_ANSWERS_ROUTE = _Route(ANSWERS_ROUTE)


class ForwardPath:
    """ASGI middleware answering the data path for the node in ``app.state.node``."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind != "http" and kind != "websocket":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        service: NodeService | None = getattr(scope["app"].state, "node", None)
        if service is None:  # a tracker without its own layers: no data path here
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            if path == STREAM_PATH:  # the hops' own stream (docs/adr/0022)
                await serve_stream(scope, receive, send, service)
            else:
                await self.app(scope, receive, send)
            return
        if path == FORWARD_PATH:
            scope["route"] = _FORWARD_ROUTE
            answer = await self._forward(scope, receive, service)
        elif path.startswith(SESSIONS_PREFIX) and scope["method"] == "DELETE":
            scope["route"] = _SESSIONS_ROUTE
            session_id = path[len(SESSIONS_PREFIX) :]
            answer = await close_answer(service, session_id, first_values(scope["headers"]))
        elif path.startswith(ANSWERS_PREFIX) and scope["method"] == "POST":
            scope["route"] = _ANSWERS_ROUTE
            try:
                body = await _read_body(receive, MAX_ANSWER_BYTES)
            except MeshnetError as exc:
                answer = error_answer(exc)
            else:
                answer = deliver_answer(service, path[len(ANSWERS_PREFIX) :],
                                        first_values(scope["headers"]), body)  # fmt: skip
        else:
            await self.app(scope, receive, send)
            return
        if answer.error_code is not None:
            scope.setdefault("state", {})["error_code"] = answer.error_code
        kind = _ANSWER if answer.body[:4] == answer_bytes.MAGIC else _JSON
        headers = [kind, (b"content-length", str(len(answer.body)).encode()), *answer.headers]
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})

    async def _forward(self, scope, receive, service: NodeService) -> Answer:
        if scope["method"] != "POST":
            return method_not_allowed(FORWARD_PATH, "POST")
        headers = first_values(scope["headers"])
        limit = service.settings.max_body_bytes
        try:
            check_forward_head(headers, limit)
            body = await _read_body(receive, limit)
        except MeshnetError as exc:
            return error_answer(exc)
        return await forward_answer(service, headers, body, peer_of(scope))


async def _read_body(receive, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` without buffering it."""
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


def install_forward_path(app) -> None:
    """Answer the data path before routing. Install it before the auth and observability
    middlewares, so that they wrap it."""
    app.add_middleware(ForwardPath)

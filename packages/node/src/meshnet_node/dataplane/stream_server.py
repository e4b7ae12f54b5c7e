"""The serving end of hop streams (docs/adr/0022): ``GET /v1/stream`` upgraded to a WebSocket
by uvicorn's own WebSocket support, then one message per step, session close or direct
answer (``meshnet_node.dataplane.frames``), each answered on the same stream as soon as it
is done: many sessions' steps are in flight on one stream at once.

The swarm token is checked once, at the handshake (``meshnet_common.web.auth``); a message
that does not parse closes the stream with an error code (1007; 1003 for text), and the
node goes on serving. A step's own errors (bad headers, a session that does not exist, a
body over the limit) are answers with the same status and OpenAI-style body as over HTTP,
and leave the stream open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from meshnet_common.errors import InvalidRequest, PayloadTooLarge
from meshnet_common.logs import H_REQUEST_ID, accept_request_id, bind_session, request_id_var
from meshnet_common.protocol import H_COMPUTE, H_SESSION
from meshnet_common.web.http import error_body, record_request
from meshnet_node.dataplane.frames import (
    H_MAX_MESSAGE,
    MAX_HEADER_BYTES,
    STREAM_PATH,
    SUBPROTOCOL,
    FrameError,
    Kind,
    Request,
    decode_request,
    encode_answer,
)
from meshnet_node.dataplane.handlers import (
    ANSWERS_ROUTE,
    FORWARD_PATH,
    SESSIONS_ROUTE,
    Answer,
    close_answer,
    deliver_answer,
    error_answer,
    forward_answer,
    peer_of,
)
from meshnet_node.dataplane.lanes import H_LANE, H_LANE_DIRECT
from meshnet_node.dataplane.service import NodeService
from meshnet_node.dataplane.step_bytes import is_step

logger = logging.getLogger(__name__)

_COMPUTE = H_COMPUTE.encode()
# Per stream: messages in flight at once (a head's sessions each have a step or two in
# flight; more waits on the socket), and their bytes, in body limits (docs/adr/0032).
MAX_IN_FLIGHT = 512
IN_FLIGHT_BODIES = 4
_LABELS = {Kind.STEP: ("POST", FORWARD_PATH), Kind.CLOSE: ("DELETE", SESSIONS_ROUTE),
           Kind.DELIVER: ("POST", ANSWERS_ROUTE)}  # fmt: skip


def max_message_bytes(max_body_bytes: int) -> int:
    """The largest message a node accepts on a stream: a frame at the body limit plus its
    header (uvicorn's ``ws_max_size``; a larger one closes the stream with 1009)."""
    return max_body_bytes + MAX_HEADER_BYTES + 64


async def _deny(scope, send, status: int, body: bytes) -> None:
    if "websocket.http.response" in scope.get("extensions", {}):
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]  # fmt: skip
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})


async def serve_stream(scope, receive, send, service: NodeService) -> None:
    """One hop stream, from its handshake until either side closes it."""
    if (await receive())["type"] != "websocket.connect":
        return
    if SUBPROTOCOL not in scope.get("subprotocols", ()):
        body = error_body(f"a hop stream speaks {SUBPROTOCOL}: offer it as the subprotocol",
                          "invalid_request_error", param="sec-websocket-protocol")  # fmt: skip
        await _deny(scope, send, 400, json.dumps(body).encode())
        return
    limit = max_message_bytes(service.settings.max_body_bytes)
    headers = [(H_MAX_MESSAGE.encode(), str(limit).encode())]
    lane = service.lanes.header if service.lanes is not None else None
    if lane is not None:  # a decode lane beside this stream (docs/adr/0058)
        headers.append((H_LANE.encode(), lane.encode()))
        headers.append((H_LANE_DIRECT.encode(), b"1"))
    await send({"type": "websocket.accept", "subprotocol": SUBPROTOCOL, "headers": headers})
    stream = _ServerStream(scope, receive, send, service)
    stream.next_receiver()
    await stream.ended  # steps still running finish; answers to a closed stream are dropped


def _peer(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"


class _ServerStream:
    """A stream's messages are read by a chain of receivers: each takes one message, starts
    the next receiver, then answers its message itself. The step runs in the task that was
    woken for it (one wake-up per message, which the idle-cache cost makes worth saving:
    docs/adr/0011), while the next message is read meanwhile, so steps of many sessions
    are in flight at once, started in the order they came.

    In flight at once: at most ``MAX_IN_FLIGHT`` messages and ``IN_FLIGHT_BODIES`` body
    limits' worth of bytes; past either, the next message is read once one is answered
    (the peer waits on the socket, docs/adr/0032)."""

    def __init__(self, scope, receive, send, service: NodeService) -> None:
        self.scope = scope
        self.service = service
        self.peer = peer_of(scope)
        self._receive = receive
        self._send = send
        self.open = True
        self.ended = asyncio.get_running_loop().create_future()
        self.tasks: set[asyncio.Task] = set()
        self.in_flight = self.bytes_in_flight = 0
        self.max_bytes = IN_FLIGHT_BODIES * service.settings.max_body_bytes
        self.reading = False  # a receiver waits for the next message

    def next_receiver(self) -> None:
        self.reading = True
        task = asyncio.ensure_future(self._receive_one())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _read_on(self) -> None:
        """Start the next receiver unless one waits already, the stream ended, or the
        messages in flight are at their bound."""
        if self.reading or self.ended.done():
            return
        if self.in_flight < MAX_IN_FLIGHT and self.bytes_in_flight < self.max_bytes:
            self.next_receiver()

    async def _receive_one(self) -> None:
        try:
            message = await self._receive()
        except BaseException:
            self._end()
            raise
        self.reading = False
        if message["type"] != "websocket.receive":  # websocket.disconnect
            self.open = False
            self._end()
            return
        data = message.get("bytes")
        if data is None:
            await self.close(1003, "hop streams carry binary messages only")
            self._end()
            return
        try:
            request = decode_request(data)
        except FrameError as exc:
            logger.warning("closing a hop stream from %s: %s", _peer(self.scope), exc)
            await self.close(1007, str(exc)[:120])
            self._end()
            return
        size = len(data)
        self.in_flight += 1
        self.bytes_in_flight += size
        self._read_on()
        try:
            await self._answer(request)
        finally:
            self.in_flight -= 1
            self.bytes_in_flight -= size
            self._read_on()

    def _end(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)

    async def close(self, code: int, reason: str) -> None:
        if self.open:
            self.open = False
            with contextlib.suppress(Exception):  # already gone
                await self._send({"type": "websocket.close", "code": code, "reason": reason})

    async def _answer(self, request: Request) -> None:
        started = time.perf_counter()
        headers, service = request.headers, self.service
        if request.kind == Kind.STEP and is_step(request.body):
            request_id_var.set(None)  # the step's own, once read (``parse_step``), if any
            bind_session(None)
        else:
            request_id_var.set(accept_request_id(headers.get(H_REQUEST_ID)))
            bind_session(headers.get(H_SESSION))
        if request.kind == Kind.STEP:
            limit = service.settings.max_body_bytes
            if len(request.body) > limit:
                answer = error_answer(PayloadTooLarge(f"body exceeds the limit of {limit} bytes"))
            else:
                answer = await forward_answer(service, headers, request.body, self.peer)
        else:
            session = headers.get(H_SESSION)
            if session is None:
                answer = error_answer(InvalidRequest(f"header {H_SESSION} names the session",
                                                     param=H_SESSION))  # fmt: skip
            elif request.kind == Kind.CLOSE:
                answer = await close_answer(service, session, headers)
            else:
                answer = deliver_answer(service, session, headers, request.body)
        await self._reply(request.id, answer)
        method, label = _LABELS[request.kind]
        seconds = time.perf_counter() - started
        asyncio.get_running_loop().call_soon(
            record_request, service.metrics, method, label, answer.status, seconds,
            answer.error_code,
        )  # fmt: skip

    async def _reply(self, request_id: int, answer: Answer) -> None:
        if not self.open:
            return  # the stream closed; the step itself ran
        extra = answer.headers
        value = extra[0][1] if len(extra) == 1 and extra[0][0] == _COMPUTE else b"?"
        if not value.translate(None, b"0123456789.,"):  # a step's answer: its compute times
            header = b'{"%s":"%s"}' % (_COMPUTE, value)
        else:
            header = json.dumps(
                {n.decode("latin-1"): v.decode("latin-1") for n, v in extra}
            ).encode()
        message = encode_answer(request_id, answer.status, header, answer.body)
        try:
            await self._send({"type": "websocket.send", "bytes": message})
        except Exception:  # the peer went away meanwhile
            self.open = False


__all__ = ["STREAM_PATH", "max_message_bytes", "serve_stream"]

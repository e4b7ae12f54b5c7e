"""Hop-to-hop HTTP/1.1 served without ASGI, on the node's own port (docs/adr/0011).

Each connection starts here. When its first request (or any later one, at a request
boundary) is a data-path request, ``POST /v1/forward`` or ``DELETE /v1/sessions/{id}``,
this protocol parses it with httptools and answers it directly through
``meshnet_node.dataplane.forward``, in one write. Any other request hands the whole connection
to uvicorn's own protocol (``HttpToolsProtocol``), untouched from its first byte, so every
other route, streaming included, is served exactly as before.

Why: a decode step crosses every hop once, and on a CPU whose caches emptied while the
stage idled each layer of code it passes through costs tens of microseconds. uvicorn's
request cycle, Starlette and the middlewares cost about 0.3 ms per hop per step there.

What it keeps: the swarm token (401), body limits (413, the connection then closes),
media type (415), request ids (``x-request-id`` in and out, log context), the request and
error metrics of every other route, keep-alive with uvicorn's idle timeout, graceful
shutdown. What it does not serve: pipelining (a request sent before the previous answer
closes the connection once that answer is out; hop clients never pipeline) and protocol
upgrades (400).
"""

from __future__ import annotations

import asyncio
import hmac
import http
import logging
import time
from urllib.parse import unquote

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from meshnet_common.errors import InvalidRequest, PayloadTooLarge
from meshnet_common.logs import H_REQUEST_ID, accept_request_id, bind_session, request_id_var
from meshnet_common.protocol import H_SESSION, H_SWARM_TOKEN
from meshnet_common.web.auth import NEEDS_SWARM_TOKEN, unauthorized_body
from meshnet_common.web.http import record_request
from meshnet_node.dataplane.forward import (
    ANSWERS_PREFIX,
    ANSWERS_ROUTE,
    FORWARD_PATH,
    SESSIONS_PREFIX,
    SESSIONS_ROUTE,
    Answer,
    check_forward_head,
    close_answer,
    deliver_answer,
    error_answer,
    forward_answer,
    method_not_allowed,
)

logger = logging.getLogger(__name__)

# How a data-path request line starts; anything else goes to uvicorn.
_DATA_STARTS = (
    b"POST /v1/forward ", b"POST /v1/forward?", b"DELETE /v1/sessions/", b"POST /v1/answers/",
)  # fmt: skip
_LONGEST_START = max(len(s) for s in _DATA_STARTS)
_ANSWERS = ANSWERS_PREFIX.encode()
_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}


def _unauthorized() -> Answer:
    body = unauthorized_body(NEEDS_SWARM_TOKEN)
    return Answer(401, body, ((b"www-authenticate", b"Bearer"),), "unauthorized")


def protocol_factory(app):
    """uvicorn's ``http=`` option: connections of ``app`` start with ``HopServerConnection``."""

    def create(config, server_state, app_state, _loop=None) -> HopServerConnection:
        return HopServerConnection(app, config, server_state, app_state, _loop)

    return create


class HopServerConnection(asyncio.Protocol):
    """One TCP connection: data-path requests answered here, the rest by uvicorn."""

    def __init__(self, app, config, server_state, app_state, _loop=None) -> None:
        self.app = app
        self.config = config
        self.server_state = server_state
        self.app_state = app_state
        self.loop = _loop or asyncio.get_event_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.pending = b""  # the start of a request, too short yet to classify
        self.reading = False  # a data-path request is being parsed
        self.answering = False  # ... or answered (reading is paused meanwhile)
        self.closing = False  # close once the answer is out
        self.idle: asyncio.TimerHandle | None = None
        self._new_request()

    def _new_request(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.refused: Answer | None = None
        self.pipelined = False

    # -- connection ----------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server_state.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc) -> None:
        self.server_state.connections.discard(self)
        self._disarm_idle()
        self.transport = None  # an answer still being computed is dropped when it is done

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close now, or once the answer in progress is out
        (a request still arriving is dropped, as uvicorn does)."""
        if self.answering:
            self.closing = True
        elif self.transport is not None:
            self.transport.close()

    def _arm_idle(self) -> None:
        self._disarm_idle()
        self.idle = self.loop.call_later(self.config.timeout_keep_alive, self._idle_timeout)

    def _disarm_idle(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None

    def _idle_timeout(self) -> None:
        if self.transport is not None and not (self.reading or self.answering):
            self.transport.close()

    def _service(self):
        return getattr(self.app.state, "node", None)

    # -- bytes in ------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if not (self.reading or self.answering):  # at a request boundary: whose request?
            data = self.pending + data
            self.pending = b""
            if not data.startswith(_DATA_STARTS) or self._service() is None:
                if len(data) < _LONGEST_START and any(s.startswith(data) for s in _DATA_STARTS):
                    self.pending = data  # could still become one of ours
                    return
                self._hand_over(data)
                return
            self.reading = True
            self._disarm_idle()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse_now(InvalidRequest("protocol upgrades are not served on the data path"))
        except httptools.HttpParserError as exc:
            self._refuse_now(InvalidRequest(f"malformed HTTP request: {exc}"))

    def _hand_over(self, data: bytes) -> None:
        """Give this connection, from ``data`` on, to uvicorn's own HTTP protocol."""
        self._disarm_idle()
        self.server_state.connections.discard(self)
        protocol = HttpToolsProtocol(
            config=self.config, server_state=self.server_state, app_state=self.app_state,
            _loop=self.loop,
        )  # fmt: skip
        transport, self.transport = self.transport, None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if data:
            protocol.data_received(data)

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.answering:  # a second request before the first was answered
            self.pipelined = True
            return
        self._new_request()

    def on_url(self, url: bytes) -> None:
        if not self.answering:
            self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.answering:
            self.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        if self.answering:
            return
        service = self._service()
        token = getattr(self.app.state, "swarm_token", None)
        offered = self.headers.get(H_SWARM_TOKEN)
        if token and not (offered and hmac.compare_digest(token.encode(), offered.encode())):
            self.refused = _unauthorized()
        elif self.parser.get_method() == b"POST" and not self.url.startswith(_ANSWERS):
            try:
                check_forward_head(self.headers, service.settings.max_body_bytes)
            except PayloadTooLarge as exc:
                self._refuse_now(exc)  # never read a body that is already too large
                return
            except Exception as exc:
                self.refused = error_answer(exc)
        if self.headers.get("expect", "").lower() == "100-continue":
            if self.refused is not None:  # the client waits before sending a body: answer
                self._refuse_now(self.refused)
            elif self.transport is not None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.answering or self.refused is not None:
            return
        self.size += len(body)
        limit = self._service().settings.max_body_bytes
        if self.size > limit:
            self._refuse_now(PayloadTooLarge(f"body exceeds the limit of {limit} bytes"))
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.answering or self.transport is None:
            return
        self.reading, self.answering = False, True
        self.transport.pause_reading()
        method = self.parser.get_method().decode("latin-1")
        keep_alive = self.parser.should_keep_alive()
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        task = self.loop.create_task(
            self._answer(method, self.url, self.headers, body, self.refused, keep_alive)
        )
        self.server_state.tasks.add(task)
        task.add_done_callback(self.server_state.tasks.discard)

    # -- answers -------------------------------------------------------------------------------

    async def _answer(self, method, url, headers, body, refused, keep_alive) -> None:
        started = time.perf_counter()
        request_id = accept_request_id(headers.get(H_REQUEST_ID))
        request_id_var.set(request_id)
        bind_session(headers.get(H_SESSION))
        path = url.split(b"?", 1)[0].decode("latin-1")
        if "%" in path:
            path = unquote(path)
        label = FORWARD_PATH
        service = self._service()
        if refused is not None:
            answer = refused
        elif path == FORWARD_PATH:
            if method == "POST":
                answer = await forward_answer(service, headers, body)
            else:
                answer = method_not_allowed(FORWARD_PATH, "POST")
        elif path.startswith(SESSIONS_PREFIX) and method == "DELETE":
            label = SESSIONS_ROUTE
            answer = await close_answer(service, path[len(SESSIONS_PREFIX) :], headers)
        elif path.startswith(ANSWERS_PREFIX) and method == "POST":
            label = ANSWERS_ROUTE
            answer = deliver_answer(service, path[len(ANSWERS_PREFIX) :], headers, body)
        else:  # "POST /v1/forward/x" and the like: started like ours, is not
            label = "unmatched"
            answer = error_answer(InvalidRequest(f"no data-path route {method} {path[:80]}"))
            answer = answer._replace(status=404, error_code="not_found_error")
        keep = keep_alive and not self.closing and not self.pipelined
        self._write(answer, request_id, keep)
        seconds = time.perf_counter() - started
        self.loop.call_soon(
            record_request, service.metrics, method, label, answer.status, seconds,
            answer.error_code,
        )  # fmt: skip
        self.answering = False
        if self.transport is None:
            return
        if not keep:
            self.transport.close()
            return
        self.transport.resume_reading()
        self._arm_idle()

    def _write(self, answer: Answer, request_id: str, keep_alive: bool) -> None:
        if self.transport is None:
            return  # the caller went away; the step itself ran
        reason = _REASONS.get(answer.status, b"")
        head = [
            b"HTTP/1.1 %d %s\r\n" % (answer.status, reason),
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(answer.body),
            b"%s: %s\r\n" % (H_REQUEST_ID.encode(), request_id.encode()),
        ]
        head.extend(b"%s: %s\r\n" % (name, value) for name, value in answer.headers)
        if not keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        self.transport.write(b"".join(head) + answer.body)

    def _refuse_now(self, refusal: Exception | Answer) -> None:
        """Answer at once and close: the rest of this request will not be read."""
        answer = refusal if isinstance(refusal, Answer) else error_answer(refusal)
        if self.transport is not None:
            self._write(answer, accept_request_id(self.headers.get(H_REQUEST_ID)), False)
            self.transport.close()
        service = self._service()
        if service is not None:
            self.loop.call_soon(
                record_request, service.metrics, "POST", FORWARD_PATH, answer.status, 0.0,
                answer.error_code,
            )  # fmt: skip
        self.reading = False
        self.answering = True  # ignore whatever else arrives before the close

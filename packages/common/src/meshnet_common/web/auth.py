"""Optional shared secrets: a swarm token between services, API keys for clients; and which
browser origins may call the API (CORS).

With ``--swarm-token`` set, every internal route (forward steps, sessions, shard files,
registration, heartbeats, assignment, routes) needs ``x-meshnet-swarm-token``; with
``--api-key`` or ``--api-key-file`` set, the OpenAI routes need ``Authorization: Bearer
<key>`` with any of the keys (or the swarm token, which is how the tracker reaches a head).
Comparisons are constant-time and the secrets are never logged. Without them the swarm is
open (a trusted LAN or a laptop). Calls between nodes carry the calling node's signed
identity too (``peers``: docs/adr/0032). With ``--allowed-origins``, browser pages of those
origins may call the API: their preflights are answered before any key is asked for.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from starlette.middleware.cors import CORSMiddleware

from meshnet_common.config.cli import fail
from meshnet_common.errors import InvalidRequest
from meshnet_common.logs import H_REQUEST_ID
from meshnet_common.protocol import H_CLIENT_TENANT, H_SWARM_TOKEN
from meshnet_common.tokenize_protocol import TOKENIZER_PATHS
from meshnet_common.trust.identity import H_NODE_CALL, H_NODE_CERT, CallChecker, IdentityError
from meshnet_common.web.hosts import HostGate, served_names
from meshnet_common.web.http import BodyDeadline

if TYPE_CHECKING:
    from meshnet_common.config.shard import ShardSettings

INTERNAL_PREFIXES = (
    "/v1/forward", "/v1/sessions", "/v1/shards", "/v1/nodes", "/v1/route", "/v1/node",
    "/v1/answers", "/v1/stream",
)  # fmt: skip
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", *TOKENIZER_PATHS)
# Node-to-node routes: once a node knows its tracker's key, a call here must be signed by a
# node (docs/adr/0032). Shard downloads are not among them: a node fetches before it joins.
NODE_PREFIXES = ("/v1/forward", "/v1/sessions", "/v1/answers", "/v1/stream", "/v1/node/audit",
                 "/v1/node/prefix")  # fmt: skip
DEFAULT_MAX_SIGNED_BODY = 256 * 2**20  # a signed call's body read to check its digest
PEER_SCOPE_KEY = "meshnet.peer"  # the ASGI scope key of a signed call's node id
NEEDS_IDENTITY = (
    "this route takes calls from swarm nodes only: sign them with the node's certificate "
    "(x-meshnet-node-cert, x-meshnet-node-call)"
)


def caller_of(request: Request) -> str:
    """Who calls, for bounds per caller: the node id that signed the call (``node:<id>``),
    else (a swarm without certificates) the connection's address (``addr:<host>``)."""
    peer = request.scope.get(PEER_SCOPE_KEY)
    if peer:
        return f"node:{peer}"
    return "addr:" + (request.client.host if request.client else "unknown")


def _same(secret: str | None, offered: str | None) -> bool:
    return (
        secret is not None
        and offered is not None
        and hmac.compare_digest(secret.encode(), offered.encode())
    )


def _any_same(secrets: tuple[str, ...], offered: str | None) -> bool:
    """Whether ``offered`` is one of ``secrets``: each compared in constant time, and all
    of them always, so the time taken does not tell which key (if any) matched."""
    found = False
    for secret in secrets:
        found |= _same(secret, offered)
    return found


def same_secret(secret: str | None, offered: str | None) -> bool:
    """Whether ``offered`` is ``secret`` (constant time); never when no secret is set."""
    return bool(secret) and _same(secret, offered)


def swarm_headers(token: str | None) -> dict[str, str]:
    """Headers an internal client sends."""
    return {H_SWARM_TOKEN: token} if token else {}


def has_swarm_token(request: Request, token: str | None) -> bool:
    """True when no token is configured (open swarm) or the request carries it."""
    return token is None or _same(token, request.headers.get(H_SWARM_TOKEN))


# -- tenants (docs/adr/0035) -------------------------------------------------------------------

_TENANT = re.compile(r"[0-9a-f]{32}")


def key_tenant(key: str) -> str:
    """The tenant an API key names: a digest of it (BLAKE2b, personalized), never the key
    (which only the server checking keys sees), so that it may travel to other nodes."""
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"meshnet-tenant").hexdigest()


def tenant_of(headers, *, keyed: bool, swarm_token: str | None) -> str | None:
    """Whose cached prompts a request may share (docs/adr/0035): the tenant named in
    ``x-meshnet-client-tenant`` beside the swarm token (the tracker, which checked the key);
    else the API key this server checks (``keyed``); else, in an open swarm (no token), the
    tenant a caller names; None: the cache that keyless clients share."""
    named = headers.get(H_CLIENT_TENANT)
    trusted = same_secret(swarm_token, headers.get(H_SWARM_TOKEN))
    if named is not None and (trusted or swarm_token is None) and not _TENANT.fullmatch(named):
        raise InvalidRequest(f"{H_CLIENT_TENANT} must be 32 hex digits", param=H_CLIENT_TENANT)
    if named is not None and trusted:
        return named
    auth = headers.get("authorization", "")
    if keyed and auth[:7].lower() == "bearer " and len(auth) > 7:
        return key_tenant(auth[7:])
    return named if swarm_token is None else None


_UNAUTHORIZED_HEADERS = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]


NEEDS_SWARM_TOKEN = "this route needs the swarm token"


def unauthorized_body(message: str) -> bytes:
    """The OpenAI-style body of a 401."""
    body = {"error": {"message": message, "type": "authentication_error", "param": None,
                      "code": "invalid_api_key"}}  # fmt: skip
    return json.dumps(body).encode()


async def _unauthorized(send, message: str, scope=None, receive=None) -> None:
    payload = unauthorized_body(message)
    headers = [*_UNAUTHORIZED_HEADERS, (b"content-length", str(len(payload)).encode())]
    prefix = "http"
    if scope is not None and scope["type"] == "websocket":  # refused at the handshake
        await receive()  # websocket.connect
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008})
            return
        prefix = "websocket.http"
    await send({"type": f"{prefix}.response.start", "status": 401, "headers": headers})
    await send({"type": f"{prefix}.response.body", "body": payload})


class AuthMiddleware:
    """Pure ASGI: checks secrets before any route runs (one place for the whole app), at a
    few microseconds a request (the data path crosses it every step).

    ``peers`` (docs/adr/0032): checks the signed identity of calling nodes. A call that
    carries one is attributed to its node id (``scope[PEER_SCOPE_KEY]``); once the tracker
    key is known, node-to-node routes (``NODE_PREFIXES``) refuse (401) a call without one or
    with one that does not check out. A signed call's body is read here (at most
    ``max_body`` bytes, else 413) to check the digest it was signed with, then handed on."""

    def __init__(
        self, app, *, swarm_token: str | None, api_key: str | None,
        peers: CallChecker | None = None, api_keys: Iterable[str] = (),
        max_body: int = DEFAULT_MAX_SIGNED_BODY,
    ) -> None:  # fmt: skip
        self.app = app
        self.swarm_token = swarm_token
        self.api_keys = tuple(key for key in (api_key, *api_keys) if key)  # any of them
        self.peers = peers
        self.max_body = max_body

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        internal = path.startswith(INTERNAL_PREFIXES)
        websocket = kind == "websocket"
        if not internal and (websocket or path not in OPENAI_PATHS):
            await self.app(scope, receive, send)
            return
        headers = _first_values(scope["headers"], _NAMES)
        swarm_ok = _same(self.swarm_token, headers.get(_SWARM))
        if self.swarm_token and internal and not swarm_ok:
            await _unauthorized(send, NEEDS_SWARM_TOKEN, scope, receive)
            return
        if self.api_keys and path in OPENAI_PATHS and not swarm_ok:
            auth = headers.get(_AUTHORIZATION, "")
            offered = auth[7:] if auth.lower().startswith("bearer ") else None
            if not _any_same(self.api_keys, offered):
                await _unauthorized(send, "missing or wrong API key")
                return
        if internal and self.peers is not None:
            body = b""
            if not websocket and (_CERT in headers or _CALL in headers):
                body = await _read_signed_body(receive, self.max_body)
                if body is _GONE:  # the client left mid-body: nobody to answer
                    return
                if body is None:
                    await _refuse(send, 413, f"a signed call's body exceeds {self.max_body} bytes")
                    return
                receive = _replay(body, receive)
            refusal = self._attribute(scope, headers, body)
            if refusal is not None:
                await _unauthorized(send, refusal, scope, receive)
                return
        await self.app(scope, receive, send)

    def _attribute(self, scope, headers: dict[bytes, str], body: bytes) -> str | None:
        """Put the calling node's id in the scope; why the call is refused, if it is."""
        path = scope["path"]
        query = scope.get("query_string") or b""
        target = scope.get("raw_path") or path.encode()
        target = (target + b"?" + query if query else target).decode("latin-1")
        method = "GET" if scope["type"] == "websocket" else scope["method"]
        signed = {H_NODE_CERT: headers.get(_CERT), H_NODE_CALL: headers.get(_CALL)}
        try:
            caller = self.peers.caller(
                method, headers.get(_HOST, ""), target,
                {k: v for k, v in signed.items() if v is not None}, body,
            )  # fmt: skip
        except IdentityError as exc:
            # Only node-to-node routes depend on it; elsewhere (the tracker's routes, with
            # their node secrets) a stale certificate, such as one from before a tracker
            # restart, leaves the call unattributed rather than refused.
            return f"bad node identity: {exc}" if path.startswith(NODE_PREFIXES) else None
        if caller is not None:
            scope[PEER_SCOPE_KEY] = caller
        elif self.peers.required and path.startswith(NODE_PREFIXES):
            return NEEDS_IDENTITY
        return None


_GONE = object()  # the client left before its body ended


async def _read_signed_body(receive, limit: int):
    """The whole request body; None past ``limit`` bytes; ``_GONE`` if the client left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return _GONE
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _replay(body: bytes, receive):
    """A ``receive`` giving ``body`` once, then what the client sends (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


async def _refuse(send, status: int, message: str) -> None:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "payload_too_large"}}  # fmt: skip
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


_SWARM = H_SWARM_TOKEN.encode()
_AUTHORIZATION = b"authorization"
_CERT, _CALL, _HOST = H_NODE_CERT.encode(), H_NODE_CALL.encode(), b"host"
_NAMES = (_SWARM, _AUTHORIZATION, _CERT, _CALL, _HOST)


def _first_values(raw, names: tuple[bytes, ...]) -> dict[bytes, str]:
    found: dict[bytes, str] = {}
    for name, value in raw:
        if name in names and name not in found:
            found[name] = value.decode("latin-1")
    return found


def install_auth(
    app: FastAPI, *, swarm_token: str | None, api_key: str | None,
    peers: CallChecker | None = None, api_keys: tuple[str, ...] = (),
    max_body: int = DEFAULT_MAX_SIGNED_BODY,
) -> None:  # fmt: skip
    """Check secrets and calling nodes before any route runs; nothing to check without
    secrets or a ``peers`` checker. ``api_keys``: more keys, each as good as ``api_key``;
    ``max_body``: the largest signed call whose body digest is checked."""
    app.state.swarm_token = swarm_token  # the data path's own front end checks it too
    if swarm_token or api_key or api_keys or peers is not None:
        app.add_middleware(
            AuthMiddleware, swarm_token=swarm_token, api_key=api_key, peers=peers,
            api_keys=api_keys, max_body=max_body,
        )  # fmt: skip


def install_access(app: FastAPI, settings: ShardSettings, *, peers: CallChecker | None) -> None:
    """Who may call ``app``, as ``settings`` say: the swarm token, the API keys (--api-key
    and those of --api-key-file) and calling nodes (``install_auth``), then the browser
    origins allowed (``install_cors``, outside the key check: preflights carry no key);
    outside both, the Host names it answers to (``HostGate``) and the deadline on request
    bodies (``BodyDeadline``); ``serve`` caps the connections of one address."""
    install_auth(
        app, swarm_token=settings.swarm_token, api_key=settings.api_key, peers=peers,
        api_keys=read_api_keys(settings.api_key_file),
        max_body=max(settings.max_body_bytes, settings.max_request_bytes),
    )  # fmt: skip
    install_cors(app, settings.allowed_origins)
    app.add_middleware(BodyDeadline, seconds=settings.body_timeout_s)
    names = served_names(
        settings.allowed_hosts, getattr(settings, "advertise_url", None),
        hosts=(getattr(settings, "host", ""),),
    )  # fmt: skip
    app.add_middleware(HostGate, names=names)
    app.state.connections_per_address = settings.max_connections_per_address


# -- API key files ----------------------------------------------------------------------------


def read_api_keys(path: Path | None) -> tuple[str, ...]:
    """The keys of an --api-key-file: one a line, blank lines and ``#`` comments skipped.
    ValueError, in one line that never shows the file's content, when the file is missing,
    unreadable or holds no key."""
    if path is None:
        return ()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--api-key-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ValueError(f"--api-key-file {path}: cannot be read ({why})") from None
    lines = (line.strip() for line in text.splitlines())
    keys = tuple(dict.fromkeys(line for line in lines if line and not line.startswith("#")))
    if not keys:
        raise ValueError(f"--api-key-file {path}: holds no key (one a line; # starts a comment)")
    return keys


def check_api_key_file(prog: str, path: Path | None) -> None:
    """The CLIs' check of --api-key-file: one error line and exit 2 when it is no use."""
    try:
        read_api_keys(path)
    except ValueError as exc:
        fail(prog, str(exc))


# -- CORS ---------------------------------------------------------------------------------------


def install_cors(app: FastAPI, origins: Iterable[str]) -> None:
    """Let browser pages of ``origins`` (``*``: any) call ``app`` (Open WebUI and the like).
    Install it after ``install_auth``: it must run first, since a preflight carries no key."""
    origins = tuple(origins)
    if origins:
        app.add_middleware(CorsGate, origins=origins)


class CorsGate:
    """Pure ASGI: a request from an allowed origin goes through Starlette's
    ``CORSMiddleware`` (a preflight answered there, any other answer given the CORS
    headers); any other request goes straight on, so another origin gets no CORS header
    and its preflight the app's own answer (an OpenAI-style error)."""

    def __init__(self, app, *, origins: tuple[str, ...]) -> None:
        self.app = app
        self.cors = CORSMiddleware(
            app, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
            expose_headers=[H_REQUEST_ID],
        )  # fmt: skip

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            origin = next((v for k, v in scope["headers"] if k == _ORIGIN), None)
            if origin is not None and self.cors.is_allowed_origin(origin.decode("latin-1")):
                await self.cors(scope, receive, send)
                return
        await self.app(scope, receive, send)


_ORIGIN = b"origin"

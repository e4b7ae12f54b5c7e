"""Optional shared secrets: a swarm token between services, API keys for clients.

With ``--swarm-token`` set, every internal route (forward steps, sessions, shard files,
registration, heartbeats, assignment, routes) needs ``x-meshnet-swarm-token``; with
``--api-key`` set, the OpenAI routes need ``Authorization: Bearer <key>`` (or the swarm
token, which is how the tracker reaches a head). Comparisons are constant-time and the
secrets are never logged. Without them the swarm is open (a trusted LAN or a laptop).
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from meshnet_common.protocol import H_SWARM_TOKEN

INTERNAL_PREFIXES = (
    "/v1/forward", "/v1/sessions", "/v1/shards", "/v1/nodes", "/v1/route", "/v1/node",
)  # fmt: skip
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


def _same(secret: str | None, offered: str | None) -> bool:
    return (
        secret is not None
        and offered is not None
        and hmac.compare_digest(secret.encode(), offered.encode())
    )


def swarm_headers(token: str | None) -> dict[str, str]:
    """Headers an internal client sends."""
    return {H_SWARM_TOKEN: token} if token else {}


def has_swarm_token(request: Request, token: str | None) -> bool:
    """True when no token is configured (open swarm) or the request carries it."""
    return token is None or _same(token, request.headers.get(H_SWARM_TOKEN))


def _unauthorized(message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "authentication_error", "param": None,
                      "code": "invalid_api_key"}}  # fmt: skip
    return JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})


def install_auth(app: FastAPI, *, swarm_token: str | None, api_key: str | None) -> None:
    """Check secrets before any route runs (one place for the whole app)."""
    if not swarm_token and not api_key:
        return

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        path = request.url.path
        swarm_ok = _same(swarm_token, request.headers.get(H_SWARM_TOKEN))
        if swarm_token and path.startswith(INTERNAL_PREFIXES) and not swarm_ok:
            return _unauthorized("this route needs the swarm token")
        if api_key and path in OPENAI_PATHS and not swarm_ok:
            auth = request.headers.get("authorization", "")
            offered = auth[7:] if auth.lower().startswith("bearer ") else None
            if not _same(api_key, offered):
                return _unauthorized("missing or wrong API key")
        return await call_next(request)

"""The tracker proxying to a head names the client's address (docs/adr/0032), so that a
head behind it takes turns by client and not by tracker; the client's own API key is not
passed on (a member head never sees a tenant's key)."""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import FastAPI
from starlette.requests import Request

from meshnet_common.protocol import H_CLIENT_ADDRESS
from meshnet_common.web.auth import install_auth, swarm_headers
from meshnet_tracker.heads import RemoteHead


def test_the_proxied_request_names_the_clients_address():
    seen: list[httpx.Headers] = []

    def head(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={"ok": True})

    async def run() -> int:
        client = httpx.AsyncClient(transport=httpx.MockTransport(head))
        headers = [(b"authorization", b"Bearer sk-tenant-a")]
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
                 "client": ("203.0.113.9", 51000), "query_string": b""}  # fmt: skip
        try:
            resp = await RemoteHead(client, "http://head.test").answer(
                "/v1/completions", Request(scope), (), b"{}"
            )
            return resp.status_code
        finally:
            await client.aclose()

    assert asyncio.run(run()) == 200
    assert seen[0][H_CLIENT_ADDRESS] == "203.0.113.9"
    assert "authorization" not in seen[0]  # the tenant's key never reaches a member head


def test_a_head_checking_api_keys_takes_the_trackers_call_by_the_swarm_token():
    """The public API keeps working through the tracker without the tenant's key: the head
    (its own --api-key-file) accepts the tracker's proxied call by the swarm token."""
    head_app = FastAPI()

    @head_app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        return {"authorization": request.headers.get("authorization")}

    install_auth(head_app, swarm_token="swarm-1", api_key=None, api_keys=("sk-tenant-a",))

    async def run(token: str | None) -> httpx.Response:
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(head_app), headers=swarm_headers(token)
        )  # the tracker's client
        headers = [(b"authorization", b"Bearer sk-tenant-a")]
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": headers, "client": ("203.0.113.9", 51000), "query_string": b""}  # fmt: skip
        try:
            return await RemoteHead(client, "http://head.test").answer(
                "/v1/completions", Request(scope), (), b"{}"
            )
        finally:
            await client.aclose()

    answered = asyncio.run(run("swarm-1"))
    assert answered.status_code == 200
    assert json.loads(answered.body) == {"authorization": None}  # the key stayed behind
    assert asyncio.run(run(None)).status_code == 401  # no swarm token: the head asks for a key

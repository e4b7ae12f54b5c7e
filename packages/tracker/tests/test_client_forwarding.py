"""The tracker proxying to a head names the client's address (docs/adr/0032), so that a
head behind it takes turns by client and not by tracker; the client's own API key is not
passed on (a member head never sees a tenant's key)."""

from __future__ import annotations

import asyncio

import httpx
from starlette.requests import Request

from meshnet_common.protocol import H_CLIENT_ADDRESS
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

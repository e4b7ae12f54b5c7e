"""Tests only: the hop-client contract (``HopTransport``) over an ``httpx.AsyncClient``, so
in-process tests can route hops to ASGI apps through an httpx transport."""

from __future__ import annotations

import httpx

from meshnet_common.protocol import H_COMPUTE
from meshnet_node.dataplane.streams import HopResponse, HopUnreachable


class HttpxHops:
    """The same contract over an ``httpx.AsyncClient`` (in-process tests use its transports)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def request(
        self, method: str, url: str, *, headers: dict[str, str], body: bytes | None, timeout: float
    ) -> HopResponse:
        try:
            resp = await self.client.request(
                method, url, content=body, headers=headers, timeout=timeout
            )
        except httpx.HTTPError as exc:
            raise HopUnreachable(f"{type(exc).__name__}: {exc}") from exc
        return HopResponse(resp.status_code, resp.content, resp.headers.get(H_COMPUTE))

    async def aclose(self) -> None:
        await self.client.aclose()

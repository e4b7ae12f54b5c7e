"""The HTTP client a node uses to reach the next hop of a route (the data path).

Every decode step crosses each hop once, so the client's own cost is paid per token per
hop. aiohttp (C-accelerated HTTP parsing, persistent keep-alive connections) costs about a
third of httpx per request on this kind of machine (docs/adr/0010); ``HttpxHops`` keeps
in-process tests able to route hops to ASGI apps through an httpx transport.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple, Protocol

import aiohttp
import httpx


class HopResponse(NamedTuple):
    status: int
    body: bytes


class HopUnreachable(Exception):
    """The hop could not be reached, dropped the connection, or did not answer in time."""


class HopTransport(Protocol):
    async def request(
        self, method: str, url: str, *, headers: dict[str, str], body: bytes | None, timeout: float
    ) -> HopResponse: ...

    async def aclose(self) -> None: ...


class AiohttpHops:
    """Keep-alive connections to the next hops; one aiohttp session per event loop."""

    def __init__(self, *, headers: dict[str, str], connect_timeout: float) -> None:
        self.headers = headers
        self.connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session is bound to the loop that made it (tests run several loops).
            self._loop = loop
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                connector=aiohttp.TCPConnector(limit=128, limit_per_host=64),
                auto_decompress=False,
            )
        return self._session

    async def request(
        self, method: str, url: str, *, headers: dict[str, str], body: bytes | None, timeout: float
    ) -> HopResponse:
        limits = aiohttp.ClientTimeout(total=timeout, sock_connect=self.connect_timeout)
        try:
            async with self._client().request(
                method, url, data=body, headers=headers, timeout=limits
            ) as resp:
                return HopResponse(resp.status, await resp.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise HopUnreachable(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed and self._loop is asyncio.get_running_loop():
            await session.close()


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
        return HopResponse(resp.status_code, resp.content)

    async def aclose(self) -> None:
        await self.client.aclose()

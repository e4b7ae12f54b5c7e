"""Where the tracker sends an OpenAI request: the head of the chosen chain. A head is either
remote (another node: the request is proxied to it) or the tracker node in this process
(``meshnet_tracker.tracker_node``, which needs the node package). Both answer one way."""

from __future__ import annotations

from typing import Protocol

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from meshnet_common.errors import HopError
from meshnet_common.logs import H_REQUEST_ID, request_id_var
from meshnet_common.metrics import Metrics
from meshnet_common.protocol import (
    H_CLIENT_ADDRESS,
    H_CLIENT_TENANT,
    H_ROUTE,
    Heartbeat,
    NodeAnnouncement,
)
from meshnet_common.web.swarm_client import IDENTITY, limit, read_capped

# A head's answer the tracker holds whole (not a stream) is at most this long (docs/adr/0032).
ANSWER_LIMIT = 64 << 20


class Head(Protocol):
    """Answers one OpenAI request along the route ``rest`` (the hops after the head); or one
    of vLLM's tokenizer requests (``/tokenize``, ``/detokenize``), which need no chain."""

    async def answer(
        self, path: str, request: Request, rest: tuple[str, ...], body: bytes
    ) -> Response: ...


class LocalNode(Head, Protocol):
    """The tracker node as the tracker sees it: a head it can call in-process, a node it
    registers and heartbeats for, a data path and routes it mounts on its own app."""

    node_id: str
    metrics: Metrics

    def announcement(self) -> NodeAnnouncement: ...

    def heartbeat(self) -> Heartbeat: ...

    def probe(self, urls: tuple[str, ...]) -> None: ...  # the next hops whose links to time

    def attach(self, state) -> None:
        """Route through ``state`` (the tracker's own coverage map) from now on."""

    def install_data_path(self, app) -> None: ...

    def mount(self, app) -> None: ...

    def ws_max_size(self) -> int: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class RemoteHead:
    """A head node elsewhere: the request is proxied, streams relayed as they come.
    ``tenant``: whose cached prompts the request may share (``web.auth.tenant_of``), named
    to the head beside the swarm token (the client's own key never travels for it)."""

    def __init__(self, client: httpx.AsyncClient, url: str, *, tenant: str | None = None) -> None:
        self.client = client
        self.url = url
        self.tenant = tenant

    async def answer(
        self, path: str, request: Request, rest: tuple[str, ...], body: bytes
    ) -> Response:
        headers = {"content-type": "application/json", H_ROUTE: ",".join(rest), **IDENTITY}
        if request_id := request_id_var.get():  # the head logs under the same request id
            headers[H_REQUEST_ID] = request_id
        # The client's API key stays here: it authenticated the client to the tracker only.
        # A head checking keys takes the tracker's proxied calls by the swarm token.
        if request.client is not None:  # its queue takes turns by client, not by tracker
            headers[H_CLIENT_ADDRESS] = request.client.host
        if self.tenant is not None:  # its prefix cache keeps each key's prompts apart
            headers[H_CLIENT_TENANT] = self.tenant
        url = self.url + path
        try:
            upstream = await self.client.send(
                self.client.build_request(  # a stream is relayed, never held: no limit
                    "POST", url, content=body, headers=headers, extensions=limit(None)
                ),
                stream=True,
            )
        except httpx.HTTPError as exc:
            raise HopError(f"head node {url} unreachable: {exc}", hop=url) from exc
        streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")
        if not streaming or upstream.status_code != 200:
            try:
                content = await read_capped(upstream, ANSWER_LIMIT)
            except httpx.HTTPError as exc:
                raise HopError(f"head node {url}: {exc}", hop=url) from exc
            finally:
                await upstream.aclose()
            return Response(
                content,
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type", "application/json"),
            )

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

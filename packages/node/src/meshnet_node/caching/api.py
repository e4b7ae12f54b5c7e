"""The prefix cache between nodes (docs/adr/0035): ``POST /v1/node/prefix/{session_id}``.

A head about to open a session asks every hop of the route at once how many of the prompt's
first blocks it holds (``{"blocks": [hash, ...]}`` -> ``{"held": n}``); each hop promises
the entry to that session for ``store.PIN_S``, so that it is still there when the opening
step arrives (a caller holds a bounded number of promises: ``store.MAX_PINS_PER_PEER``).
The session then starts after the fewest blocks any hop holds. Like the data path, the
route takes signed calls from swarm members only (``NODE_PREFIXES``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

import httpx
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from meshnet_common.protocol import validate_session_id
from meshnet_common.web import tls
from meshnet_common.web.auth import caller_of, swarm_headers
from meshnet_common.web.swarm_client import swarm_async_client

logger = logging.getLogger(__name__)

PREFIX_PATH = "/v1/node/prefix/{session_id}"
PROBE_TIMEOUT_S = 2.0  # a hop slower than this to answer is counted as holding nothing
MAX_BLOCKS = 4096  # 512k tokens of prompt


class PrefixProbe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    blocks: list[Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]] = Field(max_length=MAX_BLOCKS)


def prefix_router() -> APIRouter:
    router = APIRouter()

    @router.post(PREFIX_PATH)
    async def held(session_id: str, probe: PrefixProbe, request: Request) -> dict:
        validate_session_id(session_id)
        service = request.app.state.node
        cache = service.stage.sessions.prefix
        if cache is None or not probe.blocks:
            return {"held": 0}
        return {"held": cache.pin(session_id, probe.blocks, peer=caller_of(request))}

    return router


class PrefixClient:
    """A head's probes to the hops of a route, over plain HTTP with the swarm token, signed
    once the node is certified (docs/adr/0032)."""

    def __init__(self, swarm_token: str | None, identity=None) -> None:
        hooks = {"request": [identity.sign_async_request]} if identity is not None else None
        self.client = swarm_async_client(  # {"held": n}: a few bytes
            max_bytes=4096, timeout=PROBE_TIMEOUT_S, headers=swarm_headers(swarm_token),
            verify=tls.client_context(), event_hooks=hooks,
        )  # fmt: skip

    async def held(self, hop: str, session_id: str, hashes: list[str]) -> int:
        """Blocks of ``hashes`` that ``hop`` holds and keeps for ``session_id`` (0 when it
        cannot say: an older node, a slow or failed call)."""
        url = f"{hop.rstrip('/')}{PREFIX_PATH.format(session_id=session_id)}"
        try:
            resp = await self.client.post(url, json={"blocks": hashes})
            resp.raise_for_status()
            return max(0, min(int(resp.json()["held"]), len(hashes)))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.debug("prefix probe of %s failed: %s", hop, exc)
            return 0

    async def held_by_all(self, route, session_id: str, hashes: list[str]) -> int:
        counts = await asyncio.gather(*(self.held(hop, session_id, hashes) for hop in route))
        return min(counts, default=len(hashes))

    async def aclose(self) -> None:
        await self.client.aclose()

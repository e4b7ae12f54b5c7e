"""A node's membership in a swarm: register, heartbeat, re-register, deregister."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from meshnet_common.errors import MeshnetError, ModelNotCovered
from meshnet_common.protocol import (
    Heartbeat,
    HeartbeatResponse,
    NodeAnnouncement,
    RegisterResponse,
    RouteResponse,
)
from meshnet_node.auth import swarm_headers

logger = logging.getLogger(__name__)

BACKOFF_START_S = 0.5
BACKOFF_CAP_S = 5.0


class TrackerClient:
    """Talks to the tracker on behalf of one node."""

    def __init__(
        self, tracker_url: str, *, timeout: float = 5.0, swarm_token: str | None = None
    ) -> None:
        self.base = tracker_url.rstrip("/")
        self.client = httpx.AsyncClient(timeout=timeout, headers=swarm_headers(swarm_token))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def register(self, announcement: NodeAnnouncement) -> RegisterResponse:
        resp = await self.client.post(
            f"{self.base}/v1/nodes/register", content=announcement.model_dump_json()
        )
        resp.raise_for_status()
        return RegisterResponse.model_validate_json(resp.content)

    async def heartbeat(self, beat: Heartbeat) -> HeartbeatResponse:
        resp = await self.client.post(
            f"{self.base}/v1/nodes/heartbeat", content=beat.model_dump_json()
        )
        resp.raise_for_status()
        return HeartbeatResponse.model_validate_json(resp.content)

    async def deregister(self, node_id: str) -> None:
        resp = await self.client.delete(f"{self.base}/v1/nodes/{node_id}")
        if resp.status_code not in (200, 404):
            resp.raise_for_status()

    async def route(
        self, model_id: str, head_node_id: str, exclude: frozenset[str] = frozenset()
    ) -> RouteResponse:
        """A chain for ``model_id`` starting at this head (503 from the tracker if none)."""
        try:
            resp = await self.client.get(
                f"{self.base}/v1/route",
                params={
                    "model": model_id,
                    "head": head_node_id,
                    "exclude": ",".join(sorted(exclude)),
                },
            )
        except httpx.HTTPError as exc:
            raise ModelNotCovered(f"tracker unreachable for routing: {exc}") from exc
        if resp.status_code != 200:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:200]
            if resp.status_code == 503:  # no chain right now: the head may ask again
                raise ModelNotCovered(message, code="model_not_covered")
            error = MeshnetError(message)
            error.status = resp.status_code
            raise error
        return RouteResponse.model_validate_json(resp.content)


class Membership:
    """Keeps a node registered: heartbeats every interval, re-registers when forgotten."""

    def __init__(
        self,
        client: TrackerClient,
        announcement: Callable[[], NodeAnnouncement],
        heartbeat: Callable[[], Heartbeat],
        interval_s: float,
        on_directives: Callable[[tuple], None] | None = None,
    ) -> None:
        self.client = client
        self.announcement = announcement
        self.heartbeat = heartbeat
        self.interval_s = interval_s
        self.on_directives = on_directives
        self.registered = asyncio.Event()

    async def register_until_accepted(self) -> None:
        delay = BACKOFF_START_S
        attempt = 0
        while True:
            attempt += 1
            try:
                reply = await self.client.register(self.announcement())
                self.interval_s = reply.heartbeat_interval_s
                self.registered.set()
                logger.info("registered with tracker %s", self.client.base)
                return
            except (httpx.HTTPError, ValueError) as exc:
                # The tracker may simply still be starting: only persistent failure is a warning.
                level = logging.INFO if attempt <= 5 else logging.WARNING
                logger.log(level, "tracker registration failed (%s); retry in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_CAP_S)

    async def run(self) -> None:
        """Register, then heartbeat forever (cancel to stop)."""
        await self.register_until_accepted()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                reply = await self.client.heartbeat(self.heartbeat())
            except (httpx.HTTPError, ValueError) as exc:
                logger.warning("heartbeat failed: %s", exc)
                continue
            if not reply.known:  # the tracker restarted and lost its soft state
                logger.info("tracker does not know this node; registering again")
                await self.register_until_accepted()
            if reply.directives:
                for directive in reply.directives:
                    logger.info("directive %s %s", directive.kind.value, directive.shard)
                if self.on_directives is not None:
                    self.on_directives(reply.directives)

    async def leave(self, node_id: str) -> None:
        try:
            await self.client.deregister(node_id)
            logger.info("deregistered from tracker")
        except httpx.HTTPError as exc:
            logger.warning("could not deregister: %s", exc)

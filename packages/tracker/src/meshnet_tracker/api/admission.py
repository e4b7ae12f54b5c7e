"""Admitting a node: the address the swarm reaches it at, confirmed by calling it back.

A node that binds ``0.0.0.0`` (or its default ``127.0.0.1``) cannot know which of its
addresses other machines can dial. The tracker can: it sees the address the node's
registration came from. Unless the operator gave ``--advertise-url``, a wildcard host, or a
loopback host when the node connects from another host, is replaced with that source address.
Before a serving node enters the map the tracker calls it back on ``GET /health`` at that
address and checks the node id; a node it cannot reach is refused with a message naming
``--advertise-url`` instead of being routed to and failing every request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import urlsplit

import httpx

from meshnet_common.errors import InvalidRequest
from meshnet_common.web.hosts import ip_of as _ip
from meshnet_common.web.hosts import is_loopback, require_https
from meshnet_common.web.swarm_client import IDENTITY, read_capped

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})
CALLBACK_ATTEMPTS = 4  # the node may still be opening its socket when it registers
CALLBACK_BACKOFF_S = 0.25
MAX_ANSWER = 4096  # bytes of a /health answer read at most


class NodeUnreachable(InvalidRequest):
    """The tracker could not reach a registering node at its advertised address (400)."""

    def __init__(self, message: str, *, param: str | None = "url") -> None:
        super().__init__(message, param=param, code="node_unreachable")


def is_wildcard(host: str | None) -> bool:
    return (host or "") in WILDCARD_HOSTS or (
        (ip := _ip(host or "")) is not None and ip.is_unspecified
    )


def url_with_host(url: str, host: str) -> str:
    parts = urlsplit(url)
    ip = _ip(host)
    netloc = f"[{ip}]" if ip is not None and ip.version == 6 else host
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    return f"{parts.scheme}://{netloc}"


def reachable_url(url: str, explicit: bool, source: str | None, *, https_only: bool = False) -> str:
    """The URL to reach a node at, from what it announced and where it registered from.

    ``source``: the peer address of the registration (None or a non-IP when unknown);
    ``https_only``: the tracker serves TLS, so a plain ``http://`` node is refused.
    Raises InvalidRequest for an explicit URL no other machine could dial.
    """
    if https_only:
        try:
            require_https(url, "the node's URL")
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="url", code="insecure_url") from exc
    host = urlsplit(url).hostname
    source_ip = _ip(source or "")
    if explicit:
        if is_wildcard(host):
            raise InvalidRequest(
                f"--advertise-url {url} names a wildcard address, which other machines cannot "
                "dial: give this machine's address as the swarm sees it",
                param="url",
                code="bad_advertise_url",
            )
        if is_loopback(host) and source_ip is not None and not source_ip.is_loopback:
            raise InvalidRequest(
                f"--advertise-url {url} is a loopback address, but the node connects from "
                f"{source}: other machines cannot reach it there; give its address as the swarm "
                "sees it",
                param="url",
                code="bad_advertise_url",
            )
        return url
    if source_ip is None:
        return url  # in-process callers: nothing better to go on
    if is_wildcard(host) or (is_loopback(host) and not source_ip.is_loopback):
        return url_with_host(url, str(source_ip))
    return url


async def confirm_reachable(
    client: httpx.AsyncClient, url: str, node_id: str, *, explicit: bool, timeout_s: float = 3.0
) -> None:
    """Call the node back on ``/health``; NodeUnreachable unless it answers as ``node_id``.

    ``client`` carries no credential (``/health`` is public; a URL a registering party named
    must not receive the swarm token) and follows no redirect. The call-back reads at most
    ``MAX_ANSWER`` bytes and fails with one message whatever went wrong (a closed port, an
    open one answering something else, a timeout): the registering party learns nothing of
    the address it named (docs/adr/0032). The detail goes to the tracker's log."""
    problem = "no answer"
    for attempt in range(CALLBACK_ATTEMPTS):
        try:
            answered = await _health_id(client, f"{url}/health", timeout_s)
            if answered == node_id:
                return
            problem = f"answered as node {answered!r}"
            if answered is not None:
                break  # another process holds that address: retrying does not help
        except (httpx.HTTPError, ValueError) as exc:
            problem = type(exc).__name__
        if attempt + 1 < CALLBACK_ATTEMPTS:
            await asyncio.sleep(CALLBACK_BACKOFF_S * (attempt + 1))
    logger.info("call-back of node %s at %s failed: %s", node_id, url, problem)
    hint = (
        "check that --advertise-url is this node's address as other machines see it"
        if explicit
        else "start the node with --host 0.0.0.0 (or its LAN address) and "
        "--advertise-url http://ADDRESS:PORT that the tracker and the other nodes can reach"
    )
    raise NodeUnreachable(f"the tracker cannot reach node {node_id} at {url}: {hint}")


async def _health_id(client: httpx.AsyncClient, url: str, timeout_s: float) -> str | None:
    """The node id a ``/health`` answer names (None: not a meshnet node's answer), reading
    at most ``MAX_ANSWER`` bytes."""
    # Raw bytes only: a compressed answer would be decoded before anything could count it.
    async with client.stream("GET", url, timeout=timeout_s, headers=IDENTITY) as resp:
        if resp.status_code != 200:
            return None
        body = await read_capped(resp, MAX_ANSWER)
    answer = json.loads(body)
    node_id = answer.get("node_id") if isinstance(answer, dict) else None
    return node_id if isinstance(node_id, str) else None

"""HTTP clients for calls between swarm members: answers are read as sent, under a limit.

httpx decodes ``Content-Encoding: gzip, br, deflate, zstd`` with no bound on the output:
4 KiB of zstd from a peer becomes 128 MiB in one call, before any caller can count it.
A swarm client therefore asks for ``Accept-Encoding: identity``, refuses an answer with any
other ``Content-Encoding`` as soon as its head arrives, and counts the raw bytes of the body
as they come, refusing the answer past its limit (docs/adr/0032). Every read path goes through
that count (``.content``, ``.json()``, ``aread()``, ``aiter_bytes()``, ``aiter_raw()``).

The limit is the client's (``max_bytes``); one call may set its own with
``extensions=limit(n)`` (``limit(None)``: no limit, for a stream relayed as it comes).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

IDENTITY = {"accept-encoding": "identity"}
MAX_BYTES = "meshnet_max_bytes"  # a request extension: this call's answer limit
CONTROL_LIMIT = 16 << 20  # control-plane answers (coverage maps, routes, registrations)


class AnswerRefused(httpx.DecodingError):
    """A peer's answer this process does not read: compressed, or longer than its limit."""


def limit(max_bytes: int | None) -> dict[str, Any]:
    """The ``extensions`` of a call whose answer may hold at most ``max_bytes`` bytes."""
    return {MAX_BYTES: max_bytes}


def _cap(response: httpx.Response, default: int | None) -> int | None:
    """The answer's byte limit after checking its head; AnswerRefused for a compressed
    answer or one declaring more bytes than the limit."""
    request = response.request
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise AnswerRefused(
            f"{request.url.host} answered with content-encoding {encoding!r}; swarm answers "
            "are read as sent (identity) only",
            request=request,
        )
    cap = request.extensions.get(MAX_BYTES, default)
    declared = response.headers.get("content-length", "")
    if cap is not None and declared.isascii() and declared.isdigit() and int(declared) > cap:
        raise AnswerRefused(
            f"{request.url.host} announced an answer of {declared} bytes; the limit is {cap}",
            request=request,
        )
    return cap


def _counted(seen: int, chunk: bytes, cap: int | None, request: httpx.Request) -> int:
    seen += len(chunk)
    if cap is not None and seen > cap:
        raise AnswerRefused(f"{request.url.host} answered more than {cap} bytes", request=request)
    return seen


class _Bounded(httpx.SyncByteStream):
    """A response body counted as it arrives."""

    def __init__(self, inner: httpx.SyncByteStream, cap: int | None, request) -> None:
        self.inner, self.cap, self.request = inner, cap, request

    def __iter__(self) -> Iterator[bytes]:
        seen = 0
        for chunk in self.inner:
            seen = _counted(seen, chunk, self.cap, self.request)
            yield chunk

    def close(self) -> None:
        self.inner.close()


class _AsyncBounded(httpx.AsyncByteStream):
    """A response body counted as it arrives (async)."""

    def __init__(self, inner: httpx.AsyncByteStream, cap: int | None, request) -> None:
        self.inner, self.cap, self.request = inner, cap, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self.inner:
            seen = _counted(seen, chunk, self.cap, self.request)
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def _hooks(event_hooks: dict | None, check) -> dict:
    hooks = {key: list(value) for key, value in (event_hooks or {}).items()}
    hooks["response"] = [check, *hooks.get("response", [])]  # first: before anyone reads
    return hooks


def _headers(headers) -> httpx.Headers:
    merged = httpx.Headers(headers)
    merged.update(IDENTITY)
    return merged


def swarm_client(
    *, max_bytes: int | None = CONTROL_LIMIT, headers=None, event_hooks=None, **kwargs
) -> httpx.Client:
    """An ``httpx.Client`` for calls to swarm members (see the module's docstring)."""

    def check(response: httpx.Response) -> None:
        cap = _cap(response, max_bytes)
        response.stream = _Bounded(response.stream, cap, response.request)

    return httpx.Client(headers=_headers(headers), event_hooks=_hooks(event_hooks, check),
                        **kwargs)  # fmt: skip


def swarm_async_client(
    *, max_bytes: int | None = CONTROL_LIMIT, headers=None, event_hooks=None, **kwargs
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` for calls to swarm members (see the module's docstring)."""

    async def check(response: httpx.Response) -> None:
        cap = _cap(response, max_bytes)
        response.stream = _AsyncBounded(response.stream, cap, response.request)

    return httpx.AsyncClient(headers=_headers(headers), event_hooks=_hooks(event_hooks, check),
                             **kwargs)  # fmt: skip


async def read_capped(response: httpx.Response, max_bytes: int) -> bytes:
    """The raw body of a streamed ``response``, AnswerRefused past ``max_bytes`` bytes or
    when it is compressed (for a call sent with ``limit(None)``)."""
    _cap(response, max_bytes)  # identity only: its bytes are the raw bytes
    chunks, seen = [], 0
    async for chunk in response.aiter_bytes():
        seen = _counted(seen, chunk, max_bytes, response.request)
        chunks.append(chunk)
    return b"".join(chunks)


def request(
    method: str, url: str, *, verify=True, timeout=5.0, max_bytes: int | None = CONTROL_LIMIT,
    **kwargs,
) -> httpx.Response:  # fmt: skip
    """One call with a fresh swarm client (``httpx.request``'s counterpart)."""
    with swarm_client(max_bytes=max_bytes, verify=verify, timeout=timeout) as client:
        return client.request(method, url, **kwargs)


def get(url: str, **kwargs) -> httpx.Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs) -> httpx.Response:
    return request("POST", url, **kwargs)

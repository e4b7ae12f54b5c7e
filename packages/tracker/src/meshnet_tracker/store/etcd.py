"""The store kept in etcd v3, through its JSON gateway (``/v3/...``, keys and values in
base64), with httpx. Requests go to one endpoint and move on to the next when it stops
answering; a watch that loses its endpoint resumes on another from its last revision."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import ssl
from collections.abc import AsyncIterator

import httpx

from meshnet_tracker.store.base import Event, Snapshot, StoreError, prefix_end

log = logging.getLogger(__name__)

FAILOVER_STATUSES = frozenset({502, 503, 504})  # the gateway is up, its member is not
LEASE_NOT_FOUND = 5  # gRPC NOT_FOUND, as the gateway reports an unknown lease
# What an endpoint that does not answer raises. Under TLS 1.3 a server refuses a client
# certificate after the handshake, with an alert that httpcore lets through as a bare
# ssl.SSLError on the first read instead of wrapping it.
TRANSPORT_ERRORS = (httpx.HTTPError, ssl.SSLError)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def _range(prefix: str) -> dict:
    """etcd's key range for every key starting with ``prefix`` (all keys for "")."""
    return {"key": _b64(prefix.encode() or b"\0"), "range_end": _b64(prefix_end(prefix))}


class EtcdStore:
    """A ``Store`` in an etcd cluster reached at ``urls`` (``http(s)://host:port``, any
    member). A request that times out is sent again to the next endpoint: puts and deletes
    are idempotent, a create that landed unanswered reads as not created (``Election``
    checks the key), a grant may leave a lease unused to expire."""

    def __init__(
        self, urls: list[str], *, timeout_s: float = 5.0, tls: ssl.SSLContext | None = None
    ):
        if not urls:
            raise StoreError("an etcd store needs at least one endpoint URL")
        self.urls = [url.rstrip("/") for url in urls]
        self.timeout_s = timeout_s
        self._current = 0  # the endpoint that answered last
        # https endpoints: verified with ``tls`` (its CA, its client certificate) or the system's CAs
        self._client = httpx.AsyncClient(timeout=timeout_s, verify=tls or True)
        self._watches: set[_EtcdWatch] = set()
        self._closed = False

    # -- requests ---------------------------------------------------------------------
    def endpoints(self) -> list[str]:
        """Every endpoint, the one that answered last first."""
        return self.urls[self._current :] + self.urls[: self._current]

    def answered(self, url: str) -> None:
        self._current = self.urls.index(url)

    async def _call(self, path: str, body: dict, *, missing_ok: bool = False) -> dict:
        """POST ``body`` to the first endpoint that answers; etcd's refusal is a StoreError."""
        if self._closed:
            raise StoreError("the store is closed")
        failures = []
        for url in self.endpoints():
            try:
                response = await self._client.post(url + path, json=body)
            except TRANSPORT_ERRORS as exc:
                failures.append(f"{url} ({type(exc).__name__})")
                continue
            if response.status_code in FAILOVER_STATUSES:
                failures.append(f"{url} (HTTP {response.status_code})")
                continue
            self.answered(url)
            try:
                answer = response.json()
            except ValueError:
                raise StoreError(f"etcd at {url} answered {path} with no JSON") from None
            if response.status_code != 200 or "error" in answer:
                if missing_ok and answer.get("code") == LEASE_NOT_FOUND:
                    return answer
                message = answer.get("message") or answer.get("error") or response.text[:200]
                raise StoreError(f"etcd refused {path}: {message}")
            return answer
        raise StoreError(f"no etcd endpoint answered {path}: {', '.join(failures)}")

    @staticmethod
    def _revision(answer: dict) -> int:
        return int(answer.get("header", {}).get("revision", 0))

    # -- keys -------------------------------------------------------------------------
    @staticmethod
    def _put(key: str, value: bytes, lease: int | None) -> dict:
        request = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease is not None:
            request["lease"] = str(lease)
        return request

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        return self._revision(await self._call("/v3/kv/put", self._put(key, value, lease)))

    async def create(self, key: str, value: bytes, *, lease: int | None = None) -> bool:
        only_if_absent = {"key": _b64(key.encode()), "result": "EQUAL", "target": "CREATE",
                          "create_revision": "0"}  # fmt: skip
        answer = await self._call(
            "/v3/kv/txn",
            {
                "compare": [only_if_absent],
                "success": [{"request_put": self._put(key, value, lease)}],
            },
        )
        return bool(answer.get("succeeded"))

    async def get(self, key: str) -> bytes | None:
        answer = await self._call("/v3/kv/range", {"key": _b64(key.encode())})
        kvs = answer.get("kvs") or []
        return _unb64(kvs[0].get("value")) if kvs else None

    async def get_prefix(self, prefix: str) -> Snapshot:
        answer = await self._call("/v3/kv/range", _range(prefix))
        items = {
            _unb64(kv["key"]).decode(): _unb64(kv.get("value")) for kv in answer.get("kvs", [])
        }
        return Snapshot(items, self._revision(answer))

    async def delete(self, key: str) -> bool:
        answer = await self._call("/v3/kv/deleterange", {"key": _b64(key.encode())})
        return int(answer.get("deleted", 0)) > 0

    async def delete_prefix(self, prefix: str) -> int:
        answer = await self._call("/v3/kv/deleterange", _range(prefix))
        return int(answer.get("deleted", 0))

    # -- leases -----------------------------------------------------------------------
    async def grant(self, ttl_s: float) -> int:
        if not ttl_s > 0:
            raise StoreError(f"a lease needs a positive TTL, not {ttl_s}")
        answer = await self._call("/v3/lease/grant", {"TTL": str(max(1, math.ceil(ttl_s)))})
        return int(answer["ID"])

    async def keepalive(self, lease_id: int) -> bool:
        answer = await self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        return int(answer.get("result", {}).get("TTL", 0)) > 0  # no TTL: the lease is gone

    async def revoke(self, lease_id: int) -> None:
        await self._call("/v3/lease/revoke", {"ID": str(lease_id)}, missing_ok=True)

    # -- watches ----------------------------------------------------------------------
    def watch(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[Event]:
        if self._closed:
            raise StoreError("the store is closed")
        watch = _EtcdWatch(self, prefix, start_revision)
        self._watches.add(watch)
        return watch

    async def stream(self, url: str, body: dict) -> AsyncIterator[dict]:
        """The JSON objects of a streamed POST, one a line, until the server ends it."""
        timeout = httpx.Timeout(self.timeout_s, read=None)  # a quiet watch is no failure
        async with self._client.stream("POST", url + "/v3/watch", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                raise StoreError(f"etcd at {url} refused a watch: HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    def forget(self, watch: _EtcdWatch) -> None:
        self._watches.discard(watch)

    async def __aenter__(self) -> EtcdStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        for watch in list(self._watches):
            await watch.aclose()
        await self._client.aclose()


class _EtcdWatch:
    """One watch: a task reads etcd's stream into a queue, resuming on the next endpoint
    after the last revision it passed on when its endpoint goes away."""

    def __init__(self, store: EtcdStore, prefix: str, start_revision: int | None):
        self.store = store
        self.prefix = prefix
        self.next_revision = start_revision  # None: from whatever etcd's revision is then
        self.queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._follow())

    def __aiter__(self) -> _EtcdWatch:
        return self

    async def __anext__(self) -> Event:
        item = await self.queue.get() if not self.task.cancelled() else None
        if isinstance(item, Event):
            return item
        await self.aclose()
        if isinstance(item, BaseException):
            raise item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.store.forget(self)
        if not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.queue.put_nowait(None)  # a reader still waiting ends

    async def _follow(self) -> None:
        failures: list[str] = []
        try:
            while len(failures) < len(self.store.urls):
                url = self.store.endpoints()[0]
                try:
                    async for answer in self.store.stream(url, self._request()):
                        failures.clear()
                        self.store.answered(url)
                        self._take(answer.get("result") or {}, url)
                except TRANSPORT_ERRORS as exc:
                    failures.append(f"{url} ({type(exc).__name__})")
                else:
                    failures.append(f"{url} (stream ended)")
                if len(self.store.urls) > 1:  # the next one, from the revision after the last
                    self.store.answered(self.store.endpoints()[1])
                log.info("watch on %r lost %s; resuming", self.prefix, failures[-1])
            raise StoreError(f"no etcd endpoint kept a watch: {', '.join(failures)}")
        except StoreError as exc:
            self.queue.put_nowait(exc)
        except Exception as exc:  # a malformed answer: the reader hears of it, not the loop
            self.queue.put_nowait(StoreError(f"etcd watch failed: {exc!r}"))

    def _request(self) -> dict:
        create = _range(self.prefix)
        if self.next_revision is not None:
            create["start_revision"] = str(self.next_revision)
        return {"create_request": create}

    def _take(self, result: dict, url: str) -> None:
        if result.get("canceled"):
            compacted = result.get("compact_revision")
            reason = f"revision {self.next_revision} is compacted" if compacted else "canceled"
            detail = result.get("cancel_reason", "")
            raise StoreError(f"etcd at {url} ended a watch: {reason} {detail}".strip())
        if result.get("created") and self.next_revision is None:
            self.next_revision = int(result.get("header", {}).get("revision", 0)) + 1
        for raw in result.get("events", []):
            kv = raw["kv"]
            revision = int(kv.get("mod_revision", 0))
            if raw.get("type") == "DELETE":
                event = Event("delete", _unb64(kv["key"]).decode(), None, revision)
            else:
                event = Event("put", _unb64(kv["key"]).decode(), _unb64(kv.get("value")), revision)
            self.queue.put_nowait(event)
            self.next_revision = revision + 1

"""A node's membership in a swarm: register, heartbeat, re-register, deregister.

Membership runs on a thread of its own with a blocking HTTP client, not on the event loop:
a node's heartbeats keep their schedule whatever the loop or the compute thread is doing
(a long decode step, a shard loading), so a busy node never falls off the coverage map.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import httpx

from meshnet_common.errors import MeshnetError, ModelNotCovered
from meshnet_common.protocol import (
    H_NODE_SECRET,
    Heartbeat,
    HeartbeatResponse,
    NodeAnnouncement,
    RegisterResponse,
    RouteResponse,
    Verdict,
)
from meshnet_common.trust.identity import CallChecker, Identity
from meshnet_common.trust.manifest_keys import ManifestKey
from meshnet_common.web import tls
from meshnet_common.web.auth import swarm_headers
from meshnet_common.web.swarm_client import swarm_async_client, swarm_client
from meshnet_node.retry import RetryPolicy
from meshnet_node.swarm.trackers import Trackers
from meshnet_node.verification.verifier import Replica, replicas_in_coverage

logger = logging.getLogger(__name__)

# Registration retries until accepted, refused or stopped: the node's one retry loop with
# no bound (a node outlives a tracker restart), backing off 0.5 s doubling to 5 s.
REGISTRATION_RETRY = RetryPolicy(max_attempts=None, backoff_base_s=0.5, backoff_cap_s=5.0)
# A registration answered with one of these is final: retrying cannot change the answer.
REFUSED = frozenset({400, 401, 403, 409, 422})


class IdTaken(ValueError):
    """The node's id is held by a live record whose secret this node lacks (it restarted):
    retried until that record expires after its missed heartbeats (docs/adr/0032)."""


class RegistrationRefused(Exception):
    """The tracker answered a registration with a final 4xx (its message inside)."""


def error_message(resp: httpx.Response) -> str:
    """The message of an OpenAI-style error body, else the start of the body."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200] or f"HTTP {resp.status_code}"


def error_code(resp: httpx.Response) -> str | None:
    """The code of an OpenAI-style error body (None without one)."""
    try:
        code = resp.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


class TrackerClient:
    """Asks the tracker for routes on behalf of a head (on the event loop); the current one
    of ``trackers``, the next when it does not answer."""

    def __init__(
        self, trackers: Trackers | str, *, timeout: float = 5.0, swarm_token: str | None = None,
        identity: Identity | None = None,
    ) -> None:  # fmt: skip
        self.trackers = Trackers.of(trackers)
        hooks = {"request": [identity.sign_async_request]} if identity is not None else None
        self.client = swarm_async_client(
            timeout=timeout, headers=swarm_headers(swarm_token), verify=tls.client_context(),
            event_hooks=hooks,
        )  # fmt: skip
        # This node's proof of id (its Membership's secret), for verdicts (docs/adr/0032).
        self.node_secret: Callable[[], str | None] = lambda: None

    async def aclose(self) -> None:
        await self.client.aclose()

    async def route(
        self, model_id: str, head_node_id: str, exclude: frozenset[str] = frozenset()
    ) -> RouteResponse:
        """A chain for ``model_id`` starting at this head (503 from the tracker if none)."""
        params = {"model": model_id, "head": head_node_id, "exclude": ",".join(sorted(exclude))}
        try:  # a 503 is the tracker's answer: no chain right now
            resp = await self.trackers.asend(
                lambda base: self.client.get(f"{base}/v1/route", params=params),
                answers=frozenset({503}),
            )
        except httpx.HTTPError as exc:
            raise ModelNotCovered(f"tracker unreachable for routing: {exc}") from exc
        if resp.status_code != 200:
            message = error_message(resp)
            if resp.status_code == 503:  # no chain right now: the head may ask again
                raise ModelNotCovered(message, code=error_code(resp) or "model_not_covered")
            error = MeshnetError(message)
            error.status = resp.status_code
            raise error
        return RouteResponse.model_validate_json(resp.content)

    async def replicas(self, model_id: str) -> list[Replica]:
        """The serving nodes of ``model_id`` on the coverage map (for audits, ADR-0026)."""
        resp = await self.trackers.asend(lambda base: self.client.get(f"{base}/v1/coverage"))
        resp.raise_for_status()
        return replicas_in_coverage(resp.json(), model_id)

    async def report(self, node_id: str, verdict: Verdict) -> None:
        """Tell the tracker that ``node_id`` computed wrong (it counts the strikes)."""
        resp = await self.trackers.asend(lambda base: self.client.post(
            f"{base}/v1/nodes/{node_id}/verdicts", content=verdict.model_dump_json(),
            headers={"content-type": "application/json", **_proof(self.node_secret())},
        ))  # fmt: skip
        resp.raise_for_status()


class Membership:
    """Keeps a node registered from its own thread: heartbeats every interval, registers
    again when the tracker forgot the node or when what the node serves changed.

    ``announcement`` and ``heartbeat`` are read on the membership thread; ``serve`` swaps
    them (a joining node becomes a serving one). ``on_directives``, ``on_refused`` and
    ``on_url`` are called on the membership thread too: hand work to the loop from there.

    Every call goes to the current one of ``trackers`` and moves on to the next while one
    does not answer; a tracker that does not know the node (it never saw it, or lost it)
    answers its heartbeat so, and the node registers with it.
    """

    def __init__(
        self,
        trackers: Trackers | str,
        announcement: Callable[[], NodeAnnouncement],
        heartbeat: Callable[[], Heartbeat],
        interval_s: float,
        *,
        swarm_token: str | None = None,
        on_directives: Callable[[tuple], None] | None = None,
        on_refused: Callable[[str], None] | None = None,
        on_url: Callable[[str], None] | None = None,
        on_registered: Callable[[NodeAnnouncement], None] | None = None,
        timeout_s: float = 5.0,
        retry: RetryPolicy = REGISTRATION_RETRY,
        identity: Identity | None = None,
        peers: CallChecker | None = None,
    ) -> None:
        self.trackers = Trackers.of(trackers)
        self.announcement = announcement
        self.heartbeat = heartbeat
        self.interval_s = interval_s
        self.on_directives = on_directives
        self.on_probe: Callable[[tuple], None] | None = None  # the next hops to time
        # why the tracker quarantined this node, or None (every reply says; ADR-0026)
        self.on_quarantine: Callable[[str | None], None] | None = None
        self.on_refused = on_refused
        self.on_url = on_url
        self.on_registered = on_registered
        self.retry = retry
        self.registered = threading.Event()
        self.refused: str | None = None
        self.url: str | None = None  # where the tracker reaches this node (its answer)
        self.secret: str | None = None  # its proof of id, issued at registration (ADR-0032)
        # Its key, certified by the tracker at registration, and the tracker key that checks
        # its peers' calls (docs/adr/0032): shared with the node's clients and its server.
        self.identity = identity or Identity()
        self.peers = peers or CallChecker()
        self._refused_keys: set[str] = set()  # tracker keys refused (logged once each)
        self.heartbeats = 0
        self._client = swarm_client(
            timeout=timeout_s, headers=swarm_headers(swarm_token), verify=tls.client_context(),
            event_hooks={"request": [self.identity.sign_request]},
        )  # fmt: skip
        self._stop = threading.Event()
        self._again = threading.Event()  # register again before the next heartbeat
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one registration at a time

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
            self._thread.start()

    def serve(
        self, announcement: Callable[[], NodeAnnouncement], heartbeat: Callable[[], Heartbeat]
    ) -> None:
        """From now on report ``announcement`` / ``heartbeat``, registering them at once."""
        self.announcement, self.heartbeat = announcement, heartbeat
        self.register_again()

    def register_again(self) -> None:
        """Register the current announcement on the membership thread, before the next beat."""
        self._again.set()

    def stop(self, *, deregister: bool = True, node_id: str | None = None) -> None:
        """Stop heartbeating; tell the tracker this node leaves (when it was registered)."""
        self._stop.set()
        self._again.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 6.0)
        if deregister and self.registered.is_set():
            self.leave(node_id or self.announcement().node_id)
        self._client.close()

    # -- the calls ---------------------------------------------------------------------------

    def register_once(self) -> RegisterResponse:
        """One registration; RegistrationRefused on a final 4xx, httpx errors otherwise."""
        announcement = self.announcement().model_copy(
            update={"public_key": self.identity.key.public}
        )
        with self._lock:  # the secret goes along: trackers sharing a store know it
            resp = self.trackers.send(lambda base: self._client.post(
                f"{base}/v1/nodes/register", content=announcement.model_dump_json(),
                headers=_proof(self.secret),
            ))  # fmt: skip
        if resp.status_code == 409 and error_code(resp) == "node_id_taken":
            raise IdTaken(error_message(resp))
        if resp.status_code in REFUSED:
            raise RegistrationRefused(error_message(resp))
        resp.raise_for_status()
        reply = RegisterResponse.model_validate_json(resp.content)
        self.secret = reply.node_secret or self.secret
        self.identity.adopt(reply.certificate)
        self._trust_tracker(reply.tracker_key, self.trackers.current)
        self.interval_s = reply.heartbeat_interval_s
        self.registered.set()
        self.peers.answers_at([reply.url])  # where peers' signed calls must be aimed
        if reply.url and reply.url != self.url:
            self.url = reply.url
            if self.on_url is not None:
                self.on_url(reply.url)
        logger.info(
            "registered with tracker %s as %s (%s)",
            self.trackers.current, reply.url or announcement.url, announcement.state.value,
        )  # fmt: skip
        if self.on_registered is not None:
            self.on_registered(announcement)
        return reply

    def register_until_accepted(self) -> bool:
        """Register, retrying with capped backoff; False when refused, stopped, or (with a
        bounded ``retry``) out of attempts."""
        budget = self.retry.start()
        while not self._stop.is_set():
            try:
                self.register_once()
                return True
            except RegistrationRefused as exc:
                self.refused = str(exc)
                if self.on_refused is not None:
                    self.on_refused(str(exc))  # it reports the refusal (one line, then exit)
                else:
                    logger.error("the tracker refused this node: %s", exc)
                return False
            except (httpx.HTTPError, ValueError) as exc:
                if not budget.failed():
                    logger.error("tracker registration failed (%s); giving up", exc)
                    return False
                # The tracker may simply still be starting: only persistent failure is a warning.
                level = logging.INFO if budget.failures <= 5 else logging.WARNING
                delay = budget.backoff()
                logger.log(level, "tracker registration failed (%s); retry in %.1fs", exc, delay)
                self._stop.wait(delay)
        return False

    def beat(self) -> HeartbeatResponse | None:
        """One heartbeat; None when it failed (the next one may get through)."""
        try:
            resp = self.trackers.send(lambda base: self._client.post(
                f"{base}/v1/nodes/heartbeat", content=self.heartbeat().model_dump_json(),
                headers=_proof(self.secret),
            ))  # fmt: skip
            if resp.status_code == 401 and error_code(resp) == "node_unauthenticated":
                # its record expired, or another tracker holds it: register again (there)
                return HeartbeatResponse(known=False)
            resp.raise_for_status()
            reply = HeartbeatResponse.model_validate_json(resp.content)
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("heartbeat failed: %s", exc)
            return None
        self.identity.adopt(reply.certificate)
        self.peers.revoked = frozenset(reply.revoked)  # the tracker's list, whole each time
        self.heartbeats += 1
        return reply

    def _trust_tracker(self, key: str | None, tracker: str = "the tracker") -> None:
        """Check peers' calls with the key the tracker answered with the first time (or the
        one pinned with ``--tracker-key``); a tracker answering with another is not believed,
        and said once per key in one error line. The trackers of one swarm share one key, so
        the kept one stays good when the node moves to another of them."""
        if not key:
            return
        try:
            offered = ManifestKey.from_text(key)
        except MeshnetError:
            logger.warning("the tracker answered with a malformed key: ignored")
            return
        if self.peers.adopt(offered) or key in self._refused_keys:
            return
        self._refused_keys.add(key)
        kept = self.peers.tracker_key.text if self.peers.tracker_key else None
        how = "pinned with --tracker-key" if self.peers.is_pinned else "first seen"
        logger.error("the tracker's key changed to %s (answered by %s): peers' calls stay "
                     "checked with %s (%s); if the tracker's key was replaced, restart this node "
                     "with --tracker-key %s", key, tracker, kept, how, key)  # fmt: skip

    def leave(self, node_id: str) -> None:
        try:
            resp = self.trackers.send(
                lambda base: self._client.delete(f"{base}/v1/nodes/{node_id}",
                                                 headers=_proof(self.secret))
            )  # fmt: skip
            if resp.status_code not in (200, 404):
                resp.raise_for_status()
            logger.info("deregistered from tracker")
        except httpx.HTTPError as exc:
            logger.warning("could not deregister: %s", exc)

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        if not self.registered.is_set() and not self.register_until_accepted():
            return
        next_beat = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            if self._again.wait(max(0.0, next_beat - time.monotonic())):
                self._again.clear()
                if self._stop.is_set():
                    return
                if not self.register_until_accepted():
                    return
                continue
            next_beat = time.monotonic() + self.interval_s  # the schedule, not the reply time
            reply = self.beat()
            if reply is None:
                continue
            if not reply.known:  # the tracker restarted and lost its soft state
                logger.info("tracker does not know this node; registering again")
                if not self.register_until_accepted():
                    return
            if self.on_probe is not None:
                self.on_probe(reply.probe)
            if self.on_quarantine is not None:
                self.on_quarantine(reply.quarantined)
            if reply.directives:
                for directive in reply.directives:
                    logger.info("directive %s %s", directive.kind.value, directive.shard)
                if self.on_directives is not None:
                    self.on_directives(reply.directives)


def _proof(secret: str | None) -> dict[str, str]:
    """The header proving this node's id, once the tracker issued its secret."""
    return {H_NODE_SECRET: secret} if secret else {}

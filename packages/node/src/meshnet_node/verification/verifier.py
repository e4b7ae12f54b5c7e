"""The head's side of verification (docs/adr/0026): after a random fraction of decode steps
(``--verify-fraction``), one hop of the generation's chain is audited.

An audit takes what the hop received for the session and the output row of its last
position (its record), has an alternate replica of the same layers recompute that row from
the same input in a throwaway session, and compares the two within a tolerance derived from
the precision (``Precision.verify_tolerance``). When they disagree, the hop recomputes the
row too (a decode step and a prefill are other arithmetic: only recomputations are compared
to blame anyone), and if that still disagrees a third opinion decides: another replica when
there is one (the odd one out is the suspect), else each of the two recomputes again (a
node that cannot reproduce its own output is the suspect). A suspect is
reported to the tracker (which quarantines a node after repeated verdicts), avoided by this
head, and the generation fails over off it (exact replay, docs/adr/0023). Two replicas that
disagree deterministically, with no third, are a dispute: logged and counted, no one blamed.

Audits run beside the generation, one at a time per generation, and never delay a token.
The judgement after the record (``judge``) and what follows a finding (``Convictions``) serve
the hop that audits the head feeding it too (``meshnet_node.verification.head_audit``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from meshnet_common import wire
from meshnet_common.metrics import Metrics
from meshnet_common.precision import Precision
from meshnet_common.protocol import H_SESSION_KEY, H_START_LAYER, Evidence, Verdict
from meshnet_common.trust.evidence import H_AUDIT_SIGNATURE, row_bytes, signed_row
from meshnet_common.trust.identity import Identity
from meshnet_common.web import tls
from meshnet_common.web.auth import swarm_headers
from meshnet_common.web.swarm_client import swarm_async_client
from meshnet_node.verification.audit import (
    H_KEY_DIGEST,
    HOLDS_PATH,
    RECOMPUTE_PATH,
    RECORD_PATH,
    key_digest,
    split,
)

logger = logging.getLogger(__name__)

SUSPECT_S = 600.0  # how long this head avoids a node it convicted
AUDIT_TIMEOUT_S = 60.0  # one record or recomputation request


@dataclass(frozen=True)
class Replica:
    """A serving node as the coverage map shows it."""

    node_id: str
    url: str
    start: int
    end: int
    quantization: str = "bfloat16"
    dtype: str = "bfloat16"  # compute dtype; with the int4 group, part of the precision
    group_size: int | None = None

    def same_precision(self, other: Replica) -> bool:
        """Whether ``other`` computes with the same weights and dtype (it can recompute)."""
        return (self.quantization, self.dtype, self.group_size) == (
            other.quantization, other.dtype, other.group_size
        )  # fmt: skip


@dataclass(frozen=True)
class Target:
    """A hop of a chain that can be audited: the node, the layer it is entered at, and the
    replicas that could recompute its output (same end, same precision)."""

    primary: Replica
    start: int
    alternates: tuple[Replica, ...]


def replicas_in_coverage(coverage: dict, model_id: str) -> list[Replica]:
    """The serving nodes of ``model_id`` in a tracker's ``/v1/coverage`` answer."""
    for model in coverage.get("models", ()):
        if model.get("id") == model_id:
            return [
                Replica(n["node_id"], n["url"], int(n["shard_start"]), int(n["shard_end"]),
                        str(n.get("quantization", "bfloat16")),
                        str(n.get("dtype", "bfloat16")), n.get("quant_group_size"))
                for n in model.get("nodes", ()) if n.get("state") == "serving"
            ]  # fmt: skip
    return []


class SwarmView(Protocol):
    """What the verifier needs of the swarm: the map, and somewhere to report to."""

    async def replicas(self, model_id: str) -> list[Replica]: ...

    async def report(self, node_id: str, verdict: Verdict) -> None: ...


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """||output - reference|| / ||reference|| (in float32)."""
    a, b = output.float().reshape(-1), reference.float().reshape(-1)
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def audit_targets(
    route: tuple[str, ...], head_end: int, replicas: Iterable[Replica]
) -> list[Target]:
    """The hops of ``route`` (entered in turn from layer ``head_end``) that some other
    replica could recompute; a hop missing from the map ends the walk (its span is unknown).
    A node this head suspects still serves as an alternate: a second audit against it is
    the repeated verdict that gets it quarantined."""
    replicas = list(replicas)
    by_url = {r.url.rstrip("/"): r for r in replicas}
    targets, start = [], head_end
    for url in route:
        primary = by_url.get(url.rstrip("/"))
        if primary is None or not primary.start <= start < primary.end:
            break
        alternates = tuple(
            r for r in replicas
            if r.node_id != primary.node_id and r.end == primary.end
            and r.start <= start and r.same_precision(primary)
        )  # fmt: skip
        if alternates:
            targets.append(Target(primary, start, alternates))
        start = primary.end
    return targets


@dataclass(frozen=True)
class Finding:
    """An audit's outcome (``agreed``, ``convicted``, ``disputed``, ``skipped``)."""

    outcome: str
    hop: str | None = None
    suspect: Replica | None = None
    witnesses: tuple[Replica, ...] = ()
    error: float | None = None
    detail: str = ""
    start: int = 0  # the first layer compared (where the session entered the hop)
    evidence: Evidence | None = None  # a conviction's signed rows (docs/adr/0032)


class AuditClient:
    """The audit's requests to nodes, over plain HTTP with the swarm token, signed by this
    node once certified (docs/adr/0032)."""

    def __init__(
        self, swarm_token: str | None, *, max_bytes: int, identity: Identity | None = None
    ) -> None:
        hooks = {"request": [identity.sign_async_request]} if identity is not None else None
        self.client = swarm_async_client(  # two frames at most, never compressed
            max_bytes=2 * max_bytes + 4096, timeout=AUDIT_TIMEOUT_S,
            headers=swarm_headers(swarm_token), verify=tls.client_context(), event_hooks=hooks,
        )  # fmt: skip
        self.max_bytes = max_bytes

    async def record(self, url: str, session_id: str, key: str):
        """(inputs frame, last output row, start layer) of a session on ``url``; None: gone.
        The inputs stay the frame the node sent: replicas recompute from those very bytes,
        which their signatures name (docs/adr/0032)."""
        path = RECORD_PATH.format(session_id=session_id)
        resp = await self.client.post(f"{url.rstrip('/')}{path}", headers={H_SESSION_KEY: key})
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        inputs, last = split(resp.content, 2)
        wire.decode_tensor(inputs, max_bytes=self.max_bytes)  # a well-formed frame
        return (
            inputs,
            wire.decode_tensor(last, max_bytes=self.max_bytes),
            int(resp.headers[H_START_LAYER]),
        )

    async def holds(self, url: str, session_id: str, key: str) -> bool:
        """Whether the node at ``url`` holds ``session_id`` opened with ``key`` (named by a
        digest only: the key is the chain's, ``url`` may be another head)."""
        path = HOLDS_PATH.format(session_id=session_id)
        resp = await self.client.post(
            f"{url.rstrip('/')}{path}", headers={H_KEY_DIGEST: key_digest(session_id, key)}
        )
        resp.raise_for_status()
        return resp.json().get("holds") is True

    async def recompute(self, url: str, inputs: bytes, start: int):
        """(output row, its signature or None) of a replica's recomputation from ``inputs``."""
        resp = await self.client.post(
            f"{url.rstrip('/')}{RECOMPUTE_PATH}", content=inputs,
            headers={H_START_LAYER: str(start), "content-type": wire.CONTENT_TYPE},
        )  # fmt: skip
        resp.raise_for_status()
        row = wire.decode_tensor(resp.content, max_bytes=self.max_bytes)
        return row, resp.headers.get(H_AUDIT_SIGNATURE)

    async def aclose(self) -> None:
        await self.client.aclose()


class Verifier:
    """Audits a fraction of a head's decode steps; remembers the nodes it convicted."""

    def __init__(
        self,
        fraction: float,
        view: SwarmView,
        client: AuditClient,
        *,
        model_id: str,
        node_id: str,
        head_end: int,
        metrics: Metrics,
        rng: random.Random | None = None,
        clock=time.monotonic,
    ) -> None:
        self.fraction = fraction
        self.view = view
        self.client = client
        self.model_id = model_id
        self.node_id = node_id
        self.head_end = head_end  # where the chain after this head starts
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.convictions = Convictions(view, metrics, node_id=node_id, clock=clock)
        self._tasks: set[asyncio.Task] = set()

    def suspects(self) -> frozenset[str]:
        return self.convictions.suspects()

    def after_step(self, chain) -> None:
        """Called after each decode step of a generation: maybe start auditing its chain
        (not while an audit of it still runs)."""
        if not chain.route or (chain.auditing is not None and not chain.auditing.done()):
            return
        if self.rng.random() >= self.fraction:
            return
        task = asyncio.ensure_future(self._audit_chain(chain, chain.session_id, chain.key,
                                                       chain.route))  # fmt: skip
        chain.auditing = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _audit_chain(self, chain, session_id: str, key: str, route) -> None:
        try:
            finding = await self.audit(session_id, key, route)
        except Exception as exc:  # a node gone or refusing, a bad answer: no verdict
            finding = Finding("skipped", detail=f"{type(exc).__name__}: {exc}")
        if not self.convictions.note(finding):
            return
        suspect = finding.suspect
        if chain.session_id == session_id and suspect.url in chain.route:
            chain.convicted = suspect.url  # the generation's next step fails over off it
        await self.convictions.report(finding, self.model_id)

    async def audit(self, session_id: str, key: str, route: tuple[str, ...]) -> Finding:
        """Audit one hop of ``route`` (chosen at random among those with replicas)."""
        replicas = await self.view.replicas(self.model_id)
        targets = audit_targets(route, self.head_end, replicas)
        if not targets:
            return Finding("skipped", detail="no hop of the chain has another replica")
        target = self.rng.choice(targets)
        primary = target.primary
        record = await self.client.record(primary.url, session_id, key)
        if record is None:
            return Finding("skipped", hop=primary.url, detail="the session ended first")
        inputs, claimed, start = record
        return await judge(self.client, primary, target.alternates, inputs, start, claimed,
                           self.rng)  # fmt: skip

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.client.aclose()


async def judge(
    client: AuditClient, primary: Replica, alternates, inputs: bytes, start: int,
    claimed: torch.Tensor, rng: random.Random,
) -> Finding:  # fmt: skip
    """The judgement of one audit (docs/adr/0026), once the audited node's output row for
    ``inputs`` (a tensor frame entering at layer ``start``) is known: ``claimed``. The
    ``alternates`` (same end, same precision) recompute it, and the primary too where they
    disagree; a third replica, or each recomputing again, settles a disagreement. Every
    row recomputed is kept, signed, as a conviction's evidence (docs/adr/0032)."""
    tol = _tolerance(primary)
    alternates = list(alternates)
    rng.shuffle(alternates)
    first = alternates[0]
    rows = SignedRows(inputs, start)

    async def recompute(replica: Replica) -> torch.Tensor:
        row, signature = await client.recompute(replica.url, inputs, start)
        rows.add(replica.node_id, row, signature)
        return row

    def agree(a, b) -> bool:
        return relative_error(a, b) <= tol

    theirs = await recompute(first)
    error = relative_error(claimed, theirs)
    found = _Found(primary, start, error, tol, rows)
    if error <= tol:
        return found.agreed()
    # The claim was a decode step's output, the alternate's a prefill: other arithmetic,
    # which can flip a near-tie (an MoE router's expert, say). Faults are told apart on
    # recomputations only, which are the same arithmetic everywhere.
    mine = await recompute(primary)
    if agree(mine, theirs):
        return found.agreed()
    if len(alternates) > 1:  # a third replica decides
        third = alternates[1]
        referee = await recompute(third)
        if agree(theirs, referee) and not agree(mine, referee):
            return found.convict(primary, (first, third), "two replicas agree without it")
        if agree(mine, referee) and not agree(theirs, referee):
            return found.convict(first, (primary, third), "two replicas agree without it")
        return found.dispute(first, "three replicas, no two agreeing")
    # Two replicas only: each recomputes once more; one that does not reproduce its own
    # output from the same input is the faulty one.
    if not agree(await recompute(primary), mine):
        return found.convict(primary, (first,), "it does not reproduce its own output")
    if not agree(await recompute(first), theirs):
        return found.convict(first, (primary,), "it does not reproduce its own output")
    return found.dispute(first, "both reproduce their own outputs")


class Convictions:
    """What follows an audit, whoever ran it: the outcome counted
    (``meshnet_audits_total``), a suspect remembered for ``SUSPECT_S``, and its verdict
    reported to the tracker with the signed rows as evidence (docs/adr/0032)."""

    def __init__(self, view: SwarmView, metrics: Metrics, *, node_id: str, clock) -> None:
        self.view, self.metrics, self.node_id, self.clock = view, metrics, node_id, clock
        self._suspects: dict[str, float] = {}  # URL -> until when this node avoids it

    def suspects(self) -> frozenset[str]:
        now = self.clock()
        for url in [u for u, until in self._suspects.items() if until <= now]:
            del self._suspects[url]
        return frozenset(self._suspects)

    def note(self, finding: Finding) -> bool:
        """Count and log ``finding``; True when it convicted someone (now a suspect)."""
        self.metrics.audits.labels(finding.outcome).inc()
        if finding.error is not None:
            self.metrics.audit_error.observe(finding.error)
        if finding.outcome == "disputed":
            logger.warning("audit of %s: %s", finding.hop, finding.detail)
        elif finding.outcome == "skipped":
            logger.debug("audit skipped: %s", finding.detail)
        if finding.outcome != "convicted":
            return False
        suspect = finding.suspect
        logger.warning("audit: node %s (%s) computed wrong: %s", suspect.node_id, suspect.url,
                       finding.detail)  # fmt: skip
        self._suspects[suspect.url] = self.clock() + SUSPECT_S
        return True

    async def report(self, finding: Finding, model_id: str) -> None:
        """Tell the tracker (it quarantines after repeated verdicts)."""
        suspect = finding.suspect
        try:
            verdict = Verdict(
                model_id=model_id, reporter=self.node_id,
                shard_start=finding.start, shard_end=suspect.end,
                error=min(finding.error or 0.0, 1e30), tolerance=_tolerance(suspect),
                witnesses=tuple(w.node_id for w in finding.witnesses),
                evidence=finding.evidence,
            )  # fmt: skip
            await self.view.report(suspect.node_id, verdict)
        except Exception as exc:  # still a suspect here; the tracker hears next time
            logger.warning("could not report node %s to the tracker: %s", suspect.node_id, exc)


class SignedRows:
    """The recomputed rows of one audit, by node, with their signatures: a conviction's
    evidence (docs/adr/0032)."""

    def __init__(self, inputs: bytes, start: int) -> None:
        self.digest, self.start = hashlib.sha256(inputs).hexdigest(), start
        self.rows: dict[str, list[tuple[bytes, str | None]]] = {}

    def add(self, node_id: str, row: torch.Tensor, signature: str | None) -> None:
        raw = row_bytes(row.float().reshape(-1).tolist())
        self.rows.setdefault(node_id, []).append((raw, signature))

    def evidence(self, suspect: str, witnesses) -> Evidence | None:
        """The suspect's rows and one row of each witness; None where one is unsigned (a
        node without a tracker-issued secret: the verdict will not count)."""
        own = self.rows.get(suspect, [])[:2]
        theirs = [self.rows[w.node_id][0] for w in witnesses if w.node_id in self.rows]
        if not own or any(sig is None for _, sig in (*own, *theirs)):
            return None
        return Evidence(
            inputs_sha256=self.digest, start_layer=self.start,
            suspect_rows=tuple(signed_row(suspect, raw, sig) for raw, sig in own),
            witness_rows=tuple(
                signed_row(w.node_id, self.rows[w.node_id][0][0], self.rows[w.node_id][0][1])
                for w in witnesses if w.node_id in self.rows
            ),
        )  # fmt: skip


@dataclass(frozen=True)
class _Found:
    primary: Replica
    start: int
    error: float
    tolerance: float
    rows: SignedRows

    def agreed(self) -> Finding:
        return Finding("agreed", hop=self.primary.url, error=self.error, start=self.start)

    def convict(self, suspect: Replica, witnesses, why: str) -> Finding:
        detail = (f"layers [{self.start}, {suspect.end}): its output lies {self.error:.3g} "
                  f"from a replica's (tolerance {self.tolerance:.3g}); {why}")  # fmt: skip
        return Finding("convicted", self.primary.url, suspect, tuple(witnesses), self.error,
                       detail, self.start, self.rows.evidence(suspect.node_id, witnesses))  # fmt: skip

    def dispute(self, other: Replica, why: str) -> Finding:
        return Finding(
            "disputed", self.primary.url, error=self.error,
            detail=f"{self.primary.node_id} and {other.node_id} disagree on layers "
            f"[{self.start}, {self.primary.end}) by {self.error:.3g} (tolerance "
            f"{self.tolerance:.3g}); {why}: nothing tells which is right", start=self.start,
        )  # fmt: skip


def _tolerance(replica: Replica) -> float:
    try:
        return Precision(replica.quantization).verify_tolerance
    except ValueError:
        return Precision.BFLOAT16.verify_tolerance


def build_verifier(settings, service, view: SwarmView | None, node_id: str) -> Verifier | None:
    """The verifier of a head started with ``--verify-fraction`` (None: not auditing, no
    tracker to ask for replicas, or not a head)."""
    if not settings.verify_fraction or view is None or not service.stage.shard.is_head:
        return None
    client = AuditClient(settings.swarm_token, max_bytes=settings.max_body_bytes,
                         identity=service.identity)  # fmt: skip
    return Verifier(
        settings.verify_fraction, view, client, model_id=settings.model_id, node_id=node_id,
        head_end=service.stage.shard.layers.end, metrics=service.metrics,
    )  # fmt: skip

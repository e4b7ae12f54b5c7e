"""A node's side of verification (docs/adr/0026): handing over what an audited session
received and last produced, and recomputing a row from someone else's record.

- ``POST /v1/node/audit/record/{session_id}`` (the session's key in ``x-meshnet-session-
  key``): the session's inputs so far and the output row of its last position, as two
  tensor frames (``pack``), with the layer it entered at (``x-meshnet-start-layer``);
- ``POST /v1/node/audit/recompute`` (a tensor frame of inputs, ``x-meshnet-start-layer``):
  the output row of the last position, computed from scratch in a throwaway session. A
  head's inputs are token ids (an int64 frame, from layer 0; docs/adr/0032);
- ``POST /v1/node/audit/holds/{session_id}`` (``x-meshnet-session-key-sha256``: the digest
  of the session id and its key, ``key_digest``): ``{"holds": true}`` when this node holds
  that session under that key. The hop after a head asks the heads of the range which of
  them sent a session's rows (``head_audit``); the key itself is the chain's, never sent.

The record and the recomputation run on the compute thread, between steps: a record is
never read half-written. A recomputation is a prefill anyone holding the swarm token may
ask for, so each caller gets a bounded share (``recompute_admission``: 429 beyond). The swarm token guards ``/v1/node``. Audits are rare
(``--verify-fraction``), so they use the node's FastAPI router and plain HTTP, not the hop
streams.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
import time

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from meshnet_common import wire
from meshnet_common.errors import InvalidRequest, NotFound
from meshnet_common.protocol import H_POSITION, H_SESSION_KEY, H_START_LAYER
from meshnet_common.trust.evidence import H_AUDIT_SIGNATURE, row_bytes, sign_row
from meshnet_common.web.auth import caller_of
from meshnet_common.web.http import read_body
from meshnet_node.dataplane.service import NodeService
from meshnet_node.engine.stage import Stage
from meshnet_node.verification.admission import PeerAdmission

RECORD_PATH = "/v1/node/audit/record/{session_id}"
RECOMPUTE_PATH = "/v1/node/audit/recompute"
HOLDS_PATH = "/v1/node/audit/holds/{session_id}"
H_KEY_DIGEST = "x-meshnet-session-key-sha256"
_LEN = struct.Struct("<I")
# Each caller's share of recomputations (issue 52): so many running or waiting at once, and
# so many prefill tokens per window, counted in the stage's KV budgets; all callers together
# no more than RECOMPUTES_TOTAL at once. A verifier audits a sampled few sessions.
RECOMPUTES_PER_CALLER = 2
RECOMPUTES_TOTAL = 8
RECOMPUTE_WINDOW_S = 60.0
RECOMPUTE_BUDGETS_PER_WINDOW = 2


def pack(*frames: bytes) -> bytes:
    """Tensor frames one after another, each after its length (u32, little-endian)."""
    return b"".join(_LEN.pack(len(f)) + f for f in frames)


def split(body: bytes, count: int) -> list[bytes]:
    """The ``count`` frames of a ``pack``ed body, as sent."""
    frames, at = [], 0
    for _ in range(count):
        if at + _LEN.size > len(body):
            raise ValueError("truncated audit body")
        (size,) = _LEN.unpack_from(body, at)
        at += _LEN.size
        if at + size > len(body):
            raise ValueError("truncated audit body")
        frames.append(body[at : at + size])
        at += size
    if at != len(body):
        raise ValueError("trailing bytes after the audit frames")
    return frames


def unpack(body: bytes, count: int, *, max_bytes: int) -> list[torch.Tensor]:
    """The ``count`` tensors of a ``pack``ed body (decoded with the wire's bounds)."""
    return [wire.decode_tensor(f, max_bytes=max_bytes) for f in split(body, count)]


def key_digest(session_id: str, key: str) -> str:
    """What names a session's key to a node that may not hold it: the SHA-256 of the
    session id, a NUL byte and the key."""
    return hashlib.sha256(f"{session_id}\0{key}".encode()).hexdigest()


def _snapshot(stage: Stage, session_id: str, key: str | None):
    session = stage.sessions.get(session_id, owner=key)
    record = session.record
    if record is None or record.last is None:
        raise NotFound(f"session {session_id!r} keeps no record to audit", param="session_id")
    start = stage.shard.layers.start + session.first_layer
    return record.inputs(), record.last, start, record.length


def recompute_admission(clock=time.monotonic) -> PeerAdmission:
    """The bound on recomputations per caller (``RECOMPUTES_PER_CALLER`` and the rest)."""
    return PeerAdmission(
        max_running=RECOMPUTES_PER_CALLER, max_total=RECOMPUTES_TOTAL,
        window_s=RECOMPUTE_WINDOW_S, clock=clock, what="audit recomputations",
    )  # fmt: skip


def audit_router(admission: PeerAdmission | None = None) -> APIRouter:
    """The audit routes; ``admission``: each caller's share of recomputations."""
    router = APIRouter()
    admission = admission or recompute_admission()

    @router.post(RECORD_PATH)
    async def record(session_id: str, request: Request) -> Response:
        service: NodeService = request.app.state.node
        stage = service.stage_for(session_id)
        inputs, last, start, length = await service.compute(
            _snapshot, stage, session_id, request.headers.get(H_SESSION_KEY)
        )
        options = service.wire_options
        body = pack(wire.encode_tensor(inputs, options), wire.encode_tensor(last, options))
        headers = {H_START_LAYER: str(start), H_POSITION: str(length)}
        return Response(body, media_type=wire.CONTENT_TYPE, headers=headers)

    @router.post(RECOMPUTE_PATH)
    async def recompute(request: Request) -> Response:
        service: NodeService = request.app.state.node
        stage = service.stage
        limit = service.settings.max_body_bytes  # a record is a frame like a step's
        body = await read_body(request, limit)
        raw = request.headers.get(H_START_LAYER, "")
        if not (raw.isascii() and raw.isdigit()):  # not "²": int() refuses it
            raise InvalidRequest(f"header {H_START_LAYER} must be a layer", param=H_START_LAYER)
        inputs = wire.decode_tensor(body, max_bytes=limit)
        head = stage.shard.is_head  # a head's inputs are token ids (docs/adr/0032)
        inputs = stage.check_inputs(inputs if head else None, None if head else inputs,
                                    limit=stage.sessions.kv_budget_tokens)  # fmt: skip
        per_window = RECOMPUTE_BUDGETS_PER_WINDOW * stage.sessions.kv_budget_tokens
        release = admission.admit(caller_of(request), inputs.shape[1], per_window)
        # Its place is freed when the work ends, not when the caller stops waiting for it.
        try:
            work = asyncio.ensure_future(service.compute(stage.recompute, inputs, int(raw)))
        except BaseException:
            release()
            raise
        work.add_done_callback(lambda _: release())
        last = await asyncio.shield(work)
        headers = {}
        runtime = getattr(request.app.state, "runtime", None)
        secret = runtime.audit_secret() if runtime is not None else None
        if secret:  # signed: the row may become a verdict's evidence (docs/adr/0032)
            digest = hashlib.sha256(body).hexdigest()
            row = row_bytes(last.float().reshape(-1).tolist())
            headers[H_AUDIT_SIGNATURE] = sign_row(secret, runtime.node_id, int(raw), digest, row)
        return Response(wire.encode_tensor(last, service.wire_options), headers=headers,
                        media_type=wire.CONTENT_TYPE)  # fmt: skip

    @router.post(HOLDS_PATH)
    async def holds(session_id: str, request: Request) -> dict:
        service: NodeService = request.app.state.node
        stage = service.stage_for(session_id)
        session = stage.sessions.peek(session_id)
        digest = request.headers.get(H_KEY_DIGEST, "")
        held = (
            session is not None and stage.shard.is_head and session.owner is not None
            and hmac.compare_digest(key_digest(session_id, session.owner), digest)
        )  # fmt: skip
        return {"holds": held}

    return router

"""A step as bytes: the binary form nodes send each other (issue 51, docs/adr/0040).

One fixed struct, then the variable fields, then the step's tensor frame
(``meshnet_common.wire``), all in the one body of a hop's request::

    magic "MST1" | flags (u8) | route hops (u8) | position (u32) | chunk (u32)
    | drafts (u16) | replay pass (u32) | guess from (u32) | ids (u32)
    | session id length (u8) | session key length (u8) | request id length (u8)
    | opening length (u32) | answer-to length (u16) | compute-before length (u16)
    then: session id, session key, request id, each route hop (u16 length + URL), the ids
    (u32 each), the opening (``OpenSpec``'s JSON, only on a session's first step),
    answer-to, compute-before; then the tensor frame.

Big-endian, as network order. Read once at each hop into a ``Step`` (``decode``) and written
once (``encode``): a hop no longer builds and parses a JSON dictionary of header strings,
nor re-reads integers from text. The HTTP headers (``Step.to_headers``) stay the form of
``POST /v1/forward`` for clients that are not nodes; both forms give the same ``Step``,
checked by the same rules (``Step.check``). A body that does not parse is refused with a
400 naming what is wrong.
"""

from __future__ import annotations

import math
import struct

from meshnet_common import wire
from meshnet_common.errors import InvalidRequest
from meshnet_common.logs import accept_request_id, bind_session, request_id_var
from meshnet_common.protocol import validate_session_id
from meshnet_node.dataplane.steps import OpenSpec, Step, parse_answer_to, parse_route

MAGIC = b"MST1"
CONTENT_TYPE = "application/x-meshnet-step"  # a binary step followed by its tensor frame
_FIXED = struct.Struct("!4sBBIIHIIIBBBIHH")
_NONE = 0xFFFFFFFF  # guess_from: not a guess step

_SAMPLE, _IDS, _OPEN, _ANSWER_TO, _COMPUTE, _GUESS, _KEY = (1 << i for i in range(7))


def parse_step(headers, body: bytes, *, max_bytes: int) -> tuple[Step, wire.WireTensor]:
    """A step and its tensor frame (read and bounded; its tensor made on the compute
    thread: ``wire.WireTensor``), checked against each other: the body's binary step (what
    nodes send; its request id then names this task's log lines) or, for a bare tensor
    frame, the HTTP headers' step."""
    if is_step(body):
        step, request_id, start = decode(body)
        if request_id is not None:
            request_id_var.set(accept_request_id(request_id))
        bind_session(step.session_id)
        body = body[start:]
    else:
        step = Step.from_headers(headers)
    frame = wire.read_frame(body, max_bytes=max_bytes)
    shape = frame.shape
    step.check_tokens(shape[1] if len(shape) >= 2 else math.prod(shape))
    return step, frame


def is_step(body: bytes) -> bool:
    """Whether ``body`` starts with a binary step (else it is a bare tensor frame)."""
    return body[:4] == MAGIC


def encode(step: Step, request_id: str | None = None) -> bytes:
    """``step`` (and the request id every hop's log lines carry) as bytes."""
    sid, key = step.session_id.encode(), (step.session_key or "").encode()
    rid = (request_id or "").encode()[:255]
    opening = b"" if step.open_spec is None else step.open_spec.to_header().encode()
    answer_to = (step.answer_to or "").encode()
    compute = (step.compute_before or "").encode() if step.answer_to is not None else b""
    ids = step.ids or ()
    flags = (
        (_SAMPLE if step.sample else 0) | (_IDS if step.ids is not None else 0)
        | (_OPEN if step.open_spec is not None else 0)
        | (_ANSWER_TO if step.answer_to is not None else 0) | (_COMPUTE if compute else 0)
        | (_GUESS if step.guess_from is not None else 0)
        | (_KEY if step.session_key is not None else 0)
    )  # fmt: skip
    route = [hop.encode() for hop in step.route]
    try:
        parts = [
            _FIXED.pack(
                MAGIC, flags, len(route), step.position, step.chunk, step.drafts,
                step.replay_pass, _NONE if step.guess_from is None else step.guess_from,
                len(ids), len(sid), len(key), len(rid), len(opening), len(answer_to),
                len(compute),
            ),
            sid, key, rid,
        ]  # fmt: skip
        for hop in route:
            parts += (len(hop).to_bytes(2, "big"), hop)
        parts.append(struct.pack(f"!{len(ids)}I", *ids))
    except (struct.error, OverflowError) as exc:  # a field past its width (a client's key)
        raise InvalidRequest(f"a step field does not fit its width: {exc}") from exc
    parts += (opening, answer_to, compute)
    return b"".join(parts)


def decode(body: bytes) -> tuple[Step, str | None, int]:
    """The step at the start of ``body``, its request id (None: none sent) and where its
    tensor frame starts. InvalidRequest (a 400) for bytes that are not a valid step."""
    if len(body) < _FIXED.size or not is_step(body):
        raise InvalidRequest("the body does not start with a step")
    (_, flags, hops, position, chunk, drafts, replay_pass, guess_from, count, n_sid, n_key,
     n_rid, n_open, n_answer, n_compute) = _FIXED.unpack_from(body)  # fmt: skip
    reader = _Reader(body, _FIXED.size)
    session_id = reader.text(n_sid)
    key = reader.text(n_key)
    request_id = reader.text(n_rid) or None
    route = tuple(reader.text(reader.u16()) for _ in range(hops))
    ids = reader.ids(count) if flags & _IDS else None
    opening = reader.take(n_open)
    answer_to = reader.text(n_answer)
    compute = reader.text(n_compute)
    if not session_id:
        raise InvalidRequest("a step names its session")
    validate_session_id(session_id)
    open_spec = None
    if flags & _OPEN:
        try:
            open_spec = OpenSpec.model_validate_json(opening)
        except ValueError as exc:
            raise InvalidRequest(f"malformed opening: {exc}", param="open") from exc
    step = Step(
        session_id=session_id,
        session_key=key if flags & _KEY else None,
        position=position,
        chunk=chunk,
        route=parse_route(",".join(route)) if route else (),
        open_spec=open_spec,
        sample=bool(flags & _SAMPLE),
        ids=ids,
        drafts=drafts,
        answer_to=parse_answer_to(answer_to) if flags & _ANSWER_TO else None,
        compute_before=(compute or None) if flags & _COMPUTE else None,
        replay_pass=replay_pass,
        guess_from=guess_from if flags & _GUESS else None,
    )
    if len(route) != len(step.route):
        raise InvalidRequest("a route hop is empty", param="route")
    step.check()
    return step, request_id, reader.at


class _Reader:
    """Consecutive fields of a body, each checked to lie within it."""

    __slots__ = ("body", "at")

    def __init__(self, body: bytes, at: int) -> None:
        self.body, self.at = body, at

    def take(self, length: int) -> bytes:
        end = self.at + length
        if end > len(self.body):
            raise InvalidRequest("the step runs past the end of the body")
        out, self.at = self.body[self.at : end], end
        return out

    def text(self, length: int) -> str:
        try:
            return self.take(length).decode("ascii")
        except UnicodeDecodeError as exc:
            raise InvalidRequest("a step's names and URLs are ASCII") from exc

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def ids(self, count: int) -> tuple[int, ...]:
        return struct.unpack(f"!{count}I", self.take(4 * count))

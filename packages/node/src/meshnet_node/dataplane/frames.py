"""The messages on a hop stream (docs/adr/0022): one WebSocket binary message per request or
answer, many sessions' steps in flight at once on one stream.

A request message::

    kind (u8) | id (u32) | header length (u32) | header: JSON object of str -> str | body

and an answer to it::

    ANSWER (u8) | id (u32, the request's) | status (u16) | header length (u32) | header | body

A step's header is empty (length 0): its body is the step as bytes followed by its tensor
frame (``meshnet_node.dataplane.step_bytes``; raw bf16, split-plane zstd:
``meshnet_common.wire``). Other requests and the answers carry HTTP-style headers as a JSON
object (length 0: none), and an answer's body is its JSON. Big-endian, as network
order. Anything that does not parse is a ``FrameError``: the receiver closes the stream with
an error code, it never guesses.
"""

from __future__ import annotations

import json
import struct
from enum import IntEnum
from typing import NamedTuple

from meshnet_common.protocol import H_COMPUTE

SUBPROTOCOL = "meshnet.hop.v3"  # Sec-WebSocket-Protocol: the version of these messages
STREAM_PATH = "/v1/stream"
H_MAX_MESSAGE = "x-meshnet-max-message"  # the handshake answer: the largest message accepted
MAX_HEADER_BYTES = 1 << 20  # a header longer than this is malformed (ids lists stay far below)
MAX_ANSWER_BYTES = 256 << 20  # answers carry JSON: tokens, logprobs, prompt scores

_REQUEST = struct.Struct("!BII")
_ANSWER = struct.Struct("!BIHI")


class Kind(IntEnum):
    STEP = 1  # POST /v1/forward: run one step here and on the hops after
    CLOSE = 2  # DELETE /v1/sessions/{id}: free a session here and down the chain
    DELIVER = 3  # POST /v1/answers/{id}: a tail's direct answer to this head (ADR-0020)
    ANSWER = 0x80  # the answer to one of the above


_REQUEST_KINDS = {int(k): k for k in (Kind.STEP, Kind.CLOSE, Kind.DELIVER)}  # no enum call


class FrameError(ValueError):
    """A message that is not one of this protocol's."""


class Request(NamedTuple):
    kind: Kind
    id: int
    headers: dict[str, str]
    body: bytes


class Answer(NamedTuple):
    id: int
    status: int
    headers: dict[str, str]
    body: bytes


def _header_bytes(headers: dict[str, str]) -> bytes:
    if not headers:  # a step's message: its body is the binary step (``step_bytes``)
        return b""
    raw = json.dumps(headers, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise FrameError(f"a header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    return raw


def encode_request(kind: Kind, request_id: int, headers: dict[str, str], body: bytes) -> bytes:
    raw = _header_bytes(headers)
    return b"".join((_REQUEST.pack(kind, request_id, len(raw)), raw, body))


def encode_answer(request_id: int, status: int, headers: dict[str, str] | bytes,
                  body: bytes) -> bytes:  # fmt: skip
    """``headers`` as a dict, or already as the header's JSON bytes."""
    raw = headers if isinstance(headers, bytes) else _header_bytes(headers)
    return b"".join((_ANSWER.pack(Kind.ANSWER, request_id, status, len(raw)), raw, body))


def _headers(data: bytes, start: int, length: int) -> dict[str, str]:
    if length > MAX_HEADER_BYTES:
        raise FrameError(f"a header of {length} bytes exceeds {MAX_HEADER_BYTES}")
    if start + length > len(data):
        raise FrameError("the header runs past the end of the message")
    if not length:
        return {}
    try:
        headers = json.loads(data[start : start + length])
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameError(f"the header is not JSON: {exc}") from None
    if type(headers) is not dict:
        raise FrameError("the header must be a JSON object of strings")
    try:  # JSON keys are strings; joining checks every value is one, at C speed
        "".join(headers.values())
    except TypeError:
        raise FrameError("the header must be a JSON object of strings") from None
    return headers


def decode_request(data: bytes) -> Request:
    if len(data) < _REQUEST.size:
        raise FrameError(f"a request message is at least {_REQUEST.size} bytes")
    kind, request_id, length = _REQUEST.unpack_from(data)
    known = _REQUEST_KINDS.get(kind)
    if known is None:
        raise FrameError(f"unknown request kind {kind}")
    headers = _headers(data, _REQUEST.size, length)
    return Request(known, request_id, headers, data[_REQUEST.size + length :])


def decode_answer(data: bytes) -> Answer:
    if len(data) < _ANSWER.size:
        raise FrameError(f"an answer message is at least {_ANSWER.size} bytes")
    kind, request_id, status, length = _ANSWER.unpack_from(data)
    if kind != Kind.ANSWER:
        raise FrameError(f"expected an answer, got kind {kind}")
    if not 100 <= status < 600:
        raise FrameError(f"status {status} is not an HTTP status")
    end = _ANSWER.size + length
    compute = _compute_only(data, _ANSWER.size, end)
    headers = _headers(data, _ANSWER.size, length) if compute is None else compute
    return Answer(request_id, status, headers, data[end:])


_COMPUTE_HEADER = b'{"%s":"' % H_COMPUTE.encode()


def _compute_only(data: bytes, start: int, end: int) -> dict[str, str] | None:
    """A step's answer header, ``{"x-meshnet-compute-ms":"<digits, dots, commas>"}``, read
    without a JSON parser (every decode step's answer has exactly this header, once per
    hop); None for any other header, which goes to ``json.loads``."""
    value = start + len(_COMPUTE_HEADER)
    if end > len(data) or end - value < 2 or data[end - 2 : end] != b'"}':
        return None
    if not data.startswith(_COMPUTE_HEADER, start):
        return None
    digits = data[value : end - 2]
    if digits.translate(None, b"0123456789.,"):  # anything else: let JSON decide
        return None
    return {H_COMPUTE: digits.decode("ascii")}

"""A session's next step on a decode lane, read against its last one (docs/adr/0058).

The steps of one session on one lane differ only in their position and their input token:
every other byte of the step (session, key, request id, route, flags) and of its frame's
header (dtype, shape, packing) is the same. Reading a step in full (``step_bytes``,
``wire.read_frame``, the checks, a tensor made of its frame) cost ~0.2 ms a hop on a core
whose caches the pass emptied, each torch call tens of microseconds there.

``KnownStep`` keeps the bytes of a session's last step read in full on a lane, the bytes of
the step it sent on, and an input tensor made ready while the hop idles (after the step's
answer or its next hop's step is written). A step whose bytes match is read by comparing
them and unpacking its two integers, and its frame's body is copied into that tensor (a
raw body as it is; a compressed one read by ``wire.read_frame`` first); the checks
that can change between steps (the stage, the session, the lanes) are made again by the
relay. Anything else is read in full.

``NextMessage`` is the other way: the whole lane message a hop writes for a session's next
step (the lane's header, the step's bytes, a raw frame's header and room for its body),
kept from the step written before it. A step fills in its number, position, id and the
pass's output (one copy from the tensor's memory) and is written as it is: ~3 torch and
encoder calls and three joins fewer a hop than building the message anew.

Where the node's kernel module is built, both are one native call (``lane_io``): the
step's parts compared and its body copied as its message is read, the next message filled
in; the Python below serves until then.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import replace

import torch

from meshnet_common import wire
from meshnet_node.dataplane import lane_io, lanes
from meshnet_node.dataplane.steps import Step

_U32 = struct.Struct("!I")
POSITION_AT = 6  # in a step's bytes: magic (4), flags (1), route hops (1), then the position


class KnownStep:
    """What a lane's last step of session ``step.session_id`` settled. ``payload``: that
    step's bytes and frame; ``start``: where its frame begins; ``stage``: the stage it ran
    on; ``hop``, ``down``: the next hop and its lane (None at the tail); ``onward``: the bytes
    of the step sent on (None at the tail)."""

    __slots__ = ("body_at", "direct_on", "down", "dtype", "hop", "id_at", "input", "lead",
                 "message", "mid", "native",
                 "onward", "owner", "raw", "rest", "sample", "session_id", "shape",
                 "stage", "start", "step", "view")  # fmt: skip

    def __init__(self, payload: bytes, start: int, step: Step, frame: wire.WireTensor, stage,
                 hop: str | None, down, onward: bytes | None) -> None:  # fmt: skip
        self.session_id, self.owner, self.sample = step.session_id, step.session_key, step.sample
        self.step, self.stage, self.hop, self.down = step, stage, hop, down
        self.dtype, self.shape = frame.dtype, frame.shape
        self.id_at = start - 4  # a plain step's one id is its last field (``step_bytes``)
        self.start = start
        self.body_at, self.raw = wire.body_at(payload, start)
        self.lead = payload[:POSITION_AT]
        self.mid = payload[POSITION_AT + 4 : self.id_at]
        self.rest = payload[start : self.body_at]  # the frame's header and shape
        self.onward = onward
        self.message: NextMessage | None = None  # the step sent on, to fill in (relay)
        self.direct_on = False  # the next hop reads DIRECT steps (ADR-0060; relay)
        self.input: torch.Tensor | None = None
        self.view: memoryview | None = None
        module = lane_io.native() if self.raw else None  # a compressed body: read in Python
        self.native = None if module is None else module.LaneKnown(
            self.lead, self.mid, self.rest, self.id_at, self.body_at
        )  # fmt: skip

    @staticmethod
    def of(payload: bytes, start: int, step: Step, frame: wire.WireTensor, stage,
           hop: str | None, down, onward: bytes | None) -> KnownStep | None:  # fmt: skip
        """The record of a plain step just read in full (None where its next one could not
        be read against it: not one id)."""
        if step.ids is None or len(step.ids) != 1 or stage.shard.is_head:
            return None
        return KnownStep(payload, start, step, frame, stage, hop, down, onward)

    def matches(self, payload: bytes) -> bool:
        """Whether ``payload`` is this session's step, differing only in position and id
        (and, packed, in its body's bytes)."""
        id_at = self.id_at
        return (
            payload[:POSITION_AT] == self.lead
            and payload[POSITION_AT + 4 : id_at] == self.mid
            and payload[id_at + 4 : self.body_at] == self.rest
        )  # fmt: skip

    def read(self, payload: bytes) -> tuple[int, int, torch.Tensor] | None:
        """A matching step's position, id and input tensor (its frame's body copied into
        the one made ready); None where none is ready or the body is not the tensor's."""
        hidden, view = self.input, self.view
        if hidden is None or view is None:
            return None
        if self.raw:
            body = memoryview(payload)[self.body_at :]
        else:  # unpacked by the frame's own reader, which checks what it reads
            body = wire.read_frame(payload[self.start :], max_bytes=len(view)).data
        if len(body) != len(view):
            return None
        self.input = self.view = None  # each step gets a tensor of its own
        if self.native is not None:
            self.native.disarm()
        view[:] = body
        (position,) = _U32.unpack_from(payload, POSITION_AT)
        (token,) = _U32.unpack_from(payload, self.id_at)
        return position, token, hidden

    def prepare(self) -> None:
        """The next step's input tensor, made while the hop idles."""
        if self.input is None:
            hidden = torch.empty(self.shape, dtype=self.dtype)
            self.input = hidden
            self.view = memoryview(hidden.reshape(-1).view(torch.uint8).numpy())
            if self.native is not None:
                self.native.arm(hidden)

    def onward_bytes(self, position: int, token: int) -> bytes:
        """The bytes of the step sent on for the step at ``position`` with id ``token``."""
        return moved(self.onward, position, token)  # type: ignore[arg-type]

    def onward_step(self, position: int, token: int) -> Step:
        """The step sent on, as a ``Step`` (to send it by the stream when refused)."""
        return replace(self.step, route=self.step.route[1:], position=position, ids=(token,))


def moved(head: bytes, position: int, token: int) -> bytes:
    """A plain step's bytes (``step_bytes``: one id, its last field) at ``position``, with
    input ``token``."""
    out = bytearray(head)
    _U32.pack_into(out, POSITION_AT, position)
    _U32.pack_into(out, len(out) - 4, token)
    return bytes(out)


SEQ_AT = 5  # in a lane message: length (4), kind (1), then its number


class NextMessage:
    """A lane message to fill in for each next step of one session (``of``): a ``STEP``, or
    a ``DIRECT`` one whose ``Direct`` goes before the step (ADR-0060). The buffer is
    reused: a hop writes a session's next step only once the one before was answered."""

    __slots__ = ("_body", "buffer", "frame_at", "id_at", "kind", "native", "native_send",
                 "native_send_on", "nbytes", "position_at", "prefix_size", "shape")  # fmt: skip

    def __init__(self, head: bytes, frame: bytes, body_at: int, hidden: torch.Tensor,
                 kind: lanes.LaneKind, prefix: bytes) -> None:  # fmt: skip
        self.buffer = bytearray(lanes.message(kind, 0, prefix, head, frame))
        self.kind, self.prefix_size = kind, len(prefix)
        start = lanes.HEAD_BYTES + len(prefix)
        self.position_at = start + POSITION_AT
        self.id_at = start + len(head) - 4  # a plain step's one id is its last field
        self.frame_at = start + len(head)
        self.nbytes = len(frame) - body_at
        self.shape = hidden.shape
        room = (ctypes.c_char * self.nbytes).from_buffer(self.buffer, self.frame_at + body_at)
        self._body = (room, ctypes.addressof(room))  # the export pins the buffer's memory
        module = lane_io.native()
        message = None if module is None else module.LaneMessage(
            ctypes.addressof(room) - self.frame_at - body_at, len(self.buffer),
            self.position_at, self.id_at, self.frame_at + body_at, hidden,
        )  # fmt: skip
        self.native = None if message is None else message.fill
        self.native_send = None if message is None else message.send
        self.native_send_on = None if message is None else message.send_on

    @staticmethod
    def of(head: bytes, frame: bytes, hidden: torch.Tensor,
           direct: lanes.Direct | None = None) -> NextMessage | None:  # fmt: skip
        """The message that carried step bytes ``head`` with ``frame``, ``hidden`` encoded
        raw, ``direct`` before them (None where it was not raw: compressed, or not a CPU
        tensor's bytes as they lie)."""
        body_at, raw = wire.body_at(frame)
        if not raw or not hidden.is_cpu or not hidden.is_contiguous():
            return None
        if len(frame) - body_at != hidden.numel() * hidden.element_size():
            return None
        kind = lanes.LaneKind.STEP if direct is None else lanes.LaneKind.DIRECT
        prefix = b"" if direct is None else direct.prefix()
        return NextMessage(head, frame, body_at, hidden, kind, prefix)

    def fits(self, direct: lanes.Direct | None) -> bool:
        """Whether a step sent ``direct`` (or not) fills this message in."""
        if direct is None:
            return self.kind == lanes.LaneKind.STEP
        size = lanes.DIRECT_HEAD_BYTES + 4 * len(direct.compute_us)
        return self.kind == lanes.LaneKind.DIRECT and self.prefix_size == size

    def fill(self, seq: int, position: int, token: int, hidden: torch.Tensor,
             direct: lanes.Direct | None = None) -> bytearray | None:  # fmt: skip
        """The message for the step numbered ``seq`` at ``position`` with input ``token``,
        its frame ``hidden`` (the stage's output, as the first one was made), ``direct``
        before it where it was made with one (``fits``); None where ``hidden`` is not of
        the first one's shape."""
        native = self.native
        if native is not None:
            prefix = None if direct is None else direct.prefix()
            return self.buffer if native(seq, position, token, hidden, prefix) else None
        if hidden.shape != self.shape:
            return None
        buffer = self.buffer
        _U32.pack_into(buffer, SEQ_AT, seq)
        if direct is not None:
            buffer[lanes.HEAD_BYTES : lanes.HEAD_BYTES + self.prefix_size] = direct.prefix()
        _U32.pack_into(buffer, self.position_at, position)
        _U32.pack_into(buffer, self.id_at, token)
        ctypes.memmove(self._body[1], hidden.data_ptr(), self.nbytes)
        return buffer

    def send(self, sock, seq: int, position: int, token: int, hidden: torch.Tensor,
             prefix: bytes | None = None,
             timeout_s: float = lanes.LANE_TIMEOUT_S) -> int:  # fmt: skip
        """``fill``'s message written on ``sock`` (within ``timeout_s``), ``prefix`` (a
        ``DIRECT`` step's, as bytes) before the step where it goes with one: its size, or 0
        (nothing written) where that does not fill it in (``fits``, ``fill``). One native
        call where the module is built (a fill and a write are two, and the write's
        frames, on a core the pass left cold). A failed write raises ``LaneError``."""
        send = self.native_send
        if send is not None:
            return send(sock.fileno(), seq, position, token, hidden, prefix, timeout_s)
        direct = None if prefix is None else lanes.parse_direct(prefix)[0]
        data = self.fill(seq, position, token, hidden, direct) if self.fits(direct) else None
        if data is None:
            return 0
        lanes.write(sock, data)
        return len(data)

    def send_on(self, sock, seq: int, position: int, token: int, hidden: torch.Tensor,
                came: bytes | None, own_ms: float) -> int:  # fmt: skip
        """A relay's ``send`` of the step it ran: ``came``, the ``DIRECT`` prefix the step
        came with (None: a ``STEP``), goes on with this hop's compute ``own_ms`` added
        (``Direct.on``); 0 (nothing written) where that does not fill this message in. One
        native call where the module is built: no ``Direct`` made, parsed or packed."""
        send_on = self.native_send_on
        if send_on is not None:
            return send_on(sock.fileno(), seq, position, token, hidden, came, own_ms,
                           lanes.LANE_TIMEOUT_S)  # fmt: skip
        direct = None if came is None else lanes.parse_direct(came)[0].on(own_ms)
        return self.send(sock, seq, position, token, hidden,
                         None if direct is None else direct.prefix())  # fmt: skip

    def frame(self) -> bytes:
        """The frame of the step last filled in (to send it on the stream instead)."""
        return bytes(memoryview(self.buffer)[self.frame_at :])

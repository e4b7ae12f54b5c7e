"""A decode lane's messages read, and a session's next one filled in, by one native call
each where the node's kernel module is built (``kernels/lane_io.cpp``, docs/adr/0058): a
message (``read``, ``read_message``), a node's next step where it comes before anything
else (``read_next``), a head's answer on either of its lanes (``read_answer``; both looked
for ahead where they are due: ``lane_wait``), and the tail's answer to a direct step
written (``send_answer``).

On a core whose caches a pass has just emptied, each Python call costs 10-40 times its
warm cost: reading a message (two receives, its header unpacked, its kind looked up), a
step read against the session's last (its parts compared, its body copied, two integers
unpacked) and the next message filled in (a shape compared, ``data_ptr``, three packs, a
memmove) cost ~65, ~45 and ~85 us there, one call each ~40. The bytes are the same either
way: until the module is built and checked, and where it is not, the Python does it
(``lanes.read_message``, ``KnownStep``, ``NextMessage``)."""

from __future__ import annotations

import select
import socket

from meshnet_node.dataplane import answer_bytes, lanes
from meshnet_node.dataplane.lanes import LaneKind
from meshnet_node.kernels import intpack

_KIND_OF = (None, *LaneKind)  # by value (1..): a tuple index, not a call
_state: dict = {"module": None}


def native():
    """The kernel module, once built and checked and holding the lane calls (else None)."""
    module = _state["module"]
    if module is None:
        module = intpack.module()
        if module is None or not hasattr(module, "lane_answer_send"):
            return None
        module.lane_set_error(lanes.LaneError)
        _state["module"] = module
    return module


def read(sock: socket.socket, timeout_s: float, known=None):
    """One whole message from ``sock`` (each part within ``timeout_s``): (kind, number,
    payload, where its step begins: after a ``DIRECT`` step's prefix, else 0; and, where
    ``known`` (a ``KnownStep``) matches the step, its (position, id, input tensor) with
    the body copied in, else None)."""
    module = _state["module"] or native()
    if module is not None:
        lane_known = None if known is None else known.native
        return _read(module.lane_read(sock.fileno(), timeout_s, lane_known), known)
    kind, seq, payload = lanes.read_message(sock)
    start = lanes.parse_direct(payload)[1] if kind == LaneKind.DIRECT else 0
    return _match(kind, seq, payload, start, known)


def read_next(sock: socket.socket, others: int, timeout_s: float, known=None,
              sleep_s: float = 0.0, spin_s: float = 0.0):  # fmt: skip
    """``read``'s message from ``sock`` once it comes before anything else the compute
    thread waits for (``others``: its selector's descriptor, readable while any socket it
    watches is); None where ``others`` is readable first, or without the kernel module (then
    the selector reads ``sock`` when it comes). On a core the step just run left cold, the
    selector's return, its dispatch and the read's call cost ~50 us more than this one
    call. ``sleep_s``, ``spin_s``: where the message is due, asleep that long, then looking
    for it without sleeping for up to ``spin_s`` (``lane_wait.Cadence.due``)."""
    module = _state["module"] or native()
    if module is None:
        return None
    lane_known = None if known is None else known.native
    got = module.lane_next(sock.fileno(), others, timeout_s, lane_known, sleep_s, spin_s)
    return None if got is None else _read(got, known)


def _read(got: tuple, known):
    """``read``'s answer from the native read's ``got``."""
    kind, seq, payload, start, position, token, hidden = got
    if hidden is not None:
        known.input = known.view = None  # handed over: the next step gets its own
        return _KIND_OF[kind], seq, payload, start, (position, token, hidden)
    if known is None or known.native is not None:
        return _KIND_OF[kind], seq, payload, start, None
    # a compressed frame's step: read by its frame's reader
    return _match(_KIND_OF[kind], seq, payload, start, known)


def _match(kind: LaneKind, seq: int, payload: bytes, start: int, known):
    got = None
    if known is not None and kind in (LaneKind.STEP, LaneKind.DIRECT):
        step = payload[start:] if start else payload
        if known.matches(step):
            got = known.read(step)
    return kind, seq, payload, start, got


def read_message(sock: socket.socket, timeout_s: float) -> tuple[LaneKind, int, bytes]:
    """``lanes.read_message``, natively where it can."""
    module = _state["module"] or native()
    if module is None:
        return lanes.read_message(sock)
    kind, seq, payload, _, _, _, _ = module.lane_read(sock.fileno(), timeout_s, None)
    return _KIND_OF[kind], seq, payload


def read_answer(sock: socket.socket, answers: socket.socket | None, timeout_s: float,
                seq: int, answers_seq: int, sleep_s: float = 0.0,
                spin_s: float = 0.0) -> tuple[bytes, bool, int, int] | None:  # fmt: skip
    """A head's answer to its step numbered ``seq`` on its lane ``sock`` or, with an
    ``answers`` lane, to the one numbered ``answers_seq`` there, whichever comes (an older
    step's answer is skipped): (payload, whether it came on the answer lane, its status and
    the token it names: ``answer_token``); None where the answer lane failed (closed,
    broken, not a lane message): read the lane alone then. A failure of the lane itself, a
    message not an answer or no answer within ``timeout_s`` raise ``LaneError``. ``sleep_s``,
    ``spin_s``: as ``read_next``'s (the kernel module's call alone looks ahead)."""
    if answers is not None and answers.fileno() < 0:
        return None
    module = _state["module"] or native()
    if module is not None:
        got = module.lane_answer(
            sock.fileno(), -1 if answers is None else answers.fileno(), timeout_s, seq,
            answers_seq, sleep_s, spin_s,
        )  # fmt: skip
        return None if got[0] is None else got
    while True:
        source = sock
        if answers is not None:
            try:
                ready, _, _ = select.select((answers, sock), (), (), timeout_s)
            except (OSError, ValueError):  # the answer lane closed under the select
                return None
            if not ready:
                raise lanes.LaneError(f"no answer within {timeout_s:.0f} s")
            source = ready[0]
        try:
            kind, got_seq, payload = lanes.read_message(source)
        except lanes.LaneError:
            if source is sock:
                raise
            return None
        if kind != LaneKind.ANSWER:
            raise lanes.LaneError(f"a {kind.name} message from the hop")
        if got_seq == (seq if source is sock else answers_seq):
            return (payload, source is not sock, *answer_token(payload))


def answer_token(payload: bytes) -> tuple[int, int]:
    """An answer's status and the token its body names (``answer_bytes.token_of``): all a
    head's burst needs to go on; -1 where the answer is malformed (status: ``parse_answer``
    would refuse it) or names no token."""
    try:
        got = lanes.parse_answer(payload)
    except lanes.LaneError:
        return -1, -1
    token = answer_bytes.token_of(got.body)
    return got.status, -1 if token is None else token


def send_answer(sock: socket.socket, came: bytes, status: int, own_ms: float,
                body: bytes) -> None:  # fmt: skip
    """The tail's answer to a ``DIRECT`` step that came with the prefix ``came`` (ADR-0060),
    on the head's answer lane ``sock``: numbered as ``came`` says, ``status``, every hop's
    compute and this one's ``own_ms`` (as ``Direct.compute`` says them), ``body``; one
    native call where the module is built. A failure raises ``LaneError``."""
    module = _state["module"] or native()
    if module is None:
        direct = lanes.parse_direct(came)[0]
        lanes.write(sock, lanes.answer(direct.seq, status, direct.compute(own_ms), body))
        return
    module.lane_answer_send(sock.fileno(), came, status, own_ms, body, lanes.LANE_TIMEOUT_S)

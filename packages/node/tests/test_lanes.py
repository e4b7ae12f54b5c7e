"""Decode lanes' parts (docs/adr/0058): the messages over a real socket pair, the head's
client parsing answers however the bytes are cut, which steps may take a lane, the
compute thread reading sockets between the passes it runs, and a session's next step read
against its last."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import replace

import pytest

from meshnet_node.dataplane import answer_bytes, lane_io, lanes
from meshnet_node.dataplane.lanes import LaneError, LaneKind
from meshnet_node.dataplane.steps import OpenSpec, Step
from meshnet_node.engine.sampling import SampledToken
from meshnet_node.scheduling.scheduler import ComputeScheduler


def test_a_message_crosses_a_socket_whole():
    a, b = socket.socketpair()
    with a, b:
        lanes.blocking(b)
        lanes.write(a, lanes.message(LaneKind.STEP, 7, b"step", b"frame"))
        lanes.write(a, lanes.answer(8, 200, "1.500,2.250", b"MSA1\x00"))
        assert lanes.read_message(b) == (LaneKind.STEP, 7, b"stepframe")
        kind, seq, payload = lanes.read_message(b)
        assert (kind, seq) == (LaneKind.ANSWER, 8)
        assert lanes.parse_answer(payload) == lanes.LaneAnswer(200, "1.500,2.250", b"MSA1\x00")


def test_a_lane_that_closes_or_sends_garbage_is_an_error():
    a, b = socket.socketpair()
    with b:
        lanes.blocking(b)
        a.sendall(b"\x00\x00\x00\x01\x09\x00\x00\x00\x01x")  # kind 9: not a lane message
        with pytest.raises(LaneError, match="not a lane message"):
            lanes.read_message(b)
        a.close()
        with pytest.raises(LaneError, match="closed"):
            lanes.read_message(b)
    with pytest.raises(LaneError, match="shorter"):
        lanes.parse_answer(b"\x00")
    with pytest.raises(LaneError, match="past its end"):
        lanes.parse_answer(b"\x00\xc8\x00\x09ab")


def test_a_message_begun_and_not_finished_times_out_in_the_kernel(monkeypatch):
    """A compute thread's lane blocks without Python's poll before each read, with the
    kernel's timeout: a message cut short still fails within ``LANE_TIMEOUT_S``."""
    monkeypatch.setattr(lanes, "LANE_TIMEOUT_S", 0.2)
    a, b = socket.socketpair()
    with a, b:
        lanes.blocking(b)
        assert b.gettimeout() is None  # no Python timeout: the kernel's
        a.sendall(lanes.message(LaneKind.STEP, 1, b"step")[:-2])
        started = time.monotonic()
        with pytest.raises(LaneError, match="failed"):
            lanes.read_message(b)
        assert 0.15 < time.monotonic() - started < 2.0


@pytest.mark.parametrize(("value", "want"), [
    ("4242 s3cret", (4242, "s3cret")), (None, None), ("", None), ("0 x", None),
    ("70000 x", None), ("12 ", None), ("x1 y", None),
])  # fmt: skip
def test_the_offer_in_a_streams_handshake(value, want):
    assert lanes.parse_lane_header(value) == want


def test_a_lane_that_takes_direct_steps_says_so_in_the_handshake():
    """A node of this version says its lane reads ``DIRECT`` steps (ADR-0060); one of an
    older version says nothing, and its hop before sends it plain steps."""
    from types import SimpleNamespace

    from meshnet_node.dataplane.streams import _Stream

    async def direct(headers: dict) -> bool:
        ws = SimpleNamespace(response=SimpleNamespace(headers=headers), transport=None)
        stream = _Stream(ws, "ws://127.0.0.1:9/v1/stream")
        stream.reader.cancel()  # no socket behind it to read
        with contextlib.suppress(asyncio.CancelledError):
            await stream.reader
        return stream.lane_direct

    offer = {lanes.H_LANE: "4242 s3cret"}
    assert asyncio.run(direct({**offer, lanes.H_LANE_DIRECT: "1"}))
    assert not asyncio.run(direct(offer))


def test_only_plain_decode_steps_take_a_lane():
    base = Step("s1", "k", 9, route=("http://127.0.0.1:9",), ids=(5,))
    assert lanes.plain(base)
    spec = OpenSpec()
    for other in (
        Step("s1", "k", 0, open_spec=spec),
        Step("s1", "k", 9, chunk=1),
        Step("s1", "k", 9, ids=(5, 6), drafts=1),
        Step("s1", "k", 9, guess_from=8),
        Step("s1", "k", 9, replay_pass=2),
        Step("s1", "k", 9, answer_to="http://127.0.0.1:1"),
    ):
        assert not lanes.plain(other), other


def test_the_heads_lane_writes_steps_and_parses_answers_however_they_are_cut():
    async def main():
        a, b = socket.socketpair()
        client = lanes.LaneClient(a)

        class Transport:
            def close(self):
                pass

        client.connection_made(Transport())
        first = lanes.LaneStep(client, lambda: b"one")
        second = lanes.LaneStep(client, lambda: b"two")
        writer = first.encoder(lambda hidden: b"<" + hidden + b">")
        assert writer(b"x") == b"<x>"  # the frame, and the step written with it
        second.write(b"")
        assert first.written and second.written
        lanes.blocking(b)
        assert lanes.read_message(b) == (LaneKind.STEP, 1, b"one<x>")
        assert lanes.read_message(b) == (LaneKind.STEP, 2, b"two")
        data = lanes.answer(2, 200, "1.0", b"B") + lanes.answer(1, 404, "", b"{}")
        for i in range(len(data)):  # a byte at a time
            client.data_received(data[i : i + 1])
        assert (await first.answer).status == 404
        assert (await second.answer) == lanes.LaneAnswer(200, "1.0", b"B")
        third = lanes.LaneStep(client, lambda: b"three")
        client.connection_lost(None)
        with pytest.raises(LaneError, match="closed"):
            await third.answer
        assert not client.usable
        third.write(b"")  # the lane is gone: the failure is the step's, not the thread's
        assert not third.written and third.failed is not None
        b.close()

    asyncio.run(main())


def test_the_compute_thread_reads_its_sockets_between_passes():
    scheduler = ComputeScheduler()
    watch = scheduler.read_sockets()
    a, b = socket.socketpair()
    seen: list[tuple[str, bytes]] = []
    added = threading.Event()
    got = threading.Event()

    def reader(sock):
        seen.append((threading.current_thread().name, sock.recv(16)))
        got.set()

    try:
        watch.watch(b, reader, lambda _s: added.set())
        assert scheduler.call(lambda: threading.current_thread().name).result(5) == "compute"
        assert added.wait(5)
        a.sendall(b"ping")
        assert got.wait(5)
        assert seen == [("compute", b"ping")]
        # a pass handed over while it waits on its sockets still runs
        assert scheduler.call(lambda: 41 + 1).result(5) == 42
        # a reader that fails closes its socket, not the compute thread
        c, d = socket.socketpair()
        watch.watch(d, lambda _s: 1 / 0)
        c.sendall(b"x")
        c.settimeout(5)
        with contextlib.suppress(ConnectionResetError):  # unread bytes: a reset
            assert c.recv(1) == b""  # closed by the compute thread, which lives on
        assert scheduler.call(lambda: "alive").result(5) == "alive"
        c.close()
    finally:
        scheduler.shutdown()
        a.close()


@pytest.fixture(params=["python", "native"])
def lane_calls(request, monkeypatch):
    """Each lane read and fill both ways: in Python, and by the kernel module's one call
    (``lane_io``), which must give the same bytes and values."""

    from meshnet_node.kernels import packed

    if request.param == "python":
        monkeypatch.setitem(lane_io._state, "module", None)
        monkeypatch.setattr(lane_io, "native", lambda: None)
    elif not packed.start() or packed.wait() is None or lane_io.native() is None:
        pytest.skip(f"the kernel module is not built here: {packed.unavailable_reason()}")
    return request.param


def test_a_sessions_next_step_is_read_against_its_last(lane_calls):
    """``KnownStep``: a step that differs from the last read in full only in its position
    and id is read by comparing bytes, its frame's body (raw or packed) copied into a tensor
    made ready before; anything else is not one of its steps."""
    import torch

    from meshnet_common import wire
    from meshnet_node.dataplane import step_bytes
    from meshnet_node.dataplane.lane_known import KnownStep

    class Shard:
        is_head = False

    class Stage:
        shard = Shard()

    route = ("http://127.0.0.1:9", "http://127.0.0.1:10")
    for options in (wire.WireOptions(zstd_level=0, shuffle=False), wire.WireOptions()):
        hidden = torch.randn(1, 1, 64).to(torch.bfloat16)

        def payload(step, tensor=hidden, options=options):
            return step_bytes.encode(step, "req-1") + wire.encode_tensor(tensor, options)

        first = Step("s1", "k", 9, route=route, ids=(5,))
        body = payload(first)
        step, _, start = step_bytes.decode(body)
        onward = step_bytes.encode(replace(step, route=route[1:]), "req-1")
        frame = wire.read_frame(body[start:])
        known = KnownStep.of(body, start, step, frame, Stage(), route[0], None, onward)
        nxt, later = Step("s1", "k", 10, route=route, ids=(77,)), torch.randn(1, 1, 64)
        nxt_body = payload(nxt, later.to(torch.bfloat16))
        assert known.matches(nxt_body)
        assert known.read(nxt_body) is None  # no tensor made ready yet
        known.prepare()
        position, token, tensor = known.read(nxt_body)
        assert (position, token) == (10, 77)
        assert torch.equal(tensor, later.to(torch.bfloat16))
        assert known.onward_bytes(10, 77) == step_bytes.encode(
            replace(nxt, route=route[1:]), "req-1"
        )
        assert known.onward_step(10, 77) == replace(nxt, route=route[1:])
        for other in (
            Step("s2", "k", 10, route=route, ids=(77,)),
            Step("s1", "x", 10, route=route, ids=(77,)),
            Step("s1", "k", 10, route=route[:1], ids=(77,)),
            Step("s1", "k", 10, route=route, ids=(77,), sample=not first.sample),
        ):
            assert not known.matches(payload(other))
        assert not known.matches(payload(nxt, hidden.float()))  # another dtype
    assert (
        KnownStep.of(body, start, replace(step, ids=None), frame, Stage(), None, None, None) is None
    )


def test_a_sessions_next_message_is_its_last_filled_in(lane_calls):
    """``NextMessage``: the lane message of a session's next step, filled in from the last
    one written, is byte for byte the message built anew; a compressed frame makes none, an
    output of another shape fills none, and the frame reads back for the stream."""
    import torch

    from meshnet_common import wire
    from meshnet_node.dataplane import step_bytes
    from meshnet_node.dataplane.lane_known import NextMessage, moved

    raw = wire.WireOptions(zstd_level=0, shuffle=False)
    head = step_bytes.encode(Step("s1", "k", 9, route=("http://127.0.0.1:9",), ids=(5,)), "r")
    first = torch.randn(1, 1, 576).to(torch.bfloat16)
    frame = wire.encode_tensor(first, raw)
    assert NextMessage.of(head, wire.encode_tensor(first), first) is None  # zstd: built anew
    message = NextMessage.of(head, frame, first)
    assert bytes(message.buffer) == lanes.message(LaneKind.STEP, 0, head, frame)
    for seq, position, token in ((7, 10, 77), (8, 11, 2**32 - 1), (2**32 - 1, 12, 0)):
        later = torch.randn(1, 1, 576).to(torch.bfloat16)
        built = lanes.message(LaneKind.STEP, seq, moved(head, position, token),
                              wire.encode_tensor(later, raw))  # fmt: skip
        assert bytes(message.fill(seq, position, token, later)) == built
        assert message.frame() == wire.encode_tensor(later, raw)
        with contextlib.closing(_replay(built)) as sock:
            kind, got_seq, _ = lanes.read_message(sock)
        assert (kind, got_seq) == (LaneKind.STEP, seq)
    assert message.fill(9, 13, 1, torch.randn(1, 2, 576).to(torch.bfloat16)) is None
    # filled in and written in one call: the same bytes on the socket, nothing written
    # where it fills none, and a lane that closed an error
    a, b = socket.socketpair()
    with a, b:
        later = torch.randn(1, 1, 576).to(torch.bfloat16)
        built = lanes.message(LaneKind.STEP, 5, moved(head, 20, 99),
                              wire.encode_tensor(later, raw))  # fmt: skip
        assert message.send(a, 5, 20, 99, later) == len(built)
        assert message.send(a, 6, 21, 1, torch.randn(1, 2, 576).to(torch.bfloat16)) == 0
        direct = lanes.direct_prefix(b"8 bytes!", 3)  # a head's, no hop timed yet
        assert direct == lanes.Direct(b"8 bytes!", 3, ()).prefix()
        assert message.send(a, 6, 21, 1, later, direct) == 0  # a STEP's message: none
        assert lanes.read_message(b) == (LaneKind.STEP, 5, built[lanes.HEAD_BYTES :])
        b.close()
        with pytest.raises(LaneError):
            message.send(a, 7, 22, 1, later)


def test_a_direct_step_carries_its_tag_the_heads_number_and_each_hops_compute(lane_calls):
    """``DIRECT`` (ADR-0060): the prefix reads back as written; each middle hop adds its
    compute, the tail's answer says every hop's in route order; a message filled in with
    one equals the one built anew, and fits only a prefix of its size."""
    import torch

    from meshnet_common import wire
    from meshnet_node.dataplane import step_bytes
    from meshnet_node.dataplane.lane_known import NextMessage, moved

    at_head = lanes.Direct(b"8 bytes!", 41, ())
    at_tail = at_head.on(12.3456).on(7.0)
    assert at_tail == lanes.Direct(b"8 bytes!", 41, (12345, 7000))
    assert at_tail.compute(19.25) == "12.345,7.000,19.250"
    assert lanes.parse_direct(at_tail.prefix() + b"step") == (at_tail, len(at_tail.prefix()))
    with pytest.raises(LaneError):
        lanes.parse_direct(at_tail.prefix()[:-1])
    raw = wire.WireOptions(zstd_level=0, shuffle=False)
    head = step_bytes.encode(Step("s1", "k", 9, route=("http://127.0.0.1:9",), ids=(5,)), "r")
    hidden = torch.randn(1, 1, 64).to(torch.bfloat16)
    frame = wire.encode_tensor(hidden, raw)
    message = NextMessage.of(head, frame, hidden, at_head.on(1.0))
    assert message.fits(at_head.on(2.0)) and not message.fits(None)
    assert not message.fits(at_tail)  # two hops timed: another size
    later = torch.randn(1, 1, 64).to(torch.bfloat16)
    sent = lanes.Direct(b"8 bytes!", 42, (3500,))
    built = lanes.step_message(8, moved(head, 10, 77), wire.encode_tensor(later, raw), sent)
    assert bytes(message.fill(8, 10, 77, later, sent)) == built
    with contextlib.closing(_replay(built)) as sock:
        kind, seq, payload = lanes.read_message(sock)
    assert (kind, seq) == (LaneKind.DIRECT, 8)
    assert lanes.parse_direct(payload)[0] == sent
    a, b = socket.socketpair()
    with a, b:
        # a relay sends the step on with its compute added, the prefix made as Direct.on
        # makes it, in the call that fills the message in and writes it
        for came, own_ms in ((at_head.on(1.0), 3.5), (at_head, 0.0), (at_head, -2.0),
                             (lanes.Direct(b"8 bytes!", 43, (9,) * 64), 2**32)):  # fmt: skip
            onward = came.on(own_ms)
            message = NextMessage.of(head, frame, hidden, onward)
            built = lanes.step_message(9, moved(head, 11, 78), wire.encode_tensor(later, raw),
                                       onward)  # fmt: skip
            assert message.send_on(a, 9, 11, 78, later, came.prefix(), own_ms) == len(built)
            assert lanes.read_message(b) == (LaneKind.DIRECT, 9, built[lanes.HEAD_BYTES :])
        assert len(onward.compute_us) == lanes.MAX_DIRECT_HOPS  # the oldest dropped
        plain_message = NextMessage.of(head, frame, hidden)
        assert plain_message.send_on(a, 10, 12, 79, later, None, 1.0) > 0  # a STEP as it came
        assert lanes.read_message(b)[:2] == (LaneKind.STEP, 10)
        # nothing written where the message is not of the prefix's kind and size
        assert plain_message.send_on(a, 11, 13, 80, later, at_head.prefix(), 1.0) == 0
        assert message.send_on(a, 11, 13, 80, later, None, 1.0) == 0
        assert message.send_on(a, 11, 13, 80, later, at_tail.prefix(), 1.0) == 0
        assert message.send(a, 11, 13, 80, later, None) == 0
        assert message.send(a, 11, 13, 80, later, at_head.prefix()) == 0  # another size
        # the tail's answer on the head's answer lane: numbered and timed as its prefix says
        body = answer_bytes.encode(SampledToken(token_id=321, logprob=-0.25))
        lane_io.send_answer(a, at_tail.prefix(), 200, 19.25, body)
        kind, seq, payload = lanes.read_message(b)
        assert (kind, seq) == (LaneKind.ANSWER, 41)
        assert lanes.parse_answer(payload) == (200, "12.345,7.000,19.250", body)
        assert lane_io.answer_token(payload) == (200, 321)
        lane_io.send_answer(a, at_head.prefix(), 500, 0.0004999, b"{}")
        assert lanes.parse_answer(lanes.read_message(b)[2]) == (500, "0.000", b"{}")
        b.close()
        with pytest.raises(LaneError):
            lane_io.send_answer(a, at_head.prefix(), 200, 1.0, body)
        with pytest.raises(LaneError):
            message.send_on(a, 12, 14, 81, later, came.prefix(), 1.0)


def test_a_lane_read_matches_a_sessions_next_step_as_it_reads_it(lane_calls):
    """``lane_io.read``: a plain or DIRECT step that matches the session's last comes with
    its position, id and input (its body copied in), once per input made ready; any other
    message comes whole; a short, unknown or cut message is a lane error."""
    import torch

    from meshnet_common import wire
    from meshnet_node.dataplane import lane_io, step_bytes
    from meshnet_node.dataplane.lane_known import KnownStep, moved

    class Shard:
        is_head = False

    class Stage:
        shard = Shard()

    raw = wire.WireOptions(zstd_level=0, shuffle=False)
    route = ("http://127.0.0.1:9",)
    step = Step("s1", "k", 9, route=route, ids=(5,))
    head = step_bytes.encode(step, "req-1")
    first = torch.randn(1, 1, 64).to(torch.bfloat16)
    body = head + wire.encode_tensor(first, raw)
    known = KnownStep.of(body, len(head), step, wire.read_frame(body[len(head):]), Stage(),
                         route[0], None, head)  # fmt: skip
    later = torch.randn(1, 1, 64).to(torch.bfloat16)
    nxt = moved(head, 10, 77) + wire.encode_tensor(later, raw)
    direct = lanes.Direct(b"8 bytes!", 3, (1200,))
    plain_msg = lanes.message(LaneKind.STEP, 7, nxt)
    direct_msg = lanes.message(LaneKind.DIRECT, 8, direct.prefix(), nxt)
    with contextlib.closing(_replay(plain_msg + plain_msg)) as sock:
        assert lane_io.read(sock, 1.0, known) == (LaneKind.STEP, 7, nxt, 0, None)  # not ready
        known.prepare()
        kind, seq, payload, start, got = lane_io.read(sock, 1.0, known)
    assert (kind, seq, payload, start) == (LaneKind.STEP, 7, nxt, 0)
    assert got[:2] == (10, 77) and torch.equal(got[2], later)
    assert known.input is None  # handed over
    known.prepare()
    other = step_bytes.encode(Step("s2", "k", 10, route=route, ids=(77,)), "req-1")
    other_msg = lanes.message(LaneKind.STEP, 9, other + wire.encode_tensor(later, raw))
    with contextlib.closing(_replay(direct_msg + other_msg)) as sock:
        kind, seq, payload, start, got = lane_io.read(sock, 1.0, known)
        assert (kind, seq, start) == (LaneKind.DIRECT, 8, len(direct.prefix()))
        assert lanes.parse_direct(payload)[0] == direct and payload[start:] == nxt
        assert got[:2] == (10, 77) and torch.equal(got[2], later)
        known.prepare()
        assert lane_io.read(sock, 1.0, known)[4] is None  # another session's
    answer = lanes.answer(4, 200, "1.000", b"body")
    with contextlib.closing(_replay(answer)) as sock:
        assert lane_io.read_message(sock, 1.0) == (LaneKind.ANSWER, 4, answer[9:])
    for bad in (answer[:-1], b"\x00\x00\x00\x01\x09\x00\x00\x00\x01x",
                lanes.message(LaneKind.DIRECT, 1, b"short")):  # fmt: skip
        with contextlib.closing(_replay(bad)) as sock, pytest.raises(LaneError):
            lane_io.read(sock, 1.0, known)
    a, b = socket.socketpair()
    with contextlib.closing(a), contextlib.closing(b), pytest.raises(LaneError):
        a.sendall(answer[:5])
        lane_io.read_message(lanes.blocking(b, 0.05), 0.05)  # begun, not finished: times out


def _replay(data: bytes) -> socket.socket:
    a, b = socket.socketpair()
    a.sendall(data)
    a.close()
    return b


def test_a_node_something_fronts_offers_no_lane():
    """An --advertise-url on another port (a proxy, a port forward, the network bench's
    link relay): a lane dialed at that host would go around what is in front."""
    from types import SimpleNamespace

    from meshnet_node.dataplane.lane_ends import fronted

    def settings(url, port=8000):
        return SimpleNamespace(advertise_url=url, port=port)

    assert not fronted(settings(None))
    assert not fronted(settings("http://node.example:8000"))
    assert fronted(settings("http://127.0.0.1:9000"))
    assert fronted(settings("http://127.0.0.1:9000", port=0))


@pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="Unix sockets")
def test_a_lane_to_a_node_on_this_host_is_a_unix_socket_and_falls_back_to_tcp():
    """A node offers its lanes at an abstract Unix name made of its offer (port, secret)
    beside its TCP listener: a dialer on its host finds it there; an offer whose node has
    no such listener (another host, an older version) is dialed over TCP."""
    from meshnet_node.dataplane.lane_ends import _host_listener

    async def main():
        loop = asyncio.get_running_loop()
        tcp = socket.create_server(("127.0.0.1", 0))
        tcp.setblocking(False)
        port, secret = tcp.getsockname()[1], "s3cret"
        host = _host_listener(port, secret)
        if host is None:
            pytest.skip("no abstract Unix names here (not Linux)")

        async def hello(listener):
            peer, _ = await loop.sock_accept(listener)
            with peer:
                return await loop.sock_recv(peer, 64)

        want = lanes.message(LaneKind.HELLO, 0, secret.encode())
        with tcp, host:
            host.setblocking(False)
            dialed = await lanes.dial("127.0.0.1", port, secret, 2.0)
            with dialed:
                assert dialed.family == socket.AF_UNIX
                assert await hello(host) == want
            host.close()  # gone (an older node, or another host's): TCP
            dialed = await lanes.dial("127.0.0.1", port, secret, 2.0)
            with dialed:
                assert dialed.family == socket.AF_INET
                assert await hello(tcp) == want
        # the name is the offer's: another secret or port names another listener
        assert lanes.host_name(port, secret) != lanes.host_name(port, "other")
        assert lanes.host_name(port, secret) != lanes.host_name(port + 1, secret)

    asyncio.run(main())


def test_a_heads_answer_is_read_on_its_lane_or_its_answer_lane_whichever_comes(lane_calls):
    """``lane_io.read_answer``: the answer to the head's step on its lane or, numbered
    otherwise, on its answer lane (ADR-0060), an older step's skipped; the answer lane's
    failure says so (None: the lane goes on alone); the lane's own, a message that is not
    an answer and no answer in time are errors."""

    def answer(seq, body=b"ok", status=200):
        return lanes.message(LaneKind.ANSWER, seq, lanes._ANSWER.pack(status, 0), body)

    token = answer_bytes.encode(SampledToken(token_id=2**32 - 2, logprob=-1.5))
    lane, lane_far = socket.socketpair()
    answers, answers_far = socket.socketpair()
    with lane, lane_far, answers, answers_far:
        # on the lane alone, an older answer before it; its status and token read with it
        lane_far.sendall(answer(6, b"old") + answer(7, token))
        payload, direct, status, got = lane_io.read_answer(lane, None, 1.0, 7, -1)
        assert (lanes.parse_answer(payload).body, direct) == (token, False)
        assert (status, got) == (200, 2**32 - 2)
        # on the answer lane, numbered as that lane numbers it
        answers_far.sendall(answer(41, b"stale") + answer(42, b"direct"))
        payload, direct, status, got = lane_io.read_answer(lane, answers, 1.0, 8, 42)
        assert (lanes.parse_answer(payload).body, direct) == (b"direct", True)
        assert (status, got) == (200, -1)  # no token named
        # a failure or a refusal comes on the lane while the answer lane waits
        lane_far.sendall(answer(9, b"refused", lanes.LANE_REFUSED))
        payload, direct, status, got = lane_io.read_answer(lane, answers, 1.0, 9, 43)
        assert (lanes.parse_answer(payload).body, direct) == (b"refused", False)
        assert (status, got) == (lanes.LANE_REFUSED, -1)
        # a malformed answer (its compute times past its end): no status, the loop's
        # parse refuses it
        lane_far.sendall(lanes.message(LaneKind.ANSWER, 9, b"\x00\xc8\x00\x09ab"))
        assert lane_io.read_answer(lane, None, 1.0, 9, -1)[2:] == (-1, -1)
        for delay_s in (0.005, 0.03, 0.08):  # due: read however it comes (``read_next``)
            threading.Timer(delay_s, answers_far.sendall, (answer(43, b"due"),)).start()
            got = lane_io.read_answer(lane, answers, 1.0, 9, 43, 0.02, 0.02)
            assert (lanes.parse_answer(got[0]).body, got[1]) == (b"due", True)
            threading.Timer(delay_s, lane_far.sendall, (answer(9, b"own"),)).start()
            got = lane_io.read_answer(lane, None, 1.0, 9, -1, 0.02, 0.02)
            assert (lanes.parse_answer(got[0]).body, got[1]) == (b"own", False)
        with pytest.raises(LaneError, match="no answer within"):
            lane_io.read_answer(lane, answers, 0.2, 10, 44)
        answers_far.sendall(b"\xff" * 16)  # garbage: the answer lane is left, not the lane
        assert lane_io.read_answer(lane, answers, 1.0, 10, 44) is None
        lane_far.sendall(lanes.message(LaneKind.STEP, 10, b"x"))
        with pytest.raises(LaneError, match="STEP message from the hop"):
            lane_io.read_answer(lane, None, 1.0, 10, -1)
        answers_far.close()
        lane_far.sendall(answer(11))
        assert lane_io.read_answer(lane, answers, 1.0, 11, 45) is None  # looked at first
        assert lane_io.read_answer(lane, None, 1.0, 11, -1)[1] is False
        lane_far.close()
        with pytest.raises(LaneError):
            lane_io.read_answer(lane, None, 1.0, 12, -1)


def test_a_nodes_next_step_is_read_where_it_comes_before_anything_else(lane_calls):
    """``lane_io.read_next``: a node waits for the next message on the lane a step just
    came on and on its compute thread's selector at once; the message is read where it
    comes first, None where anything else the selector watches is ready first (another
    lane, a wake-up: the selector takes its turn), and always None without the kernel
    module (the selector then reads the lane)."""

    from meshnet_node.scheduling.sockets import SocketWatch

    watch = SocketWatch()
    lane, lane_far = socket.socketpair()
    other, other_far = socket.socketpair()
    try:
        watch.watch(lanes.blocking(lane), lambda _s: None)
        watch.watch(other, lambda _s: None)
        watch.wait()  # registered (the wake-up that handed them in drained)
        lane_far.sendall(lanes.message(LaneKind.STEP, 3, b"step"))
        got = lane_io.read_next(lane, watch.fileno(), 1.0)
        if lane_calls == "python":
            assert got is None  # the selector reads it
            assert lanes.read_message(lane) == (LaneKind.STEP, 3, b"step")
        else:
            assert got == (LaneKind.STEP, 3, b"step", 0, None)
        # due (``lane_wait``): asleep a while, then looking for it; read however it
        # comes: before the look begins, during it, or after it (asleep again)
        for delay_s in (0.005, 0.03, 0.08):
            threading.Timer(delay_s, lane_far.sendall,
                            (lanes.message(LaneKind.STEP, 4, b"due"),)).start()  # fmt: skip
            got = lane_io.read_next(lane, watch.fileno(), 1.0, None, 0.02, 0.02)
            if lane_calls == "python":
                assert got is None
                assert lanes.read_message(lane) == (LaneKind.STEP, 4, b"due")
            else:
                assert got == (LaneKind.STEP, 4, b"due", 0, None)
        other_far.sendall(b"x")  # another socket first: the selector's turn
        assert lane_io.read_next(lane, watch.fileno(), 1.0, None, 0.01, 0.01) is None
        other.recv(16)
        other_far.sendall(b"x")
        assert lane_io.read_next(lane, watch.fileno(), 1.0) is None
        other.recv(16)
        watch.wake()  # a pass handed in: the same
        assert lane_io.read_next(lane, watch.fileno(), 1.0) is None
        watch.wait()
        lane_far.close()  # the lane's end: its error, where it reads
        if lane_calls == "native":
            with pytest.raises(LaneError, match="closed"):
                lane_io.read_next(lane, watch.fileno(), 1.0)
    finally:
        watch.close()
        for s in (lane_far, other_far):
            s.close()

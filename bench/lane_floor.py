"""What a hop would cost if each stage's compute thread read the next step and wrote its
output itself (issue 51; bench/README.md, "A decode step traced piece by piece"): no event
loop, no hand-over between threads, the tail answering the head.

Three processes on 127.0.0.1 pass a greedy decode step around a ring, head -> middle ->
tail -> head, each on one thread that owns its sockets (blocking, TCP_NODELAY, a 4-byte
length before each message). A message is what nodes send today: the step as bytes
(``step_bytes``) and its tensor frame (``wire``, raw as on a link measured fast); the tail
answers with ``answer_bytes``. Each stage's pass is a stand-in that reads as many bf16
weights as a SmolLM2 stage of ``--layers`` layers (576 wide, 1536 inner; the tail also its
49152-row LM head, and the head its embedding row), one row through them, so the caches are
as empty after it as after a real pass. Not meshnet's data path: no sessions, no
failover, no auth; the floor such a path would stand on.

Per-hop overhead as ``meshnet_timing`` counts it: a step's time at the head less its three
passes, halved; the median over ``--tokens`` steps (the first few skipped), with ``--idle``
ms between steps (0: back to back; every stage idles anyway while the others compute).

``--lean``: the fewest pieces Python allows instead: a message is the hidden state's bytes
alone, read into a tensor made before (``recv_into``) and written from the pass's output
(``ctypes.string_at``), the tail's answer a 4-byte id; what a hop reading a session's next
step against its last (``lane_known``) comes near. ``--loop-us N`` (with ``--lean``): the
head also hands each answer to an event loop in another thread whose own work on it is N us
of Python (meshnet's head: its generation's per-token work), ``--post before`` the next
pass (as the answer comes) or ``after`` the next step is written.

    .venv/bin/python bench/lane_floor.py [--tokens 200] [--layers 10] [--threads 0]
        [--lean [--loop-us N] [--post before|after]]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_LEN = struct.Struct("!I")
HIDDEN, INNER, VOCAB = 576, 1536, 49152


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = conn.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("the ring closed")
        buf += chunk
    return bytes(buf)


def recv_message(conn: socket.socket) -> bytes:
    (size,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
    return _recv_exact(conn, size)


def send_message(conn: socket.socket, payload: bytes) -> None:
    conn.sendall(_LEN.pack(len(payload)) + payload)


class Pass:
    """A stand-in for a stage's decode pass: one row through ``layers`` x 4 products of
    SmolLM2's shapes (and the LM head's on the tail), in bf16."""

    def __init__(self, layers: int, tail: bool) -> None:
        import torch

        self.torch = torch
        g = torch.Generator().manual_seed(0)

        def weight(out: int, inp: int):
            return (torch.randn(out, inp, generator=g) / inp**0.5).to(torch.bfloat16)

        self.layers = [
            (weight(HIDDEN, HIDDEN), weight(INNER, HIDDEN), weight(INNER, HIDDEN),
             weight(HIDDEN, INNER))
            for _ in range(layers)
        ]  # fmt: skip
        self.lm_head = weight(VOCAB, HIDDEN) if tail else None

    def __call__(self, x):
        f = self.torch.nn.functional
        with self.torch.inference_mode():
            for attn, gate, up, down in self.layers:
                x = x + f.linear(x, attn)
                x = x + f.linear(f.silu(f.linear(x, gate)) * f.linear(x, up), down)
                x = x / x.float().norm().clamp(min=1).to(x.dtype)
            if self.lm_head is None:
                return x, None
            return x, int(f.linear(x, self.lm_head).argmax())


def serve(role: str, listen: int, next_port: int, layers: int, out: str) -> None:
    """A middle or tail stage: accept the step before, compute, send on (or answer)."""
    from meshnet_common import wire
    from meshnet_node.dataplane import answer_bytes, step_bytes
    from meshnet_node.engine.sampling import SampledToken

    stage = Pass(layers, tail=role == "tail")
    server = socket.create_server(("127.0.0.1", listen))
    print("ready", flush=True)
    before, _ = server.accept()
    after = socket.create_connection(("127.0.0.1", next_port))
    for conn in (before, after):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw = wire.WireOptions(zstd_level=0, shuffle=False)
    computes = []
    try:
        while True:
            body = recv_message(before)
            step, _rid, start = step_bytes.decode(body)
            hidden = wire.read_frame(body[start:]).tensor()
            t0 = time.perf_counter()
            hidden, token = stage(hidden)
            computes.append(time.perf_counter() - t0)
            if token is None:
                onward = dataclasses.replace(step, route=step.route[1:])
                send_message(after, step_bytes.encode(onward) + wire.encode_tensor(hidden, raw))
            else:
                send_message(after, answer_bytes.encode(SampledToken(token, 0.0)))
    except ConnectionError:
        pass
    Path(out).write_text(json.dumps(computes))


def head(ports: list[int], layers: int, tokens: int, idle_s: float) -> dict:
    """The head: embed, pass, send to the middle, wait for the tail's answer; each step's
    time and the head's passes (seconds)."""
    import torch

    from meshnet_common import wire
    from meshnet_node.dataplane import answer_bytes, step_bytes
    from meshnet_node.dataplane.steps import Step

    stage = Pass(layers, tail=False)
    embedding = (torch.randn(VOCAB, HIDDEN) / 8).to(torch.bfloat16)
    server = socket.create_server(("127.0.0.1", ports[0]))
    after = socket.create_connection(("127.0.0.1", ports[1]))
    before, _ = server.accept()
    for conn in (before, after):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw = wire.WireOptions(zstd_level=0, shuffle=False)
    route = (f"http://127.0.0.1:{ports[1]}", f"http://127.0.0.1:{ports[2]}")
    token, steps, computes = 1000, [], []
    try:
        for position in range(40, 40 + tokens):
            if idle_s:
                time.sleep(idle_s)
            started = time.perf_counter()
            ids = wire.WireTensor.of_ids([token]).tensor()
            t0 = time.perf_counter()
            hidden, _ = stage(embedding[ids[0]])
            computes.append(time.perf_counter() - t0)
            step = Step("lane-floor", "key", position, route=route[1:], sample=True,
                        ids=(token,))  # fmt: skip
            send_message(after, step_bytes.encode(step) + wire.encode_tensor(hidden, raw))
            token = answer_bytes.decode(recv_message(before)).token_id
            steps.append(time.perf_counter() - started)
    finally:  # the stages see the ring close and end
        after.close()
        before.close()
    return {"steps": steps, "head": computes}


def serve_lean(role: str, listen: int, next_port: int, layers: int, out: str) -> None:
    """``--lean``'s middle or tail: the hidden state's bytes in and out, nothing else."""
    import torch

    stage = Pass(layers, tail=role == "tail")
    server = socket.create_server(("127.0.0.1", listen))
    print("ready", flush=True)
    before, _ = server.accept()
    after = socket.create_connection(("127.0.0.1", next_port))
    for conn in (before, after):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    size = HIDDEN * 2
    hidden_in = torch.empty((1, 1, HIDDEN), dtype=torch.bfloat16)
    view = memoryview(hidden_in.view(torch.uint8).numpy().reshape(-1))
    computes = []
    try:
        while True:
            got = before.recv_into(view, size)
            if not got:
                break
            while got < size:
                more = before.recv_into(view[got:], size - got)
                if not more:
                    raise ConnectionError("the ring closed")
                got += more
            t0 = time.perf_counter()
            hidden, token = stage(hidden_in)
            computes.append(time.perf_counter() - t0)
            if token is None:
                after.sendall(ctypes.string_at(hidden.data_ptr(), size))
            else:
                after.sendall(_LEN.pack(token))
    except ConnectionError:
        pass
    Path(out).write_text(json.dumps(computes))


def head_lean(ports: list[int], layers: int, tokens: int, loop_us: float, post: str) -> dict:
    """``--lean``'s head; each answer handed to an event loop (``loop_us`` > 0) ``post``
    ``before`` the next pass or ``after`` the next step is written."""
    import asyncio
    import threading

    import torch

    stage = Pass(layers, tail=False)
    embedding = (torch.randn(VOCAB, HIDDEN) / 8).to(torch.bfloat16)
    server = socket.create_server(("127.0.0.1", ports[0]))
    after = socket.create_connection(("127.0.0.1", ports[1]))
    before, _ = server.accept()
    for conn in (before, after):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    taken: list[int] = []

    def take(token: int) -> None:  # the loop's own work on a token: Python for loop_us
        until = time.perf_counter() + loop_us / 1e6
        while time.perf_counter() < until:
            pass
        taken.append(token)

    size = HIDDEN * 2
    token, steps, computes, answered = 1000, [], [], None
    try:
        for _ in range(tokens):
            started = time.perf_counter()
            t0 = time.perf_counter()
            hidden, _ = stage(embedding[token].view(1, 1, HIDDEN))
            computes.append(time.perf_counter() - t0)
            after.sendall(ctypes.string_at(hidden.data_ptr(), size))
            if loop_us and answered is not None and post == "after":
                loop.call_soon_threadsafe(take, answered)
            (answered,) = _LEN.unpack(_recv_exact(before, _LEN.size))
            token = answered % VOCAB
            if loop_us and post == "before":
                loop.call_soon_threadsafe(take, answered)
            steps.append(time.perf_counter() - started)
    finally:
        after.close()
        before.close()
        loop.call_soon_threadsafe(loop.stop)
    return {"steps": steps, "head": computes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--layers", type=int, default=10, help="a stage's layers (SmolLM2's)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--idle", type=float, default=0.0, help="ms between steps")
    parser.add_argument("--lean", action="store_true", help="the hidden state's bytes "
                        "alone (see above)")  # fmt: skip
    parser.add_argument("--loop-us", type=float, default=0.0, help="with --lean: the head's "
                        "event loop works this long on each answer")  # fmt: skip
    parser.add_argument("--post", choices=("before", "after"), default="before",
                        help="with --loop-us: hand the answer to the loop before the next "
                        "pass or after the next step is written")  # fmt: skip
    parser.add_argument("--serve", nargs=4, metavar=("ROLE", "LISTEN", "NEXT", "OUT"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if (args.loop_us and not args.lean) or (args.lean and args.idle):
        parser.error("--loop-us goes with --lean, --idle without")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.serve:
        role, listen, next_port, out = args.serve
        (serve_lean if args.lean else serve)(role, int(listen), int(next_port), args.layers,
                                             out)  # fmt: skip
        return
    from swarm import free_port

    ports = [free_port() for _ in range(3)]
    out_dir = tempfile.mkdtemp(prefix="lane-floor-")
    procs = []
    common = ["--layers", str(args.layers), "--threads", str(args.threads),
              *(["--lean"] if args.lean else [])]  # fmt: skip
    for i, role in ((2, "tail"), (1, "middle")):  # the tail listens before the middle dials
        cmd = [sys.executable, __file__, *common, "--serve", role, str(ports[i]),
               str(ports[(i + 1) % 3]), os.path.join(out_dir, f"{role}.json")]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        procs.append(proc)
    try:
        if args.lean:
            got = head_lean(ports, args.layers, args.tokens, args.loop_us, args.post)
        else:
            got = head(ports, args.layers, args.tokens, args.idle / 1000)
    finally:
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    skip = min(10, args.tokens // 4)  # warm-up steps
    for role in ("middle", "tail"):
        got[role] = json.loads(Path(out_dir, f"{role}.json").read_text())
    # Each stage passed every step once, in order: a step's time outside its three passes.
    rows = list(zip(got["steps"], got["head"], got["middle"], got["tail"], strict=True))[skip:]
    outside = [step - sum(passes) for step, *passes in rows]
    med = {k: statistics.median(v[skip:]) * 1e3 for k, v in got.items()}
    per_hop = statistics.median(outside) * 1e3 / 2
    print(f"step {med['steps']:.2f} ms, passes {med['head']:.2f} + {med['middle']:.2f} + "
          f"{med['tail']:.2f} ms: per hop {per_hop:.3f} ms [{min(outside) * 500:.3f}-"
          f"{max(outside) * 500:.3f}] ({len(rows)} steps, idle {args.idle:g} ms, "
          f"{args.threads or 'default'} threads{', lean' if args.lean else ''}"
          f"{f', loop {args.loop_us:g} us {args.post}' if args.loop_us else ''})")  # fmt: skip


if __name__ == "__main__":
    main()

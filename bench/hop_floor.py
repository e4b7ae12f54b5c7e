"""The floor under a hop's time on this machine: one message between two processes over
loopback TCP, and one hand-off between two threads, each after the receiver idled the way a
pipeline stage idles between its passes (issue 51; bench/README.md, "The floor under a hop").

- transit: a 1200-byte message to another process and back, halved; the other process reads
  with a blocking socket, or with an asyncio server on uvloop (as a node's loop reads);
- hand-off: an event loop wakes a thread waiting on a condition variable (as the compute
  scheduler hands a pass to its compute thread), and the thread answers through
  ``call_soon_threadsafe`` (as a pass's results come back).

Each is timed back to back and after ``--idle`` ms of sleep (default 20: a stage's idle time
per token is tens of milliseconds). Medians of ``--count`` tries.

    .venv/bin/python bench/hop_floor.py [--idle 20] [--count 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import threading
import time

import uvloop

MESSAGE = b"x" * 1200  # about a decode step of SmolLM2 (576 bf16 values and its step)


def _echo_blocking(ready_w: int) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    os.write(ready_w, str(server.getsockname()[1]).encode())
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(65536):
        conn.sendall(data)


def _echo_uvloop(ready_w: int) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)

    async def main() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        os.write(ready_w, str(server.sockets[0].getsockname()[1]).encode())
        await asyncio.Event().wait()

    uvloop.run(main())


def transit_us(echo, idle_s: float, count: int) -> float:
    """Median one-way time of MESSAGE to a forked ``echo`` process and back, halved."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            echo(ready_w)
        finally:
            os._exit(0)
    try:
        port = int(os.read(ready_r, 16))
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(count):
                if idle_s:
                    time.sleep(idle_s)
                started = time.perf_counter()
                conn.sendall(MESSAGE)
                got = 0
                while got < len(MESSAGE):
                    got += len(conn.recv(65536))
                times.append((time.perf_counter() - started) / 2 * 1e6)
        return statistics.median(times)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


async def _handoffs(idle_s: float, count: int) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    cond, box = threading.Condition(), []

    def worker() -> None:
        while True:
            with cond:
                while not box:
                    cond.wait()
                future = box.pop()
            loop.call_soon_threadsafe(future.set_result, time.perf_counter())

    threading.Thread(target=worker, daemon=True).start()
    there, back = [], []
    for _ in range(count):
        await asyncio.sleep(idle_s)
        future = loop.create_future()
        started = time.perf_counter()
        with cond:
            box.append(future)
            cond.notify()
        woke = await future
        there.append((woke - started) * 1e6)
        back.append((time.perf_counter() - woke) * 1e6)
    return statistics.median(there), statistics.median(back)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=float, default=20.0, help="ms idle before each try")
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args()
    print(f"{'':40} {'back to back':>14} {'after ' + str(args.idle) + ' ms idle':>18}")
    for name, echo in (("transit, blocking socket", _echo_blocking),
                       ("transit, asyncio on uvloop", _echo_uvloop)):  # fmt: skip
        hot, cold = (transit_us(echo, idle / 1000, args.count) for idle in (0.0, args.idle))
        print(f"{name:40} {hot:11.0f} us {cold:15.0f} us")
    hot = uvloop.run(_handoffs(0.0, args.count))
    cold = uvloop.run(_handoffs(args.idle / 1000, args.count))
    for i, name in enumerate(("hand-off, loop -> compute thread", "hand-off, thread -> loop")):
        print(f"{name:40} {hot[i]:11.0f} us {cold[i]:15.0f} us")


if __name__ == "__main__":
    main()

"""Emulated network links on loopback: TCP relays that delay and rate-limit what crosses them.

This kernel has no ``netem``; a relay in front of a node plays its link instead. Each relay
listens on a port of 127.0.0.1 and forwards every connection to its target. Bytes crossing
it, in either direction, arrive ``delay_ms`` later, and each direction is a link of
``mbit`` megabits per second shared by all the relay's connections (bytes queue behind the
ones sent before them). A request and its answer through a relay thus pay two one-way
delays, as a real link does.

One process holds every relay and takes new settings on a control port, one JSON line
each (``{"delay_ms": 25, "mbit": 100}``; answered ``ok``), so a benchmark changes the
links of a running swarm between runs:

    .venv/bin/python bench/link_relay.py --control PORT LISTEN=TARGET_PORT [...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import time
from collections import deque
from dataclasses import dataclass, field

READ_BYTES = 1 << 16


@dataclass
class Link:
    """One direction of a relay: a delay and a bandwidth, shared by its connections."""

    delay_s: float = 0.0
    bytes_per_s: float | None = None  # None: no limit
    free_at: float = 0.0  # when the link has sent everything queued on it

    def arrival(self, size: int, now: float) -> float:
        """When ``size`` bytes handed to the link now reach the other end."""
        departure = now
        if self.bytes_per_s:
            departure = max(now, self.free_at) + size / self.bytes_per_s
            self.free_at = departure
        return departure + self.delay_s


@dataclass
class Relay:
    listen: int
    target: int
    up: Link = field(default_factory=Link)  # toward the target
    down: Link = field(default_factory=Link)  # back from it

    def set(self, delay_ms: float, mbit: float | None) -> None:
        for link in (self.up, self.down):
            link.delay_s = delay_ms / 1000.0
            link.bytes_per_s = mbit * 1e6 / 8 if mbit else None

    async def serve(self) -> asyncio.Server:
        return await asyncio.start_server(self._connection, "127.0.0.1", self.listen)

    async def _connection(self, client_r, client_w) -> None:
        try:
            target_r, target_w = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            client_w.close()
            return
        for sock in (client_w, target_w):
            raw = sock.get_extra_info("socket")
            if raw is not None:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(
            _pump(client_r, target_w, self.up), _pump(target_r, client_w, self.down),
            return_exceptions=True,
        )  # fmt: skip


async def _pump(reader, writer, link: Link) -> None:
    """Copy ``reader`` to ``writer``, each piece delivered when the link says it arrives."""
    queue: deque[tuple[float, bytes]] = deque()
    ready = asyncio.Event()
    done = False

    async def deliver() -> None:
        while True:
            while not queue:
                if done:
                    writer.close()
                    return
                ready.clear()
                await ready.wait()
            at, data = queue.popleft()
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.ensure_future(deliver())
    try:
        while data := await reader.read(READ_BYTES):
            queue.append((link.arrival(len(data), time.monotonic()), data))
            ready.set()
    finally:
        done = True
        ready.set()
        with contextlib.suppress(ConnectionError, OSError):
            await sender


async def _control(relays: list[Relay], reader, writer) -> None:
    while line := await reader.readline():
        try:
            spec = json.loads(line)
            for relay in relays:
                relay.set(float(spec.get("delay_ms", 0.0)), spec.get("mbit"))
            writer.write(b"ok\n")
        except (ValueError, TypeError) as exc:
            writer.write(f"error {exc}\n".encode())
        await writer.drain()
    writer.close()


async def main_async(control: int, pairs: list[tuple[int, int]], delay_ms: float, mbit) -> None:
    relays = [Relay(listen, target) for listen, target in pairs]
    for relay in relays:
        relay.set(delay_ms, mbit)
    servers = [await relay.serve() for relay in relays]
    servers.append(
        await asyncio.start_server(lambda r, w: _control(relays, r, w), "127.0.0.1", control)
    )
    print("relays ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def set_links(control: int, delay_ms: float, mbit: float | None = None) -> None:
    """Change every relay of the process on ``control`` (from a benchmark)."""
    with socket.create_connection(("127.0.0.1", control), timeout=5) as sock:
        sock.sendall(json.dumps({"delay_ms": delay_ms, "mbit": mbit}).encode() + b"\n")
        answer = sock.makefile().readline().strip()
    if answer != "ok":
        raise RuntimeError(f"relay control answered {answer!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", type=int, required=True, help="control port")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay")
    parser.add_argument("--mbit", type=float, help="bandwidth per direction (default: none)")
    parser.add_argument("pairs", nargs="+", help="LISTEN=TARGET ports on 127.0.0.1")
    args = parser.parse_args()
    pairs = [tuple(int(p) for p in pair.split("=")) for pair in args.pairs]
    asyncio.run(main_async(args.control, pairs, args.delay_ms, args.mbit))


if __name__ == "__main__":
    main()

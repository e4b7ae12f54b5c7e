"""Run a FastAPI app under uvicorn and print one ready line once it is listening."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from meshnet_common.config import defaults
from meshnet_common.web import head_deadline

# Bounds on what one client can hold (docs/adr/0032): a request head of at most 16 KiB
# (h11; httptools' llhttp caps it at 80 KiB itself), an idle keep-alive connection closed
# after 5 s, and past 1024 open connections or running requests new requests get 503
# rather than memory. A request head must arrive within 10 s (``head_deadline``).
logger = logging.getLogger(__name__)

LIMITS = {"h11_max_incomplete_event_size": 16 * 1024, "timeout_keep_alive": 5,
          "limit_concurrency": 1024}  # fmt: skip


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound at once (port 0: the kernel picks a free one), so that the
    port a process reports is the port it holds; it listens once ``run`` serves. Raises
    OSError with a clear message when the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


def bound_port(sock: socket.socket) -> int:
    return sock.getsockname()[1]


def announce_port(prog: str, sock: socket.socket) -> int:
    """Print the bound port as one early line (``PROG listening on port N``): a supervisor
    or test that started the process with ``--port 0`` reads it back. Returns the port."""
    port = bound_port(sock)
    print(f"{prog} listening on port {port}", flush=True)
    return port


async def _serve(
    app: FastAPI,
    sock: socket.socket,
    ready_line: str | None,
    log_level: str,
    on_started,
    ws_max_size: int | None,
    tls: dict,
) -> None:
    # log_config=None: uvicorn's own lines go through meshnet's one-line formatter.
    # No server/date headers: two fewer headers to build, check and parse on every
    # answer, which every hop of every decode step pays (docs/adr/0011).
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
        log_config=None, server_header=False, date_header=False,
        # Hop streams (a node's /v1/stream) are uvicorn's own WebSockets, websockets' sans-I/O
        # protocol; a message over ws_max_size closes the stream (1009).
        ws="websockets-sansio" if ws_max_size else "auto", ws_max_size=ws_max_size or 1 << 24,
        ws_per_message_deflate=False, http=head_deadline.protocol_class(), **tls, **LIMITS,
    )  # fmt: skip
    cap = getattr(app.state, "connections_per_address", defaults.CONNECTIONS_PER_ADDRESS)
    setattr(config, head_deadline.PER_ADDRESS, cap)  # read by its protocol classes
    server = uvicorn.Server(config)
    exit_code = 0

    def request_exit(code: int) -> None:  # e.g. the tracker refused this node
        nonlocal exit_code
        exit_code = code
        server.should_exit = True

    app.state.request_exit = request_exit
    exit_now = server.handle_exit

    def handle_exit(sig, frame) -> None:
        """The first SIGTERM drains a node that can (``app.state.drain``, docs/adr/0024);
        a second one, or SIGINT, exits as uvicorn does."""
        drain = getattr(app.state, "drain", None)
        if (
            sig == signal.SIGTERM
            and drain is not None
            and not getattr(app.state, "draining", False)
        ):
            app.state.draining = True
            loop.call_soon_threadsafe(drain)
            return
        exit_now(sig, frame)

    loop = asyncio.get_running_loop()
    server.handle_exit = handle_exit
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        if ready_line:
            print(ready_line, flush=True)
        if on_started is not None:
            on_started()
    await task
    if not server.started:
        sys.exit(1)
    if exit_code:
        sys.exit(exit_code)


def _loop_factory():
    """uvloop where it is installed: its C transports cut the cost of every hop's request."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


FD_LIMIT = 1 << 16  # open files a server asks for: 1024 connections and what it holds


def raise_fd_limit(want: int = FD_LIMIT) -> int:
    """Raise this process's soft limit on open files toward ``want`` (never above the hard
    limit, never down); returns the soft limit now. A common soft limit of 1024 would run
    out below uvicorn's 1024 connections (docs/adr/0032)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # e.g. macOS caps it below the hard limit
            logger.warning("cannot raise the open-file limit to %d: %s", target, exc)
    return soft


def freeze_heap() -> int:
    """Keep what the process holds now out of the garbage collector's full collections
    (``gc.freeze``, after one last collection); returns how many objects that is.

    A node holds ~370,000 objects once torch, transformers, FastAPI and its shard are
    loaded; a full collection walked them all, 190-220 ms on a 2-core AMD EPYC (Zen 4),
    and ran inside a decode step about every 60 tokens (traced: two stalls of ~215 ms in a
    128-token generation over three local SmolLM2 processes, 0.43 s of its 3.5-4.5 s).
    What a service builds before it serves lives as long as it does; later full
    collections walk only what came after (docs/adr/0036)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def refreeze_heap() -> int:
    """``freeze_heap`` after much of what was frozen was let go (a node's previous shard):
    one full collection reaches it, then what is left is frozen again."""
    gc.unfreeze()
    return freeze_heap()


def run(
    app: FastAPI,
    sock: socket.socket,
    ready_line: str | None,
    log_level: str = "warning",
    on_started: Callable[[], None] | None = None,
    ws_max_size: int | None = None,
    tls: dict | None = None,
) -> None:
    """Serve on ``sock`` (from ``bind``) until stopped; once the socket listens, print ``ready_line`` (if any) and call
    ``on_started``. ``ws_max_size``: the largest WebSocket message (a node's hop streams);
    ``tls``: uvicorn's certificate options (``meshnet_common.web.tls.server_options``)."""
    raise_fd_limit()  # room for limit_concurrency's connections and the files it holds
    freeze_heap()  # everything built before serving: out of full collections' reach
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_serve(app, sock, ready_line, log_level, on_started, ws_max_size, tls or {}))

"""Sockets the compute thread reads between passes (decode lanes, docs/adr/0058): while it
has nothing to run, it waits on them and on a wake-up socket instead of its condition
variable, and calls each one's reader when it is readable. The reader runs on the compute
thread, with the node's torch threads: it may run a pass itself."""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

Reader = Callable[[socket.socket], None]
Added = Callable[[socket.socket], None]


class SocketWatch:
    """The compute thread's selector. Sockets are handed in from any thread (``watch``) and
    registered by the compute thread itself, which alone reads them; ``wake`` (any thread)
    ends its wait, as the condition variable's notify does."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._new: list[tuple[socket.socket, Reader, Added | None]] = []
        self.count = 0  # sockets watched (the compute thread's count)

    def watch(self, sock: socket.socket, reader: Reader, added: Added | None = None) -> None:
        """Read ``sock`` with ``reader`` on the compute thread from its next wait on;
        ``added`` is called there first, once it is watched."""
        with self._lock:
            self._new.append((sock, reader, added))
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # a byte is waiting already
            self._wake_w.send(b"\0")

    def forget(self, sock: socket.socket) -> None:
        """On the compute thread: stop reading ``sock`` and close it."""
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(sock)
            self.count -= 1
        with contextlib.suppress(OSError):
            sock.close()

    def fileno(self) -> int:
        """The selector's descriptor: readable while a socket it watches is (a reader may
        wait on it beside its own socket, and give the selector its turn once it is)."""
        return self._selector.fileno()  # type: ignore[attr-defined]

    def ready(self) -> bool:
        """On the compute thread, between the steps of a pass that runs ahead: whether a
        socket it watches (not the wake-up one) has something to read."""
        if not self.count:
            return False
        return any(key.data is not None for key, _ in self._selector.select(0))

    def wait(self) -> None:
        """On the compute thread: wait until a socket is readable or ``wake``, and read
        each readable one."""
        with self._lock:
            new, self._new = self._new, []
        for sock, reader, added in new:
            try:
                self._selector.register(sock, selectors.EVENT_READ, reader)
                self.count += 1
            except (ValueError, OSError):  # closed meanwhile
                with contextlib.suppress(OSError):
                    sock.close()
                continue
            if added is not None:
                added(sock)
        for key, _ in self._selector.select():
            if key.data is None:
                with contextlib.suppress(BlockingIOError, OSError):
                    while self._wake_r.recv(64):
                        pass
            else:
                try:
                    key.data(key.fileobj)
                except Exception:  # never the compute thread's end: that socket's
                    logger.exception("a socket's reader failed; closing the socket")
                    self.forget(key.fileobj)  # type: ignore[arg-type]

    def close(self) -> None:
        for key in list(self._selector.get_map().values()):
            with contextlib.suppress(OSError):
                key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        self._wake_w.close()

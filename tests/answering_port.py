"""A port on 127.0.0.1 that answers every HTTP request with fixed bytes and keeps the
request heads it was sent: what a registration call-back may dial instead of a node."""

from __future__ import annotations

import contextlib
import socketserver
import threading


class AnsweringPort(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, reply: bytes) -> None:
        self.reply, self.requests = reply, []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> AnsweringPort:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


def http_reply(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = self.rfile.readline()
            if not line:
                return
            head += line
        self.server.requests.append(head.decode("latin-1").lower())
        with contextlib.suppress(OSError):  # the caller stopped reading: as it should
            self.wfile.write(self.server.reply)

"""Test harness: start real tracker and node processes on free loopback ports, clean up."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 180.0
# A process started with --port 0 binds a port the kernel picks and prints it at once
# (meshnet_common.web.serve.announce_port): no window where another process takes it.
PORT_LINE = re.compile(rb"^meshnet-(?:node|tracker) listening on port (\d+)$", re.M)


@dataclass
class Proc:
    """A meshnet process started by a test."""

    name: str
    args: list[str]
    log_path: Path
    bound: int | None = None  # the port, once known: given (a restart) or read from the log
    popen: subprocess.Popen | None = None
    env: dict = field(default_factory=dict)
    scheme: str = "http"  # https: started with --tls-cert
    verify: object = True  # what health checks verify an https process with (a CA file)

    @property
    def port(self) -> int:
        """The port the process holds: waits for its ``listening on port`` line."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while self.bound is None:
            found = PORT_LINE.search(self.log_path.read_bytes())
            if found:
                self.bound = int(found.group(1))
            elif self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.popen.returncode}):\n{self.log_tail()}"
                )
            elif time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} reported no port:\n{self.log_tail()}")
            else:
                time.sleep(0.02)
        return self.bound

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        """Start (or start again: a restart keeps the port it held, as a real one would)."""
        if self.bound is not None and "--port" in self.args:
            self.args[self.args.index("--port") + 1] = str(self.bound)
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        # No hub here: make huggingface_hub fail at once instead of trying the network.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **self.env}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", *self.args], stdout=log, stderr=subprocess.STDOUT, env=env
        )
        return self

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.popen.returncode}):\n{self.log_tail()}"
                )
            try:
                if (
                    httpx.get(f"{self.url}/health", timeout=1.0, verify=self.verify).status_code
                    == 200
                ):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy after {timeout}s:\n{self.log_tail()}")

    def log(self) -> str:
        """All the process wrote (tests look for a line anywhere in it)."""
        return self.log_path.read_text(errors="replace")

    def log_tail(self) -> str:
        return self.log()[-4000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen and self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


class Swarm:
    """Starts tracker and node processes and always cleans them up."""

    def __init__(self, models_dir: Path, log_dir: Path, heartbeat_s: float = 0.5) -> None:
        self.models_dir = models_dir
        self.log_dir = log_dir
        self.heartbeat_s = heartbeat_s
        self.procs: list[Proc] = []

    def tracker(self, *extra: str, port: int | None = None) -> Proc:
        """A tracker on a port the kernel picks, or on ``port`` (a restart keeps its address),
        with a --signing-key file (a restart keeps its key too: nodes keep the first key they
        saw, docs/adr/0032)."""
        key = (
            () if "--signing-key" in extra else ("--signing-key", str(self.log_dir / "tracker.key"))
        )
        args = ["meshnet_tracker.cli", "--models-dir", str(self.models_dir), "--port",
                str(port or 0), "--heartbeat-interval", str(self.heartbeat_s), "--threads", "1",
                *key, *extra]  # fmt: skip
        return self._add(Proc("tracker", args, self._log("tracker"), bound=port))

    def node(self, tracker: Proc, model_id: str, start: int, end: int, *extra: str) -> Proc:
        args = ["meshnet_node.cli", "--tracker", tracker.url, "--models-dir",
                str(self.models_dir), "--model-id", model_id, "--shard-start", str(start),
                "--shard-end", str(end), "--port", "0", "--threads", "1",
                "--heartbeat-interval", str(self.heartbeat_s), *extra]  # fmt: skip
        name = f"node-{start}-{end}"
        return self._add(Proc(name, args, self._log(name)))

    def join(self, tracker: Proc, memory_gb: str, node_id: str, *extra: str) -> Proc:
        """A node with no model: the tracker assigns its shard."""
        args = ["meshnet_node.cli", "--tracker", tracker.url, "--models-dir",
                str(self.models_dir), "--memory-gb", memory_gb, "--node-id", node_id,
                "--port", "0", "--threads", "1",
                "--heartbeat-interval", str(self.heartbeat_s), *extra]  # fmt: skip
        return self._add(Proc(node_id, args, self._log(node_id)))

    def bare_node(self, tracker: Proc, node_id: str, *extra: str) -> Proc:
        """A node with no models dir: whatever it serves, it must fetch."""
        args = ["meshnet_node.cli", "--tracker", tracker.url, "--node-id", node_id,
                "--port", "0", "--threads", "1",
                "--heartbeat-interval", str(self.heartbeat_s), *extra]  # fmt: skip
        return self._add(Proc(node_id, args, self._log(node_id)))

    def _log(self, name: str) -> Path:
        """A log file of its own per process, even for a restart under the same name."""
        path = self.log_dir / f"{name}.log"
        count = 1
        while path.exists():
            count += 1
            path = self.log_dir / f"{name}-{count}.log"
        return path

    def _add(self, proc: Proc) -> Proc:
        self.procs.append(proc.start())
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()


_HELD: list[socket.socket] = []


def closed_port() -> int:
    """A loopback port that refuses connections for the rest of the run: bound, never
    listening, and held, so no other process can take it meanwhile."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    _HELD.append(sock)
    return sock.getsockname()[1]


def wait_for(predicate, timeout: float, interval: float = 0.2):
    """Poll ``predicate`` until it returns a truthy value; returns it or fails the test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"condition not met within {timeout}s")


def covered(tracker: Proc, model_id: str, verify: object = None) -> bool:
    verify = tracker.verify if verify is None else verify
    models = httpx.get(f"{tracker.url}/v1/coverage", timeout=5, verify=verify).json()["models"]
    return any(m["id"] == model_id and m["covered"] for m in models)

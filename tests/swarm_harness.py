"""Test harness: start real tracker and node processes on free loopback ports, clean up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from meshnet_common.web.serve import free_port

STARTUP_TIMEOUT_S = 180.0


@dataclass
class Proc:
    """A meshnet process started by a test."""

    name: str
    args: list[str]
    port: int
    log_path: Path
    popen: subprocess.Popen | None = None
    env: dict = field(default_factory=dict)
    scheme: str = "http"  # https: started with --tls-cert
    verify: object = True  # what health checks verify an https process with (a CA file)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self) -> Proc:
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
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}):\n{self.log()}")
            try:
                if (
                    httpx.get(f"{self.url}/health", timeout=1.0, verify=self.verify).status_code
                    == 200
                ):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

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
        port = port or free_port()
        args = ["meshnet_tracker.cli", "--models-dir", str(self.models_dir), "--port", str(port),
                "--heartbeat-interval", str(self.heartbeat_s), "--threads", "1", *extra]  # fmt: skip
        return self._add(Proc(f"tracker-{port}", args, port, self.log_dir / f"tracker-{port}.log"))

    def node(self, tracker: Proc, model_id: str, start: int, end: int, *extra: str) -> Proc:
        port = free_port()
        args = ["meshnet_node.cli", "--tracker", tracker.url, "--models-dir",
                str(self.models_dir), "--model-id", model_id, "--shard-start", str(start),
                "--shard-end", str(end), "--port", str(port), "--threads", "1",
                "--heartbeat-interval", str(self.heartbeat_s), *extra]  # fmt: skip
        return self._add(Proc(f"node-{port}", args, port, self.log_dir / f"node-{port}.log"))

    def join(self, tracker: Proc, memory_gb: str, node_id: str, *extra: str) -> Proc:
        """A node with no model: the tracker assigns its shard."""
        port = free_port()
        args = ["meshnet_node.cli", "--tracker", tracker.url, "--models-dir",
                str(self.models_dir), "--memory-gb", memory_gb, "--node-id", node_id,
                "--port", str(port), "--threads", "1",
                "--heartbeat-interval", str(self.heartbeat_s), *extra]  # fmt: skip
        return self._add(Proc(node_id, args, port, self.log_dir / f"{node_id}.log"))

    def bare_node(self, tracker: Proc, node_id: str, *extra: str) -> Proc:
        """A node with no models dir: whatever it serves, it must fetch."""
        port = free_port()
        args = ["meshnet_node.cli", "--tracker", tracker.url, "--node-id", node_id,
                "--port", str(port), "--threads", "1",
                "--heartbeat-interval", str(self.heartbeat_s), *extra]  # fmt: skip
        return self._add(Proc(node_id, args, port, self.log_dir / f"{node_id}.log"))

    def _add(self, proc: Proc) -> Proc:
        self.procs.append(proc.start())
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()


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

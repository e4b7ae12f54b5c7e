"""Across machines, emulated with a network namespace this test creates (a veth pair on a
private /30 that exists only between this host and the namespace): the README's by-hand
commands, with nodes on 0.0.0.0 and no --advertise-url, give a working swarm; a node left on
127.0.0.1 is refused in one line naming --advertise-url. Needs root and iproute2 (CI has
both); skipped otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import httpx
import pytest
from swarm_harness import Proc, covered, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LLAMA = "meshnet-tiny/llama"
F32 = ("--quantization", "float32")


@dataclass
class Machine:
    """Where a process runs: this host (``netns`` None) or the namespace, and its address."""

    address: str
    netns: str | None = None


@dataclass
class HostProc(Proc):
    """A process on one of the emulated machines, reached at ``host``."""

    host: str = "127.0.0.1"
    netns: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> HostProc:
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", *self.args],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        return self


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def machines():
    """Machine A = this host at 10.213.X.1, machine B = a fresh namespace at 10.213.X.2."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create a network namespace")
    tag = f"{os.getpid() % 100000}"
    ns, host_if, ns_if = f"mn-{tag}", f"mnh{tag}", f"mnn{tag}"
    subnet = 1 + os.getpid() % 250
    host_ip, ns_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create a network namespace here: {exc}")
    try:
        yield Machine(host_ip), Machine(ns_ip, ns)
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_by_hand_commands_across_two_machines(machines, models_dir, tiny_snapshot, tmp_path):
    tiny_snapshot("llama")
    a, b = machines
    procs: list[HostProc] = []

    def start(name: str, machine: Machine, host: str, args: list[str]) -> HostProc:
        proc = HostProc(name, [*args, "--port", "0"], tmp_path / f"{name}.log",
                        host=machine.address, netns=machine.netns)  # fmt: skip
        if "--host" not in args:
            proc.args += ["--host", host]
        procs.append(proc.start())
        return proc

    try:
        # Machine A: the tracker, listening on its LAN address (here the veth's).
        tracker = start("tracker", a, a.address, [
            "meshnet_tracker.cli", "--models-dir", str(models_dir), "--heartbeat-interval",
            "0.5", "--threads", "1", "--insecure"])  # fmt: skip
        tracker.wait_healthy()
        # A LAN of its own: no --swarm-token, so --insecure (docs/adr/0032).
        node = ["meshnet_node.cli", "--tracker", tracker.url, "--models-dir", str(models_dir),
                "--model-id", LLAMA, "--threads", "1", "--heartbeat-interval", "0.5", *F32,
                "--insecure"]  # fmt: skip
        # Machine B: the head on 0.0.0.0, no --advertise-url: the tracker sees it at b.address.
        head = start("head", b, "0.0.0.0", [*node, "--shard-start", "0", "--shard-end", "3"])
        # Machine A: the tail on A's address.
        tail = start("tail", a, a.address, [*node, "--shard-start", "3", "--shard-end", "6"])
        head.wait_healthy()
        tail.wait_healthy()
        wait_for(lambda: covered(tracker, LLAMA), timeout=60)
        model = next(
            m for m in httpx.get(f"{tracker.url}/v1/coverage").json()["models"]
            if m["id"] == LLAMA
        )  # fmt: skip
        urls = {(n["shard_start"], n["state"]): n["url"] for n in model["nodes"]}
        assert urls == {(0, "serving"): head.url, (3, "serving"): tail.url}
        body = {"model": LLAMA, "prompt": "hello world", "max_tokens": 4, "temperature": 0}
        resp = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text  # tracker -> B's head -> A's tail

        # Machine B, left on the default --host 127.0.0.1: refused, one line, exit 1.
        stray = start("stray", b, "127.0.0.1", [*node, "--shard-start", "3", "--shard-end", "6"])
        assert stray.popen.wait(timeout=120) == 1
        errors = [line for line in stray.log().splitlines() if line.startswith("meshnet-node:")]
        assert len(errors) == 1 and "--advertise-url" in errors[0], stray.log()
        assert "the tracker cannot reach node" in errors[0]
    finally:
        for proc in reversed(procs):
            proc.kill()

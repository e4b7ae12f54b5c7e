"""A meshnet swarm as real processes on 127.0.0.1, and the HTTP calls the benchmarks time.

Used by ``perf.py`` and ``pipeline.py``. The first process is a tracker node
(``meshnet_tracker.cli`` serving the first layer range); the others are
``meshnet_node.cli`` processes, each on a free port. ``running_swarm`` always stops them
(SIGTERM, then SIGKILL), also on an exception or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from benchlib import REPO_ROOT, RESULTS_DIR

START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 600.0
LOG_DIR = RESULTS_DIR / "logs"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Swarm:
    """A tracker node plus nodes, started as processes; ``stop`` always cleans up."""

    models_dir: Path
    model_id: str
    ranges: list[tuple[int, int]]
    threads: int | None
    log_dir: Path = LOG_DIR
    procs: list[subprocess.Popen] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    ports: list[int] | None = None  # each process's port (default: free ones)
    extra: dict[int, list[str]] = field(default_factory=dict)  # more flags for process i
    # How a process is started: (module, args) -> (module, args) (step_trace.py: its probes)
    launch: Callable[[str, list[str]], tuple[str, list[str]]] | None = None

    @property
    def tracker_url(self) -> str:
        return self.urls[0]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _spawn(self, module: str, args: list[str], port: int, name: str) -> None:
        if self.launch is not None:
            module, args = self.launch(module, args)
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", module, *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        proc.log = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        self.urls.append(f"http://127.0.0.1:{port}")

    def start(self) -> Swarm:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        common = ["--models-dir", str(self.models_dir), "--model-id", self.model_id]
        if self.threads:  # None: the nodes' own default (issue 39: they share the cores)
            common += ["--threads", str(self.threads)]
        tag = self.model_id.rsplit("/", 1)[-1]
        for i, (start, end) in enumerate(self.ranges):
            port = self.ports[i] if self.ports else free_port()
            shard = ["--shard-start", str(start), "--shard-end", str(end), "--port", str(port),
                     *self.extra.get(i, ())]  # fmt: skip
            if i == 0:
                name = f"{tag}-tracker-{start}-{end}"
                self._spawn("meshnet_tracker.cli", common + shard, port, name)
            else:
                args = ["--tracker", self.tracker_url, *common, *shard]
                self._spawn("meshnet_node.cli", args, port, f"{tag}-node-{start}-{end}")
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Wait for every /health, then for full coverage; returns seconds waited."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        for proc, url in zip(self.procs, self.urls, strict=True):
            _poll(lambda p=proc, u=url: _healthy(p, u), deadline, f"{url}/health")
        _poll(lambda: _covered(self.tracker_url, self.model_id), deadline, "coverage")
        return time.perf_counter() - t0

    def exited(self) -> list[str]:
        """Processes that are no longer running, with their exit status."""
        return [f"{p.args[2]} (pid {p.pid}) exited with {p.returncode}"
                for p in self.procs if p.poll() is not None]  # fmt: skip

    def revive(self) -> None:
        """Start the whole swarm again if one of its processes died (e.g. after a crash)."""
        dead = self.exited()
        if not dead:
            return
        print(f"  swarm lost a process ({'; '.join(dead)}); restarting it", flush=True)
        self.stop()
        self.procs, self.urls = [], []
        self.start()
        print(f"  swarm ready again in {self.wait_ready():.1f} s", flush=True)

    def rss_mib(self) -> list[float]:
        import psutil

        return [psutil.Process(p.pid).memory_info().rss / 2**20 for p in self.procs]

    def stop(self) -> None:
        for line in self.exited():  # a process that died on its own: say so (logs: LOG_DIR)
            print(f"  WARNING: {line} before the benchmark stopped it", flush=True)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.log.close()  # type: ignore[attr-defined]


# The data-path figures (decode against HF, per-hop overhead, concurrency) are defined for
# one token per step: speculative decoding (ADR-0019) is off there, and measured on its own
# by the network section (network_bench.py), delay 0 included.
DATA_PATH_FLAGS = ("--speculative", "off")


@contextlib.contextmanager
def running_swarm(
    models_dir: Path,
    model_id: str,
    ranges: list[tuple[int, int]],
    threads: int,
    label: str,
    flags: tuple[str, ...] = (),
) -> Iterator[Swarm]:
    """Start a swarm (every process also given ``flags``), wait until it covers the model,
    and always stop it afterwards."""
    extra = {i: [*DATA_PATH_FLAGS, *flags] for i in range(len(ranges))}
    swarm = Swarm(models_dir, model_id, ranges, threads, extra=extra)
    try:
        swarm.start()
        ready_s = swarm.wait_ready()
        print(f"  {label}: ready in {ready_s:.1f} s", flush=True)
        yield swarm
    finally:
        swarm.stop()


def stop_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt, so that ``finally`` blocks stop the swarm."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def _healthy(proc: subprocess.Popen, url: str) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"{proc.args[2]} exited with {proc.returncode}; see {LOG_DIR}")
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _covered(tracker_url: str, model_id: str) -> bool:
    models = httpx.get(f"{tracker_url}/v1/coverage", timeout=5.0).json()["models"]
    return any(m["id"] == model_id and m["covered"] for m in models)


def _poll(predicate, deadline: float, what: str) -> None:
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


# -- requests --------------------------------------------------------------------------------


def completion_body(model_id: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    """A greedy /v1/completions body that generates exactly ``max_tokens`` tokens."""
    return {"model": model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip


def complete(
    client: httpx.Client, url: str, model_id: str, prompt: list[int], max_tokens: int, **extra
) -> dict:
    """A non-streamed greedy completion: wall time, token count, text and the raw response."""
    body = completion_body(model_id, prompt, max_tokens, **extra)
    t0 = time.perf_counter()
    resp = client.post(f"{url}/v1/completions", json=body)
    elapsed = time.perf_counter() - t0
    _check_status(resp)
    data = resp.json()
    tokens = data["usage"]["completion_tokens"]
    if tokens != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {tokens}")
    return {"wall_s": elapsed, "tokens": tokens, "text": data["choices"][0]["text"],
            "response": data}  # fmt: skip


def ttft_ms(client: httpx.Client, url: str, model_id: str, prompt: list[int]) -> float:
    """Milliseconds from sending a streamed request (max_tokens 1) to its first SSE data chunk.

    Each request carries a ``cache_salt`` of its own, so that a swarm run with
    ``--prefix-cache`` computes the prompt again rather than reuse the last run's blocks
    (ADR-0054: before, repeated runs of one prompt timed cache hits)."""
    body = completion_body(model_id, prompt, 1, stream=True, cache_salt=uuid.uuid4().hex)
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        _check_status(resp)
        for line in resp.iter_lines():  # read to the end so the connection is reusable
            if first is None and line.startswith("data:"):
                first = (time.perf_counter() - t0) * 1000
                _check_chunk(line)
    if first is None:
        raise RuntimeError("stream ended without a data chunk")
    return first


async def stream_arrivals(
    client: httpx.AsyncClient, url: str, model_id: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[float]]:
    """Send a streamed request; return when it was sent and when each token chunk arrived.

    Times are ``time.perf_counter()`` seconds. A completion chunk carries one token; the
    final ``[DONE]`` and error chunks are not tokens (an error chunk raises).
    """
    body = completion_body(model_id, prompt, max_tokens, stream=True)
    arrivals: list[float] = []
    sent = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code >= 400:
            await resp.aread()
        _check_status(resp)
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter()
            if line[5:].strip() == "[DONE]":
                break
            _check_chunk(line)
            arrivals.append(now)
    if len(arrivals) != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, streamed {len(arrivals)}")
    return sent, arrivals


def _check_status(resp: httpx.Response) -> None:
    """Raise with the server's error message (an OpenAI-style body), not just the status."""
    if resp.status_code >= 400:
        if not resp.is_closed:
            resp.read()
        raise RuntimeError(f"HTTP {resp.status_code} from {resp.url}: {resp.text[:300]}")


def _check_chunk(line: str) -> None:
    """A stream that fails sends an error chunk instead of a token: raise with it."""
    if line[5:].lstrip().startswith('{"error"'):
        raise RuntimeError(f"stream error: {line[5:].strip()[:300]}")

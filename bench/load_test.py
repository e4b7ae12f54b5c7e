"""Load test: many concurrent streaming clients through a 3-process SmolLM2 swarm.

A bench, not a unit test. It starts real processes on 127.0.0.1 (a tracker node serving
layers [0, 10) of SmolLM2-135M-Instruct, plus nodes [10, 20) and [20, 30)), warms them up,
records each process's RSS, then runs N concurrent clients (default 32) for a duration
(default 120 s). Each client loops: POST /v1/completions with ``stream: true``,
``max_tokens`` 32, ``temperature`` 0, a varied prompt, and reads the SSE stream to
``data: [DONE]``. A request fails on a non-200 status, an error chunk, a missing
``[DONE]``, a transport error or a token count other than ``max_tokens``
(``ignore_eos`` is set so every request decodes exactly ``max_tokens``).

Acceptance checks (the script exits 1 if any fails):

- zero failed requests;
- afterwards every process reports ``active_sessions == 0`` and ``kv_tokens == 0`` on
  ``GET /v1/node`` (polled for a few seconds);
- every process's RSS at the end is at most 10% above its RSS after warm-up.

Prints requests/s, tokens/s, latency and time-to-first-token percentiles, and writes
``bench/results/load_test.json``. Processes are always stopped (try/finally).

    .venv/bin/python bench/load_test.py [--quick] [--clients 32] [--duration 120]
        [--max-tokens 32] [--models-dir .cache/test-models] [--threads 1]
        [--swarm-token T]   # optional: passed to the processes as MESHNET_SWARM_TOKEN
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from meshnet_common.models.gguf_import import SMOLLM2_MODEL_ID, import_smollm2

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
MODEL_ID = SMOLLM2_MODEL_ID
RANGES = [(0, 10), (10, 20), (20, 30)]  # tracker node first
START_TIMEOUT_S = 240.0
SWARM_TOKEN_HEADER = "x-meshnet-swarm-token"

SUBJECTS = [
    "a lighthouse keeper", "the history of bread", "a robot learning to paint",
    "the water cycle", "a small village in the mountains", "how bees communicate",
    "a detective on a train", "the first day of spring", "an old map found in an attic",
    "why the sky is blue", "a chess tournament", "the life of a river",
    "a dragon who was afraid of fire", "compilers and interpreters", "a market at dawn",
    "the moons of Jupiter",
]  # fmt: skip
FORMS = [
    "Write a short story about {}.",
    "Explain {} to a child.",
    "Here are three facts about {}:",
    "Once upon a time, there was {}",
    "A poem about {}:\n",
]


def prompt_for(client: int, n: int) -> str:
    """A different prompt per client and request (cycles through 80 combinations)."""
    k = client * 7 + n
    return FORMS[k % len(FORMS)].format(SUBJECTS[(k // len(FORMS) + client) % len(SUBJECTS)])


# -- processes -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Proc:
    name: str
    args: list[str]
    port: int
    log_path: Path
    env: dict = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **self.env}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", *self.args], stdout=log, stderr=subprocess.STDOUT,
            env=env, cwd=REPO_ROOT,
        )  # fmt: skip
        log.close()  # the child holds its own descriptor
        return self

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def rss(self) -> int:
        return psutil.Process(self.popen.pid).memory_info().rss

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self) -> None:
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def start_swarm(args, log_dir: Path) -> list[Proc]:
    models_dir = str(args.models_dir)
    env = {"MESHNET_SWARM_TOKEN": args.swarm_token} if args.swarm_token else {}
    common = ["--models-dir", models_dir, "--model-id", MODEL_ID, "--threads", str(args.threads)]
    procs: list[Proc] = []
    port = free_port()
    start, end = RANGES[0]
    tracker = Proc(
        "tracker-node", ["meshnet_tracker.cli", *common, "--port", str(port),
                         "--shard-start", str(start), "--shard-end", str(end)],
        port, log_dir / "tracker-node.log", env,
    )  # fmt: skip
    procs.append(tracker.start())
    for start, end in RANGES[1:]:
        port = free_port()
        name = f"node-{start}-{end}"
        proc = Proc(
            name, ["meshnet_node.cli", "--tracker", tracker.url, *common, "--port", str(port),
                   "--shard-start", str(start), "--shard-end", str(end), "--node-id", name],
            port, log_dir / f"{name}.log", env,
        )  # fmt: skip
        procs.append(proc.start())
    return procs


def wait_ready(procs: list[Proc], timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{pending[0].name} not healthy after {timeout}s")
        for proc in list(pending):
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")
            try:
                if httpx.get(f"{proc.url}/health", timeout=1.0).status_code == 200:
                    pending.remove(proc)
            except httpx.HTTPError:
                pass
        time.sleep(0.25)
    tracker = procs[0]
    while time.monotonic() < deadline:
        models = httpx.get(f"{tracker.url}/v1/coverage", timeout=5).json()["models"]
        if any(m["id"] == MODEL_ID and m["covered"] for m in models):
            return
        time.sleep(0.25)
    raise TimeoutError(f"{MODEL_ID} not covered after {timeout}s")


def node_info(proc: Proc, headers: dict) -> dict:
    resp = httpx.get(f"{proc.url}/v1/node", headers=headers, timeout=10)
    resp.raise_for_status()
    return resp.json()


def wait_sessions_freed(procs: list[Proc], headers: dict, timeout: float) -> tuple[bool, dict]:
    """Poll GET /v1/node until no process holds a session or KV token; returns the last view."""
    deadline = time.monotonic() + timeout
    while True:
        view = {}
        for proc in procs:
            info = node_info(proc, headers)
            view[proc.name] = {k: info[k] for k in ("active_sessions", "kv_tokens")}
        if all(v["active_sessions"] == 0 and v["kv_tokens"] == 0 for v in view.values()):
            return True, view
        if time.monotonic() > deadline:
            return False, view
        time.sleep(0.5)


def settled_rss(procs: list[Proc], samples: int = 5, interval: float = 0.4) -> dict[str, int]:
    """RSS of each process, the median of a few samples taken while idle."""
    values: dict[str, list[int]] = {p.name: [] for p in procs}
    for _ in range(samples):
        for proc in procs:
            values[proc.name].append(proc.rss())
        time.sleep(interval)
    return {name: sorted(v)[len(v) // 2] for name, v in values.items()}


class RssWatch:
    """Samples every process's RSS in the background; keeps the peak."""

    def __init__(self, procs: list[Proc], interval: float = 1.0) -> None:
        self.procs, self.interval = procs, interval
        self.peak = {p.name: 0 for p in procs}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for proc in self.procs:
                with contextlib.suppress(psutil.Error):
                    self.peak[proc.name] = max(self.peak[proc.name], proc.rss())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# -- clients ---------------------------------------------------------------------------------


@dataclass
class RequestResult:
    client: int
    start: float  # seconds since the load phase began
    latency_s: float
    ttft_s: float | None
    tokens: int
    ok: bool
    error: str | None = None


async def one_request(
    http: httpx.AsyncClient, url: str, body: dict, client: int, t0: float, max_tokens: int
) -> RequestResult:
    start = time.perf_counter()
    ttft, tokens, done, error = None, 0, False, None
    try:
        async with http.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                error = f"HTTP {resp.status_code}: {text}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        error = f"error chunk: {event['error'].get('message')}"
                        continue
                    for _choice in event.get("choices", ()):
                        tokens += 1
                        if ttft is None:
                            ttft = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    latency = time.perf_counter() - start
    if error is None and not done:
        error = "stream ended without [DONE]"
    if error is None and tokens != max_tokens:
        error = f"{tokens} tokens, expected {max_tokens}"
    return RequestResult(client, start - t0, latency, ttft, tokens, error is None, error)


async def run_clients(
    url: str,
    clients: int,
    duration: float,
    max_tokens: int,
    timeout: float,
    *,
    rounds: int | None = None,
) -> tuple[list[RequestResult], float]:
    """``clients`` loops, each issuing requests back to back until ``duration`` has passed
    (a request started in time runs to its end), or exactly ``rounds`` requests each.
    Returns the results and the wall time."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    results: list[RequestResult] = []
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=10.0), limits=limits
    ) as http:
        t0 = time.perf_counter()
        stop_at = t0 + duration

        async def loop(client: int) -> None:
            n = 0
            while (n < rounds) if rounds is not None else (time.perf_counter() < stop_at):
                body = {
                    "model": MODEL_ID, "prompt": prompt_for(client, n), "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                }  # fmt: skip
                results.append(await one_request(http, url, body, client, t0, max_tokens))
                n += 1

        await asyncio.gather(*(loop(i) for i in range(clients)))
        wall = time.perf_counter() - t0
    return results, wall


# -- statistics ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100])."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    latencies = [r.latency_s for r in ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    per_request_tps = [
        (r.tokens - 1) / (r.latency_s - r.ttft_s)
        for r in ok
        if r.ttft_s is not None and r.tokens > 1 and r.latency_s > r.ttft_s
    ]
    tokens = sum(r.tokens for r in results)
    return {
        "requests": len(results),
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "latency_s": {
            "p50": percentile(latencies, 50),
            "p99": percentile(latencies, 99),
            "max": max(latencies, default=None),
        },  # fmt: skip
        "ttft_s": {
            "p50": percentile(ttfts, 50),
            "p99": percentile(ttfts, 99),
            "max": max(ttfts, default=None),
        },  # fmt: skip
        "decode_tokens_per_s_per_request": {
            "p50": percentile(per_request_tps, 50),
            "p1": percentile(per_request_tps, 1),
        },  # fmt: skip
        "errors": sorted({r.error for r in results if r.error})[:20],
    }


def print_table(title: str, headers: list[str], rows: list[list[object]]) -> None:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(
            [row[0].ljust(widths[0])]
            + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        )

    print(f"\n{title}\n{line(cells[0])}\n{'  '.join('-' * w for w in widths)}")
    for row in cells[1:]:
        print(line(row))


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def count_in_logs(procs: list[Proc], needle: str) -> int:
    total = 0
    for proc in procs:
        with contextlib.suppress(OSError):
            total += proc.log_path.read_text(errors="replace").count(needle)
    return total


# -- main ------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=120.0, help="load phase (s)")
    parser.add_argument("--quick", action="store_true", help="8 clients for 20 s")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--models-dir", type=Path, default=REPO_ROOT / ".cache" / "test-models")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--warmup-rounds", type=int, default=2,
                        help="requests per client before RSS is recorded")  # fmt: skip
    parser.add_argument("--rss-tolerance", type=float, default=0.10)
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="how long sessions may take to be freed at the end")  # fmt: skip
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--swarm-token", default=None,
                        help="run the swarm with this token (sent to processes via env)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "load_test.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.duration = 8, 20.0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so finally: still stops the swarm
    log_dir = RESULTS_DIR / "logs" / "load_test"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"importing {MODEL_ID} into {args.models_dir} (no-op when present)", flush=True)
    import_smollm2(args.models_dir)
    internal = {SWARM_TOKEN_HEADER: args.swarm_token} if args.swarm_token else {}

    procs: list[Proc] = []
    try:
        procs = start_swarm(args, log_dir)
        wait_ready(procs)
        tracker = procs[0]
        url = f"{tracker.url}/v1/completions"
        print(f"swarm up: {', '.join(f'{p.name} {p.url}' for p in procs)}", flush=True)

        # Warm-up at full concurrency: allocator pools, batched decode shapes, connections.
        t = time.perf_counter()
        warm, _ = asyncio.run(
            run_clients(url, args.clients, 0.0, args.max_tokens, args.request_timeout,
                        rounds=args.warmup_rounds)
        )  # fmt: skip
        warm_failed = [r for r in warm if not r.ok]
        print(f"warm-up: {len(warm)} requests in {time.perf_counter() - t:.1f}s, "
              f"{len(warm_failed)} failed", flush=True)  # fmt: skip
        freed, _ = wait_sessions_freed(procs, internal, args.settle_s)
        rss_warm = settled_rss(procs)

        print(f"load: {args.clients} clients for {args.duration:.0f}s ...", flush=True)
        with RssWatch(procs) as watch:
            results, wall = asyncio.run(
                run_clients(url, args.clients, args.duration, args.max_tokens, args.request_timeout)
            )
        stats = summarize(results, wall)
        freed, sessions = wait_sessions_freed(procs, internal, args.settle_s)
        rss_end = settled_rss(procs)
        alive = {p.name: p.alive() for p in procs}
        failovers = count_in_logs(procs, "failing over")
    finally:
        for proc in reversed(procs):
            proc.stop()

    rss = {
        name: {
            "after_warmup_mib": rss_warm[name] / 2**20,
            "peak_mib": watch.peak[name] / 2**20,
            "end_mib": rss_end[name] / 2**20,
            "end_over_warmup": rss_end[name] / rss_warm[name],
        }
        for name in rss_warm
    }
    checks = {
        "zero_failed_requests": stats["failed"] == 0 and stats["ok"] > 0,
        "sessions_freed": freed,
        "rss_within_tolerance": all(
            r["end_over_warmup"] <= 1.0 + args.rss_tolerance for r in rss.values()
        ),
        "processes_alive": all(alive.values()),
    }

    print_table(
        f"load test: {args.clients} streaming clients, {args.duration:.0f}s, max_tokens "
        f"{args.max_tokens}, SmolLM2 over 3 processes {RANGES}",
        ["metric", "value"],
        [
            ["requests (ok / failed)", f"{stats['ok']} / {stats['failed']}"],
            ["wall (s)", fmt(stats["wall_s"], 1)],
            ["requests/s", fmt(stats["requests_per_s"], 3)],
            ["tokens/s (all clients)", fmt(stats["tokens_per_s"], 2)],
            ["latency p50 / p99 (s)",
             f"{fmt(stats['latency_s']['p50'])} / {fmt(stats['latency_s']['p99'])}"],
            ["TTFT p50 / p99 (s)",
             f"{fmt(stats['ttft_s']['p50'])} / {fmt(stats['ttft_s']['p99'])}"],
            ["decode tok/s per request p50",
             fmt(stats["decode_tokens_per_s_per_request"]["p50"])],
            ["failovers in logs", failovers],
        ],
    )  # fmt: skip
    print_table(
        "processes",
        ["process", "RSS warm (MiB)", "peak (MiB)", "end (MiB)", "end/warm", "sessions", "kv"],
        [
            [name, fmt(r["after_warmup_mib"], 1), fmt(r["peak_mib"], 1), fmt(r["end_mib"], 1),
             fmt(r["end_over_warmup"], 3), sessions[name]["active_sessions"],
             sessions[name]["kv_tokens"]]
            for name, r in rss.items()
        ],
    )  # fmt: skip
    print_table("acceptance", ["check", "result"],
                [[k, "PASS" if v else "FAIL"] for k, v in checks.items()])  # fmt: skip
    if stats["errors"]:
        print("\nerrors (distinct, first 20):")
        for error in stats["errors"]:
            print(f"  {error}")

    out = {
        "config": {
            "model": MODEL_ID, "ranges": RANGES, "clients": args.clients,
            "duration_s": args.duration, "max_tokens": args.max_tokens,
            "threads_per_process": args.threads, "warmup_rounds": args.warmup_rounds,
            "rss_tolerance": args.rss_tolerance, "swarm_token": bool(args.swarm_token),
        },
        "environment": {
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "machine": platform.machine(), "loadavg_1m_at_end": os.getloadavg()[0],
        },
        "warmup": {"requests": len(warm), "failed": len(warm_failed)},
        "load": stats,
        "failovers_in_logs": failovers,
        "processes": {name: {**r, **sessions[name], "alive": alive[name]}
                      for name, r in rss.items()},
        "checks": checks,
        "passed": all(checks.values()),
        "requests": [asdict(r) for r in results],
    }  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.output}; logs in {log_dir}")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

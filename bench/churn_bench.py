"""Churn soak (issue #18): concurrent greedy streams on a replicated swarm while replicas are
killed, restarted and drained at random; does every completion succeed, unchanged?

Swarm (SmolLM2-135M, bfloat16, 127.0.0.1): a tracker node [0, 10) and two replicas each of
[10, 20) and [20, 30) (``--layout single-tail``: one replica of [20, 30), so that killing it
leaves the model briefly uncovered). First every prompt is completed once with no churn (the reference
texts), then ``--clients`` clients stream completions for ``--calm`` seconds (latency with
no churn), then for ``--minutes`` with churn: every 4-8 s (``--every``) a random replica is
SIGKILLed and restarted at once, and every third event is a drain instead (SIGTERM; the
node finishes what it holds and exits 0; restarted then) where its range has a twin. A
client pauses 1 s after a failed completion. Reports completions ok/total,
identical to the reference, p50/p99 latency calm and under churn, failovers, RSS drift per
node, and sessions left on the nodes at the end. JSON in bench/results/churn.json.

    .venv/bin/python bench/churn_bench.py [--clients 6] [--minutes 1.5] [--calm 20]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from benchlib import REPO_ROOT, write_json
from swarm import Swarm, stop_on_sigterm

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LAYOUTS = {  # --layout: the ranges, tracker node first
    "twins": [(0, 10), (10, 20), (10, 20), (20, 30), (20, 30)],
    # The last range's only replica: killing it leaves the model uncovered until it is back,
    # and the streams in flight wait for it (the head's failover budget), then replay.
    "single-tail": [(0, 10), (10, 20), (10, 20), (20, 30)],
}
RETRY_PAUSE_S = 1.0  # a client's pause after a failed completion
PROMPTS = [
    "def fibonacci(n):\n    ",
    "def quicksort(items):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "import json\n\ndef load_config(path):\n    ",
    "def is_prime(n):\n    ",
    "The three primary colors are",
]


def stream(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> tuple[str, float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started, text = time.perf_counter(), []
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:200]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            text.append(event["choices"][0]["text"])
    return "".join(text), time.perf_counter() - started


def load(swarm: Swarm, seconds: float, clients: int, max_tokens: int, reference: dict) -> dict:
    """``clients`` threads streaming completions back to back for ``seconds``."""
    results: list[tuple[bool, bool, float, str]] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client_loop(index: int) -> None:
        rng = random.Random(index)
        with httpx.Client(timeout=300) as client:
            while time.monotonic() < stop_at:
                prompt = rng.choice(PROMPTS)
                try:
                    text, latency = stream(client, swarm.tracker_url, prompt, max_tokens)
                    entry = (True, text == reference[prompt], latency, "")
                except Exception as exc:  # counted, not fatal
                    entry = (False, False, 0.0, str(exc)[:160])
                with lock:
                    results.append(entry)
                if not entry[0]:  # as a client would: not again at once
                    time.sleep(RETRY_PAUSE_S)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies = sorted(r[2] for r in results if r[0])
    return {
        "completions": len(results),
        "ok": sum(r[0] for r in results),
        "identical": sum(r[1] for r in results),
        "p50_s": statistics.median(latencies) if latencies else None,
        "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        if latencies else None,
        "errors": sorted({r[3] for r in results if not r[0]})[:5],
    }  # fmt: skip


def restart(swarm: Swarm, index: int) -> None:
    old = swarm.procs[index]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(old.args, stdout=old.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                            env=env)  # fmt: skip
    proc.log = old.log  # type: ignore[attr-defined]
    swarm.procs[index] = proc


def churn(swarm: Swarm, seconds: float, every: tuple[float, float], events: list) -> None:
    """Every few seconds: SIGKILL a random replica and restart it, or (every third) drain it."""
    rng = random.Random(7)
    stop_at = time.monotonic() + seconds
    count = 0
    while time.monotonic() < stop_at:
        time.sleep(rng.uniform(*every))
        if time.monotonic() >= stop_at:
            break
        index = rng.randrange(1, len(swarm.procs))
        proc = swarm.procs[index]
        count += 1
        # A drain is its operator taking the node away: with no twin of its range the model
        # is then not covered, and requests are refused at once (503), not waited for.
        twinned = swarm.ranges.count(swarm.ranges[index]) > 1
        drain = count % 3 == 0 and twinned
        started = time.monotonic()
        if drain:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        else:
            proc.kill()
            code = proc.wait()
        restart(swarm, index)
        events.append({"t": round(time.monotonic() - stop_at + seconds, 1), "node": index,
                       "range": swarm.ranges[index], "action": "drain" if drain else "kill",
                       "exit": code, "down_s": round(time.monotonic() - started, 2)})  # fmt: skip
        print(
            f"  churn: {'drained' if drain else 'killed'} {swarm.ranges[index]} (node {index}, "
            f"exit {code}); restarted",
            flush=True,
        )


def failovers(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^meshnet_failovers_total (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


REPLAYED = re.compile(r"replayed the prompt and (\d+) decode passes in ([\d.]+) s")


def replays(swarm: Swarm) -> list[tuple[int, float]]:
    """(decode passes replayed, seconds) of every failover's replay, from the head's log."""
    tracker_log = swarm.procs[0].log.name  # type: ignore[attr-defined]
    text = Path(tracker_log).read_text(errors="replace")
    return [(int(n), float(s)) for n, s in REPLAYED.findall(text)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--minutes", type=float, default=1.5)
    parser.add_argument("--calm", type=float, default=20.0, help="seconds of load without churn")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--every", default="4-8", help="seconds between churn events, MIN-MAX")
    parser.add_argument("--models-dir", default=str(REPO_ROOT / ".cache" / "test-models"))
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="twins",
                        help="twins: two replicas of each range after the tracker node's; "
                        "single-tail: one replica of the last range, so a kill leaves it "
                        "briefly missing")  # fmt: skip
    parser.add_argument("--flags", default="", help="more flags for every process, e.g. "
                        "'--speculative off'")  # fmt: skip
    args = parser.parse_args()
    low, high = (float(x) for x in args.every.split("-"))
    stop_on_sigterm()
    flags = ["--heartbeat-interval", "0.5", "--drain-timeout", "60", *args.flags.split()]
    ranges = LAYOUTS[args.layout]
    swarm = Swarm(args.models_dir, MODEL, ranges, threads=1,
                  extra={i: list(flags) for i in range(len(ranges))})  # fmt: skip
    swarm.extra[0] = ["--heartbeat-interval", "0.5", *args.flags.split()]
    try:
        swarm.start()
        print(f"swarm ready in {swarm.wait_ready():.1f} s", flush=True)
        with httpx.Client(timeout=300) as client:
            reference = {p: stream(client, swarm.tracker_url, p, args.max_tokens)[0]
                         for p in PROMPTS}  # fmt: skip
        rss_start = swarm.rss_mib()
        calm = load(swarm, args.calm, args.clients, args.max_tokens, reference)
        print(f"calm: {calm}", flush=True)
        before = failovers(swarm.tracker_url)
        events: list = []
        killer = threading.Thread(target=churn, args=(swarm, args.minutes * 60, (low, high),
                                                       events))  # fmt: skip
        killer.start()
        churned = load(swarm, args.minutes * 60, args.clients, args.max_tokens, reference)
        killer.join()
        print(f"churn: {churned}", flush=True)
        swarm.wait_ready()
        time.sleep(2.0)
        left = {}
        for i, url in enumerate(swarm.urls[1:], start=1):
            info = httpx.get(f"{url}/v1/node", timeout=10).json()
            left[i] = (info["active_sessions"], info["kv_tokens"])
        result = {
            "clients": args.clients, "max_tokens": args.max_tokens, "ranges": ranges,
            "calm": calm, "churn": churned, "events": events,
            "failovers": failovers(swarm.tracker_url) - before,
            "rss_mib_start": rss_start, "rss_mib_end": swarm.rss_mib(),
            "sessions_left": left, "replays": replays(swarm),
        }  # fmt: skip
    finally:
        swarm.stop()
    write_json("churn.json", result)
    c, k = result["calm"], result["churn"]
    tail = "2x[20,30)" if args.layout == "twins" else "1x[20,30)"
    print(f"\nchurn soak (SmolLM2 bf16, tracker node + 2x[10,20) + {tail})")
    print(
        f"  calm : {c['ok']}/{c['completions']} ok, {c['identical']} identical, "
        f"p50 {c['p50_s']:.2f} s, p99 {c['p99_s']:.2f} s"
    )
    print(
        f"  churn: {k['ok']}/{k['completions']} ok, {k['identical']} identical, "
        f"p50 {k['p50_s']:.2f} s, p99 {k['p99_s']:.2f} s; {len(events)} events "
        f"({sum(e['action'] == 'drain' for e in events)} drains), "
        f"{result['failovers']:.0f} failovers"
    )
    print(f"  sessions left on nodes: {left}")
    done = result["replays"]
    if done:  # the cost of exact replay: time to resume against tokens generated so far
        per_pass = sorted(s / (n + 1) for n, s in done)
        print(
            f"  replays: {len(done)}, after {min(n for n, _ in done)}-"
            f"{max(n for n, _ in done)} decode passes; {max(s for _, s in done):.2f} s at most, "
            f"{1000 * per_pass[len(per_pass) // 2]:.0f} ms per pass (median)"
        )
    print(
        "  rss MiB start -> end: "
        + ", ".join(
            f"{a:.0f}->{b:.0f}" for a, b in zip(rss_start, result["rss_mib_end"], strict=True)
        )
    )
    return 0 if k["ok"] == k["completions"] == k["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Bring up a local swarm on SmolLM2: a tracker node plus one more node, on this machine.

Imports the model if it is missing, waits until every layer is covered, prints how to
call it, and serves until Ctrl-C (``--demo``: run one completion and exit).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from meshnet_common.gguf_import import import_smollm2
from meshnet_common.models_dir import find_snapshot
from meshnet_node.serve import free_port

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SPLIT = 15  # the tracker node serves [0, 15), the other node [15, 30)


def wait_covered(url: str, procs: list[subprocess.Popen], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"a swarm process exited early (code {proc.returncode})")
        try:
            models = httpx.get(f"{url}/v1/coverage", timeout=2).json()["models"]
            if any(m["id"] == MODEL and m["covered"] for m in models):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the swarm did not cover {MODEL} within {timeout:.0f}s")


def demo(url: str) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0}  # fmt: skip
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    print(json.dumps(reply, indent=2))


def usage_text(url: str) -> str:
    return f"""
meshnet swarm is up: {url}
  coverage:  curl -s {url}/v1/coverage

  curl -s {url}/v1/completions -H 'content-type: application/json' \\
    -d '{{"model": "{MODEL}", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{MODEL}', messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)"

Ctrl-C stops the swarm.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models-dir", default="models")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--demo", action="store_true", help="run one completion, then exit")
    args = parser.parse_args()
    models_dir = Path(args.models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    if find_snapshot(models_dir, MODEL, "plain") is None:
        print(f"importing {MODEL} into {models_dir} (once, ~40 s) ...", flush=True)
    import_smollm2(models_dir)
    url = f"http://127.0.0.1:{args.port}"
    py = sys.executable
    procs = [
        subprocess.Popen([py, "-m", "meshnet_tracker.cli", "--models-dir", str(models_dir),
                          "--port", str(args.port), "--model-id", MODEL, "--shard-start", "0",
                          "--shard-end", str(SPLIT), "--log-level", "warning"]),
        subprocess.Popen([py, "-m", "meshnet_node.cli", "--tracker", url, "--models-dir",
                          str(models_dir), "--model-id", MODEL, "--shard-start", str(SPLIT),
                          "--shard-end", "30", "--port", str(free_port()),
                          "--log-level", "warning"]),
    ]  # fmt: skip
    try:
        wait_covered(url, procs)
        if args.demo:
            demo(url)
            return
        print(usage_text(url), flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        # Nodes first, so they can deregister from the still-running tracker.
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        print("swarm stopped", flush=True)


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()

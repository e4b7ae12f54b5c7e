"""The two commands' --help is complete, and start-up errors are one clear line + non-zero
exit, never a traceback (real processes; the error cases run side by side)."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys

import pytest
from swarm_harness import closed_port

from meshnet_node.cli import build_parser as node_parser
from meshnet_tracker.cli import build_parser as tracker_parser

MODEL = "meshnet-tiny/llama"


@pytest.mark.parametrize("build", [tracker_parser, node_parser], ids=["tracker", "node"])
def test_help_documents_every_flag(build):
    parser = build()
    text = parser.format_help()
    assert "SUPPRESS" not in text and "--fault-inject" not in text  # test-only flag stays hidden
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        flag = action.option_strings[-1]
        assert flag in text, flag
        assert action.help and len(action.help) > 10, f"{flag} has no real help"
        if action.dest not in ("help", "version"):
            assert f"[env MESHNET_{action.dest.upper()}]" in action.help, flag
    for must in ("--log-level", "--log-format", "--swarm-token", "examples:", "(default: "):
        assert must in text


@pytest.mark.parametrize("module", ["meshnet_tracker.cli", "meshnet_node.cli"])
def test_version(module):
    out = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    prog = "meshnet-tracker" if "tracker" in module else "meshnet-node"
    assert re.fullmatch(rf"{prog} \d+\.\d+\.\d+\S*\n", out.stdout), out.stdout


@pytest.mark.integration
def test_startup_errors_are_one_clear_line(models_dir, tiny_snapshot, swarm_factory, tmp_path):
    tiny_snapshot("llama")
    tracker = swarm_factory().tracker().wait_healthy()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_port = str(busy.getsockname()[1])
    nowhere = f"http://127.0.0.1:{closed_port()}"
    quiet = ["--log-level", "warning"]
    cases = {
        "tracker: port in use": (
            ["meshnet_tracker.cli", "--models-dir", str(models_dir), "--port", busy_port],
            "meshnet-tracker: error: cannot listen on 127.0.0.1:" + busy_port,
        ),
        "tracker: models dir missing": (
            ["meshnet_tracker.cli", "--models-dir", str(tmp_path / "nope"), "--port", "0"],
            "meshnet-tracker: error: --models-dir",
        ),
        "tracker: unknown model": (
            ["meshnet_tracker.cli", "--models-dir", str(models_dir), "--port", "0",
             "--model-id", "nope/none", "--shard-start", "0", "--shard-end", "2"],
            "meshnet-tracker: error: model 'nope/none' not found",
        ),
        "node: models dir missing": (
            ["meshnet_node.cli", "--models-dir", str(tmp_path / "nope"), "--model-id", MODEL,
             "--shard-start", "0", "--shard-end", "6"],
            "meshnet-node: error: --models-dir",
        ),
        "node: tracker unreachable": (
            ["meshnet_node.cli", "--tracker", nowhere, "--tracker-wait", "1", *quiet],
            f"meshnet-node: error: tracker {nowhere} unreachable after 1s",
        ),
        "tracker node: not the first layers": (
            ["meshnet_tracker.cli", "--models-dir", str(models_dir), "--port", "0",
             "--model-id", MODEL, "--shard-start", "2", "--shard-end", "4"],
            "meshnet-tracker: error: the tracker node serves the first layers",
        ),
        "tracker node: range past the model": (
            ["meshnet_tracker.cli", "--models-dir", str(models_dir), "--port", "0",
             "--model-id", MODEL, "--shard-start", "0", "--shard-end", "99"],
            "meshnet-tracker: error: --shard-start/--shard-end",
        ),
        "node: range past the model": (
            ["meshnet_node.cli", "--models-dir", str(models_dir), "--model-id", MODEL,
             "--shard-start", "2", "--shard-end", "99"],
            "meshnet-node: error: --shard-start/--shard-end",
        ),
        "node: wildcard advertise url": (
            ["meshnet_node.cli", "--tracker", tracker.url, "--advertise-url", "http://0.0.0.0:9",
             "--models-dir", str(models_dir), "--model-id", MODEL, "--shard-start", "0",
             "--shard-end", "6"],
            "meshnet-node: error: --advertise-url http://0.0.0.0:9",
        ),
        "node: the tracker cannot call it back": (
            ["meshnet_node.cli", "--tracker", tracker.url, "--advertise-url", nowhere,
             "--models-dir", str(models_dir), "--model-id", MODEL, "--shard-start", "0",
             "--shard-end", "6", *quiet],
            "meshnet-node: error: the tracker refused this node: the tracker cannot reach node",
        ),
        "node: a shipped format the checkpoint lacks": (
            ["meshnet_node.cli", "--models-dir", str(models_dir), "--model-id", MODEL,
             "--shard-start", "0", "--shard-end", "6", "--quantization", "fp8", *quiet],
            "meshnet-node: error: --quantization fp8: this checkpoint ships plain weights",
        ),
        "tracker node: a shipped format the checkpoint lacks": (
            ["meshnet_tracker.cli", "--models-dir", str(models_dir), "--port", "0",
             "--model-id", MODEL, "--shard-start", "0", "--shard-end", "2",
             "--quantization", "mxfp4", *quiet],
            "meshnet-tracker: error: --quantization mxfp4: this checkpoint ships plain weights",
        ),
        "node: unknown model": (
            ["meshnet_node.cli", "--tracker", tracker.url, "--model-id", "nope/none",
             "--shard-start", "0", "--shard-end", "2", "--cache-dir", str(tmp_path / "cache"),
             *quiet],
            "meshnet-node: error: unknown model 'nope/none'",
        ),
    }  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs = {
            name: subprocess.Popen(
                [sys.executable, "-m", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )  # fmt: skip
            for name, (args, _) in cases.items()
        }
        outputs = {name: proc.communicate(timeout=120) for name, proc in procs.items()}
    finally:
        busy.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for name, (stdout, stderr) in outputs.items():
        expected = cases[name][1]
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert procs[name].returncode not in (0, None), name
        assert "Traceback" not in stderr, f"{name}:\n{stderr}"
        assert len(lines) == 1, f"{name}: want one line, got:\n{stderr}"
        assert lines[0].startswith(expected), f"{name}: {lines[0]!r}"
        # At most the early line that reports the bound port; never a ready line.
        assert re.fullmatch(r"(meshnet-\w+ listening on port \d+\n)?", stdout), (name, stdout)


def test_make_swarm_takes_another_port():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for target in ("swarm", "demo"):
        out = subprocess.run(
            ["make", "-n", target, "PORT=8090"], cwd=root, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "scripts/local_swarm.py" in out.stdout and "--port 8090" in out.stdout


def test_the_local_swarm_script_starts_and_names_a_taken_port(tmp_path):
    """`make swarm`'s script imports (a helper it used was once removed, unnoticed), and a
    port another process holds is one clear line and exit 1, before anything starts."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "scripts/local_swarm.py", "--models-dir", str(tmp_path),
             "--run-dir", str(tmp_path / "run"), "--port", str(port)],
            cwd=root, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "make swarm PORT=N" in out.stderr

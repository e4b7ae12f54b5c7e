"""The three packages install without the Makefile (issue 39): their wheels, built by the
build backend each pyproject declares, give working ``meshnet-tracker``, ``meshnet-node``
and ``meshnet-models`` commands in a fresh venv that knows nothing of this checkout.

Nothing is downloaded: the wheels are built without build isolation (the backend comes
from this venv), installed with ``--no-deps --no-index``, and the fresh venv then sees this
venv's third-party packages (torch and the rest) through a ``.pth`` file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "node", "tracker")
COMMANDS = {"meshnet-tracker": "tracker", "meshnet-node": "node", "meshnet-models": "common"}

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def version(package: str) -> str:
    text = (ROOT / "packages" / package / "pyproject.toml").read_text()
    return tomllib.loads(text)["project"]["version"]


def run(argv: list[str | Path], cwd: Path, env: dict[str, str], timeout: float = 120):
    out = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert out.returncode == 0, f"{argv}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


def clean_env(venv: Path) -> dict[str, str]:
    """This process's environment without anything pointing into the checkout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")
        and not k.startswith("MESHNET_")
    }
    env["PATH"] = os.pathsep.join([str(venv / "bin"), "/usr/bin", "/bin"])
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_wheels_install_into_a_fresh_venv_and_each_command_runs(tmp_path):
    outside = tmp_path / "elsewhere"  # every command runs here: not the checkout
    outside.mkdir()
    # Build from copies, so the build leaves no build/ folder in the checkout.
    wheels = tmp_path / "wheels"
    sources = []
    for name in PACKAGES:
        src = tmp_path / "src" / name
        shutil.copytree(
            ROOT / "packages" / name / "src", src / "src",
            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
        )  # fmt: skip
        shutil.copy(ROOT / "packages" / name / "pyproject.toml", src)
        sources.append(src)
    env = clean_env(Path(sys.prefix))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", wheels, *sources], outside, env, timeout=300)  # fmt: skip
    built = sorted(wheels.glob("*.whl"))
    assert [w.name.split("-")[0] for w in built] == [
        "meshnet_common", "meshnet_node", "meshnet_tracker"
    ]  # fmt: skip

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], outside, env)
    python = venv / "bin" / "python"
    env = clean_env(venv)
    # The wheels first, into a venv that sees nothing else (pip must not meet this
    # checkout's editable installs), then this venv's dependencies behind them.
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", *built], outside, env)
    fresh = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     outside, env).stdout.strip())  # fmt: skip
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (fresh / "zz_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))

    where = run([python, "-c", "import meshnet_common, meshnet_node, meshnet_tracker as t; "
                 "print(meshnet_common.__file__, meshnet_node.__file__, t.__file__)"],
                outside, env).stdout.split()  # fmt: skip
    assert all(Path(f).is_relative_to(fresh) for f in where), where
    assert (fresh / "meshnet_tracker" / "static" / "index.html").is_file()  # the dashboard
    for command, package in COMMANDS.items():
        out = run([venv / "bin" / command, "--version"], outside, env)
        assert out.stdout.strip() == f"{command} {version(package)}", out.stdout
    # The installed tracker reads a --config file; YAML's parser is a declared dependency.
    requires = run([python, "-c", "import importlib.metadata as m; "
                    "print(m.requires('meshnet-common'))"], outside, env).stdout  # fmt: skip
    assert "pydantic-settings[yaml]" in requires, requires
    bad = outside / "tracker.yaml"
    bad.write_text("prot: 8080\n")
    refused = subprocess.run(
        [venv / "bin" / "meshnet-tracker", "--config", bad], cwd=outside, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "unknown key 'prot'" in refused.stderr, refused.stderr

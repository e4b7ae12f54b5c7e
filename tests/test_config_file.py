"""``--config FILE``: settings from a YAML or TOML file, read by pydantic-settings' own
sources, between the env and the defaults (flag > env > file > default); a bad file is one
line naming the file and the key, and exit 2 (issue 39)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshnet_node.cli import build_parser as node_parser
from meshnet_node.cli import main as node_main
from meshnet_node.settings import NodeSettings
from meshnet_tracker.cli import build_parser as tracker_parser
from meshnet_tracker.cli import main as tracker_main
from meshnet_tracker.settings import TrackerSettings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_meshnet_env(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("MESHNET_")]:
        monkeypatch.delenv(name)


def write(tmp_path: Path, fmt: str, values: dict[str, Any], name: str = "meshnet") -> Path:
    """``values`` as a YAML or TOML file (TOML: scalars and lists, as JSON writes them)."""
    path = tmp_path / f"{name}.{fmt}"
    if fmt == "toml":
        path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    else:
        path.write_text(yaml.safe_dump(values))
    return path


def node(*argv: str) -> NodeSettings:
    return NodeSettings.from_args(node_parser().parse_args(list(argv)))


def tracker(*argv: str) -> TrackerSettings:
    return TrackerSettings.from_args(tracker_parser().parse_args(list(argv)))


@pytest.mark.parametrize("fmt", ["yaml", "yml", "toml"])
def test_node_flag_over_env_over_file_over_default(tmp_path, monkeypatch, fmt):
    path = write(tmp_path, fmt, {
        "port": 9001,                        # the file alone
        "heartbeat-interval": 3.5,           # a flag whose field is heartbeat_interval_s
        "tracker": "http://127.0.0.1:9",     # beaten by the env
        "max_sessions": 7,                   # beaten by the flag (and the env)
        "shard_source": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        "turn_max_ms": 40,
    })  # fmt: skip
    monkeypatch.setenv("MESHNET_TRACKER", "http://127.0.0.1:10")
    monkeypatch.setenv("MESHNET_MAX_SESSIONS", "8")
    got = node("--config", str(path), "--max-sessions", "9")
    assert got.port == 9001 and got.heartbeat_interval_s == 3.5
    assert got.tracker_url == "http://127.0.0.1:10"  # env over file
    assert got.max_sessions == 9  # flag over env over file
    assert got.shard_sources == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert got.turn_max_ms == 40
    assert got.tracker_wait_s == 60.0  # nothing set it: the default
    plain = node("--max-sessions", "9")  # without --config the file is not read
    assert plain.port == 0 and plain.heartbeat_interval_s == 2.0


@pytest.mark.parametrize("fmt", ["yaml", "toml"])
def test_tracker_flag_over_env_over_file_over_default(tmp_path, monkeypatch, fmt):
    path = write(tmp_path, fmt, {
        "move_grace": 25,                    # the file alone
        "models-dir": str(tmp_path),         # dashed key
        "port": 8181,                        # beaten by the env
        "host": "127.0.0.2",                 # beaten by the flag
        "queue_timeout_s": 12,               # a field's own name is a key too
    })  # fmt: skip
    monkeypatch.setenv("MESHNET_PORT", "8282")
    monkeypatch.setenv("MESHNET_HOST", "127.0.0.3")
    got = tracker("--config", str(path), "--host", "127.0.0.4")
    assert got.move_grace_s == 25.0 and got.models_dir == tmp_path
    assert got.queue_timeout_s == 12.0
    assert got.port == 8282 and got.host == "127.0.0.4"
    assert got.restart_grace_s == 60.0  # the default


def test_meshnet_config_env_names_the_file_and_the_flag_wins(tmp_path, monkeypatch):
    from_env = write(tmp_path, "yaml", {"port": 1111}, name="env")
    from_flag = write(tmp_path, "toml", {"port": 2222}, name="flag")
    monkeypatch.setenv("MESHNET_CONFIG", str(from_env))
    assert tracker().port == 1111
    assert tracker("--config", str(from_flag)).port == 2222


def test_an_empty_file_changes_nothing(tmp_path):
    for name in ("empty.yaml", "empty.toml"):
        (tmp_path / name).write_text("")
        assert node("--config", str(tmp_path / name)) == node()


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("n.yaml", "prot: 1\n", r"--config \S+n.yaml: unknown key 'prot' \(did you mean 'port'\?\)"),
        ("n.toml", "movable = true\n", r"--config \S+n.toml: unknown key 'movable'"),  # internal
        ("n.yaml", "port: eighty\n", r"--config \S+n.yaml: key 'port': .*valid integer"),
        ("n.toml", 'tracker-wait = "soon"\n', r"--config \S+n.toml: key 'tracker-wait': .*number"),
        ("n.yaml", "quantization: int3\n", r"key 'quantization': .*expected one of auto"),
        ("n.toml", 'reasoning_parser = "r2"\n', r"key 'reasoning_parser': .*deepseek_r1, qwen3 \(not 'r2'\)"),
        ("n.yaml", "tracker: a\ntracker_url: b\n", r"keys 'tracker' and 'tracker_url' set the same"),
        ("n.yaml", "port: [1\n", r"--config \S+n.yaml: not valid YAML: .*line"),
        ("n.toml", "port = \n", r"--config \S+n.toml: not valid TOML: .*line 1"),
        ("n.yaml", "- port\n- 1\n", r"--config \S+n.yaml: the file must be a mapping"),
        ("n.json", "{}", r"--config \S+n.json: not a .yaml, .yml or .toml file"),
    ],
)  # fmt: skip
def test_a_bad_file_is_one_line_naming_the_file_and_key(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        node("--config", str(path))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"--config \S+nope.yaml: no such file"):
        tracker("--config", str(tmp_path / "nope.yaml"))


def test_a_flag_or_env_error_still_names_the_flag(tmp_path, monkeypatch):
    path = write(tmp_path, "yaml", {"port": "eighty"})
    monkeypatch.setenv("MESHNET_PORT", "ninety")  # the env's value is the one validated
    with pytest.raises(ValueError, match=r"--port \[env MESHNET_PORT\]: .*integer"):
        node("--config", str(path))
    assert node("--config", str(path), "--port", "90").port == 90  # the flag wins: no error


@pytest.mark.parametrize("main", [node_main, tracker_main], ids=["node", "tracker"])
def test_cli_exits_2_with_one_line(tmp_path, capsys, main):
    path = write(tmp_path, "yaml", {"port": 1, "bogus_knob": 2})
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'bogus_knob'" in err and str(path) in err


@pytest.mark.parametrize("build", [tracker_parser, node_parser], ids=["tracker", "node"])
def test_help_shows_config_and_the_precedence(build):
    text = " ".join(build().format_help().split())
    assert "--config FILE" in text and "[env MESHNET_CONFIG]" in text
    assert "YAML" in text and "TOML" in text
    assert "a flag wins over its env var, the env over the file, the file over the default" in text


def test_the_deploy_examples_load():
    got = node("--config", str(ROOT / "deploy" / "node.yaml"))
    assert got.tracker_url and got.host == "0.0.0.0" and got.log_format == "json"
    assert got.cache_dir == Path("/var/lib/meshnet/cache")
    ran = tracker("--config", str(ROOT / "deploy" / "tracker.yaml"))
    assert ran.port == 8080 and ran.models_dir == Path("/var/lib/meshnet/models")
    assert ran.signing_key is not None and ran.log_format == "json"

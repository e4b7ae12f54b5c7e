"""One settings object per service: flags, ``MESHNET_*`` env and defaults, each knob
declared once (ADR-0014)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshnet_common.config.shard import ShardSettings
from meshnet_common.layers import LayerRange
from meshnet_node.cli import build_parser as node_parser
from meshnet_node.settings import NodeSettings
from meshnet_tracker.cli import build_parser as tracker_parser
from meshnet_tracker.settings import TrackerSettings


@pytest.fixture(autouse=True)
def _no_meshnet_env(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("MESHNET_")]:
        monkeypatch.delenv(name)


def node(*argv: str) -> NodeSettings:
    return NodeSettings.from_args(node_parser().parse_args(list(argv)))


def test_flags_win_over_env_and_env_over_defaults(monkeypatch):
    assert node().heartbeat_interval_s == 2.0
    monkeypatch.setenv("MESHNET_HEARTBEAT_INTERVAL", "3.5")  # env name follows the flag
    monkeypatch.setenv("MESHNET_KV_BUDGET_TOKENS", "1024")
    monkeypatch.setenv("MESHNET_DIRECT_ANSWERS", "false")
    got = node("--heartbeat-interval", "1.25")
    assert got.heartbeat_interval_s == 1.25 and got.kv_budget_tokens == 1024
    assert got.direct_answers is False
    assert node("--direct-answers").direct_answers is True


def test_every_knob_is_reachable_by_flag_and_env(monkeypatch):
    monkeypatch.setenv("MESHNET_SHARD_SOURCE", "http://127.0.0.1:1, http://127.0.0.1:2")
    monkeypatch.setenv("MESHNET_CACHE_DIR", "/tmp/meshnet-cache")
    monkeypatch.setenv("MESHNET_TURN_TIMEOUT", "7")
    got = node("--stream-ping", "0.5", "--max-frame-mb", "1", "--open-timeout", "2")
    assert got.shard_sources == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert got.cache_dir == Path("/tmp/meshnet-cache") and got.turn_timeout_s == 7.0
    assert (got.stream_ping_s, got.open_timeout_s, got.max_body_bytes) == (0.5, 2.0, 2**20)
    flags = node("--shard-source", "http://127.0.0.1:3", "--shard-source", "http://127.0.0.1:4")
    assert flags.shard_sources == ("http://127.0.0.1:3", "http://127.0.0.1:4")
    assert got.timeouts.connect == 5.0 and got.max_request_bytes == 8 * 2**20


def test_a_bad_env_value_names_its_flag_and_env(monkeypatch):
    monkeypatch.setenv("MESHNET_PORT", "eighty")
    with pytest.raises(ValueError, match=r"--port \[env MESHNET_PORT\]: .*integer"):
        node()
    monkeypatch.delenv("MESHNET_PORT")
    monkeypatch.setenv("MESHNET_HEARTBEAT_INTERVAL", "soon")
    with pytest.raises(
        ValueError, match=r"--heartbeat-interval \[env MESHNET_HEARTBEAT_INTERVAL\]"
    ):
        node()
    monkeypatch.delenv("MESHNET_HEARTBEAT_INTERVAL")
    monkeypatch.setenv("MESHNET_PROMPT_CALL_TOKENS", "0")  # a prompt's call: some rows
    with pytest.raises(ValueError, match=r"--prompt-call-tokens .*must be > 0"):
        node()


def test_a_bad_env_value_is_one_cli_line(monkeypatch):
    env = {"MESHNET_MAX_DECODE_BATCH": "many", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "meshnet_node.cli", "--model-id", "x/y"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--max-decode-batch [env MESHNET_MAX_DECODE_BATCH]" in lines[0]


def test_settings_are_frozen_and_replaced_by_copies():
    base = NodeSettings(model_id="a/b", layers=LayerRange(0, 2), model_path=Path("/x"))
    with pytest.raises(ValueError):
        base.port = 1  # type: ignore[misc]
    moved = base.with_shard("a/b", LayerRange(2, 4), Path("/y"))
    assert (moved.layers, moved.model_path, base.layers) == (LayerRange(2, 4), Path("/y"),
                                                             LayerRange(0, 2))  # fmt: skip
    with pytest.raises(ValueError):
        base.replace(max_decode_batch="lots")


def test_exactly_ignores_the_environment(monkeypatch):
    """The tracker node's node settings come from the tracker's, never from node env vars."""
    monkeypatch.setenv("MESHNET_TRACKER", "http://127.0.0.1:9")
    assert NodeSettings().tracker_url == "http://127.0.0.1:9"
    assert NodeSettings.exactly(model_id="a/b").tracker_url is None


def test_each_default_is_defined_once_and_shown_in_help():
    """The tracker node and a node share every shard knob and its default; --help shows the
    default of each field from the field itself."""
    for name in ShardSettings.model_fields:
        assert NodeSettings.model_fields[name].default == TrackerSettings.model_fields[name].default
    for build, cls in ((node_parser, NodeSettings), (tracker_parser, TrackerSettings)):
        parser = build()
        by_dest = {a.dest: a for a in parser._actions}
        for name, info in cls.flag_fields().items():
            meta = info.json_schema_extra or {}
            dest = (meta.get("flag") or "--" + name.replace("_", "-")).lstrip("-").replace("-", "_")
            action = by_dest[dest]
            if meta.get("hidden"):
                continue
            default = getattr(info.default, "value", info.default)
            if default not in (None, False, 0, (), ""):
                assert f"(default: {default})" in action.help, (name, action.help)


def tracker(*argv: str) -> TrackerSettings:
    return TrackerSettings.from_args(tracker_parser().parse_args(list(argv)))


def test_quantization_dtype_and_group_size(monkeypatch):
    """--quantization and --dtype default to auto (--dtype auto: float32 for a GGUF);
    --dtype picks the compute precision on its own; --quantization float32 stays the alias
    for float32 weights and compute."""
    from meshnet_common.precision import Precision

    got = node()
    assert (got.quantization, got.dtype, got.quant_group_size) == ("auto", "auto", 64)
    assert got.precision_for(None) is Precision.BFLOAT16
    assert got.compute_dtype_for(Precision.INT4) == "bfloat16"
    assert got.compute_dtype_for(Precision.INT4, gguf=True) == "float32"
    assert got.precision_for("fp8") is Precision.FP8  # a shipped format stays packed
    alias = node("--quantization", "float32")
    assert alias.precision_for(None) is Precision.FLOAT32
    assert alias.precision_for("mxfp4") is Precision.FLOAT32
    assert alias.compute_dtype_for(Precision.FLOAT32) == "float32"
    int4 = node("--quantization", "int4", "--dtype", "float32", "--quant-group-size", "32")
    assert int4.precision_for("fp8") is Precision.INT4 and int4.quant_group_size == 32
    assert int4.precision_fields(Precision.INT4, int4.compute_dtype_for(Precision.INT4)) == {
        "quantization": Precision.INT4, "dtype": "float32", "quant_group_size": 32,
    }  # fmt: skip
    assert (
        node("--quantization", "int8").precision_fields(Precision.INT8, "bfloat16")[
            "quant_group_size"
        ]
        is None
    )
    assert node("--dtype", "float32").precision_for(None) is Precision.FLOAT32
    monkeypatch.setenv("MESHNET_QUANTIZATION", "INT8")
    monkeypatch.setenv("MESHNET_DTYPE", "float32")
    monkeypatch.setenv("MESHNET_QUANT_GROUP_SIZE", "128")
    env = node()
    assert (env.quantization, env.dtype, env.quant_group_size) == ("int8", "float32", 128)
    assert tracker("--quantization", "int4").quantization == "int4"  # the tracker node's too


def test_quantization_flags_refuse_unknown_values(monkeypatch, capsys):
    from meshnet_common.errors import InvalidRequest

    for argv in (["--quantization", "int3"], ["--dtype", "float16"], ["--quant-group-size", "48"]):
        with pytest.raises(SystemExit):
            node(*argv)
    assert "invalid choice" in capsys.readouterr().err
    monkeypatch.setenv("MESHNET_QUANT_GROUP_SIZE", "48")
    with pytest.raises(ValueError, match=r"--quant-group-size \[env MESHNET_QUANT_GROUP_SIZE\]"):
        node()
    monkeypatch.delenv("MESHNET_QUANT_GROUP_SIZE")
    monkeypatch.setenv("MESHNET_DTYPE", "half")
    with pytest.raises(ValueError, match=r"--dtype \[env MESHNET_DTYPE\]"):
        node()
    monkeypatch.delenv("MESHNET_DTYPE")
    with pytest.raises(InvalidRequest, match="this checkpoint ships plain weights"):
        node("--quantization", "fp8").precision_for(None)


def test_help_lists_the_quantization_flags():
    for build in (node_parser, tracker_parser):
        text = build().format_help()
        assert "--quantization {auto,bfloat16,float32,int8,int4,nf4,fp8,mxfp4}" in text
        assert (
            "--dtype {auto,bfloat16,float32}" in text and "--quant-group-size {32,64,128}" in text
        )

"""A tracker whose models dir holds crafted files next to a good model: it starts, serves
the good one, says one line per crafted file, and scans off its event loop (issue 52)."""

from __future__ import annotations

import asyncio
import logging
import shutil

from crafted_models import (
    GOOD_SAFETENSORS,
    MOE_METADATA,
    gguf_file,
    safetensors_snapshot,
)
from fastapi.testclient import TestClient

from meshnet_tracker import state as tracker_state
from meshnet_tracker.app import create_app
from meshnet_tracker.settings import TrackerSettings

LLAMA = "meshnet-tiny/llama"
BIG = 1 << 40


def _hostile(models_dir) -> dict[str, str]:
    """The reported files, each in its own model folder: folder -> what is wrong."""
    evil = models_dir / "evil"
    hang = [("blk.0.ffn_gate_exps.weight", (0, 1, BIG), 0, 0)]
    gguf_file(evil / "hang" / "m.gguf", base=MOE_METADATA, tensors=hang)
    gguf_file(evil / "blocks" / "m.gguf", {"llama.block_count": BIG})
    gguf_file(evil / "align" / "m.gguf", {"general.alignment": 0})
    gguf_file(evil / "nohead" / "m.gguf", drop=("llama.attention.head_count",))
    big_heads = {"llama.attention.head_count": BIG, "llama.block_count": BIG}
    gguf_file(evil / "bigheads" / "m.gguf", big_heads)
    safetensors_snapshot(evil / "list", [1, 2], 128)
    safetensors_snapshot(evil / "offsets", {"a": {**GOOD_SAFETENSORS["model.embed_tokens.weight"],
                                                  "data_offsets": "ab"}}, 128)  # fmt: skip
    return {p.name: str(p) for p in evil.iterdir()}


def test_the_tracker_serves_the_good_model_and_names_each_crafted_file_once(
    tmp_path, tiny_snapshot, caplog, monkeypatch
):
    shutil.copytree(tiny_snapshot("llama"), tmp_path / LLAMA)
    safetensors_snapshot(tmp_path / "acme" / "small", GOOD_SAFETENSORS, 128)
    hostile = _hostile(tmp_path)
    scans_on_loop = _watch_scans(monkeypatch)
    settings = TrackerSettings(models_dir=tmp_path, verify_nodes=False, models_rescan_s=0)
    caplog.set_level(logging.INFO, logger="meshnet_tracker")
    with TestClient(create_app(settings, node=None)) as tracker:
        assert tracker.get("/health").json()["status"] == "ok"
        models = {m["id"]: m for m in tracker.get("/v1/coverage").json()["models"]}
        assert set(models) == {LLAMA, "acme/small"}
        assert models[LLAMA]["num_layers"] == 6
        ask = {"node_id": "n1", "memory_bytes": 1 << 30, "device": "cpu", "kv_tokens": 256}
        for _ in range(3):  # each assignment rescans: on a worker thread, crafted files
            resp = tracker.post("/v1/nodes/assign", json=ask)  # read once (cached)
            assert resp.status_code == 200, resp.text
            assert resp.json()["shard"]["model_id"] in models
        assert tracker.get("/health").json()["status"] == "ok"
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for folder, path in hostile.items():
        naming = [line for line in lines if path in line]
        assert len(naming) == 1, (folder, naming)
        assert "\n" not in naming[0]
    assert scans_on_loop[0] is False  # at start, before the loop runs: no loop to block
    assert scans_on_loop[1:] == [False] * 3  # the assignments' scans ran on a worker thread


def _watch_scans(monkeypatch) -> list[bool]:
    """Whether each models-dir scan ran on a thread with a running event loop."""
    on_loop: list[bool] = []
    real_scan = tracker_state.scan_models_dir

    def watched(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(tracker_state, "scan_models_dir", watched)
    return on_loop


def test_an_assignment_scans_the_models_dir_on_a_worker_thread(tmp_path, monkeypatch):
    safetensors_snapshot(tmp_path / "acme" / "small", GOOD_SAFETENSORS, 128)
    on_loop = _watch_scans(monkeypatch)
    settings = TrackerSettings(models_dir=tmp_path, verify_nodes=False, models_rescan_s=0)
    with TestClient(create_app(settings, node=None)) as tracker:
        ask = {"node_id": "n1", "memory_bytes": 1 << 30, "device": "cpu", "kv_tokens": 256}
        assert tracker.post("/v1/nodes/assign", json=ask).status_code == 200
    assert on_loop == [False, False]  # at start (no loop yet), then the assignment's


def test_a_burst_of_rescans_costs_two_scans_and_a_failed_scan_one_line(
    tmp_path, monkeypatch, caplog
):
    safetensors_snapshot(tmp_path / "acme" / "small", GOOD_SAFETENSORS, 128)
    settings = TrackerSettings(models_dir=tmp_path, verify_nodes=False, models_rescan_s=0)
    state = create_app(settings, node=None).state.tracker
    on_loop = _watch_scans(monkeypatch)

    async def burst() -> None:
        await asyncio.gather(*(state.rescan() for _ in range(8)))

    asyncio.run(burst())
    assert on_loop == [False, False]  # the first, and one for all who came during it

    def broken(*_args, **_kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(tracker_state, "scan_models_dir", broken)
    asyncio.run(state.rescan())
    failed = [r.getMessage() for r in caplog.records if "disk on fire" in r.getMessage()]
    assert len(failed) == 1 and "\n" not in failed[0]
    assert "acme/small" in state.costs  # what the last good scan found is kept

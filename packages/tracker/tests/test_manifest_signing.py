"""The tracker signs every weight manifest with its own key, which it serves to nodes and
keeps across restarts in --signing-key (docs/adr/0032)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from meshnet_common.errors import InvalidRequest
from meshnet_common.trust.manifest_keys import (
    H_MANIFEST_SIGNATURE,
    KEY_PATH,
    ManifestKey,
    ManifestSigner,
)
from meshnet_common.web import serve
from meshnet_tracker import cli
from meshnet_tracker.app import create_app
from meshnet_tracker.settings import TrackerSettings


def test_manifests_carry_the_trackers_signature(tiny_snapshot, tiny_model_id, tmp_path):
    models = tiny_snapshot("llama").parent.parent
    key_file = tmp_path / "tracker.key"
    settings = TrackerSettings(models_dir=models, signing_key=key_file)
    params = {"model": tiny_model_id("llama"), "start": 0, "end": 2}
    with TestClient(create_app(settings, node=None)) as client:
        served = client.get(KEY_PATH).json()
        key = ManifestKey.from_text(served["public_key"])
        assert served["algorithm"] == "ed25519"
        resp = client.get("/v1/shards/manifest", params=params)
        assert resp.status_code == 200
        assert key.manifest_problem(resp.content, resp.headers[H_MANIFEST_SIGNATURE]) is None
        assert key.manifest_problem(resp.content + b" ", resp.headers[H_MANIFEST_SIGNATURE])
    assert key_file.exists()
    with TestClient(create_app(settings, node=None)) as client:  # restarted: the same key
        assert client.get(KEY_PATH).json()["public_key"] == key.text
    with TestClient(create_app(TrackerSettings(models_dir=models), node=None)) as client:
        assert client.get(KEY_PATH).json()["public_key"] != key.text  # no file: a new one


def test_a_signing_key_file_others_may_read_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    key_file = tmp_path / "tracker.key"
    ManifestSigner.from_file(key_file)  # created 0600
    assert ManifestSigner.from_file(key_file).public().text  # 0600 (and 0400) are fine
    for mode in (0o644, 0o640, 0o604, 0o620):
        key_file.chmod(mode)
        with pytest.raises(InvalidRequest, match="chmod 600"):
            ManifestSigner.from_file(key_file)
    key_file.chmod(0o640)

    def served(*_args, **_kwargs):
        raise AssertionError("the tracker started with a key others may read")

    monkeypatch.setattr(serve, "run", served)
    with pytest.raises(SystemExit) as exited:
        cli.main(["--signing-key", str(key_file), "--port", "0"])
    assert exited.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--signing-key" in err[0] and "0640" in err[0]

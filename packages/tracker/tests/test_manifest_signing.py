"""The tracker signs every weight manifest with its own key, which it serves to nodes and
keeps across restarts in --signing-key (docs/adr/0032)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from meshnet_common.trust.manifest_keys import H_MANIFEST_SIGNATURE, KEY_PATH, ManifestKey
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
        assert key.verify(resp.content, resp.headers[H_MANIFEST_SIGNATURE])
        assert not key.verify(resp.content + b" ", resp.headers[H_MANIFEST_SIGNATURE])
    assert key_file.exists()
    with TestClient(create_app(settings, node=None)) as client:  # restarted: the same key
        assert client.get(KEY_PATH).json()["public_key"] == key.text
    with TestClient(create_app(TrackerSettings(models_dir=models), node=None)) as client:
        assert client.get(KEY_PATH).json()["public_key"] != key.text  # no file: a new one

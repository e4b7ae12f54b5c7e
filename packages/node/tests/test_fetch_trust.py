"""Weight integrity (docs/adr/0032): one root of trust for manifests, the tracker's key.

Real shard servers (the tracker's, signing; a peer's, not signing) over in-memory HTTP: the
node takes manifests from the tracker only, checks its signature, never falls back to a
peer's manifest, and hashes a cached shard again before using it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from meshnet_common.errors import ModelError, NotFound
from meshnet_common.layers import LayerRange
from meshnet_common.models.shardfiles import MANIFEST_FILE, SUBSET_FILE
from meshnet_common.tiny.snapshots import make_tiny
from meshnet_common.trust.manifest_keys import (
    ALGORITHM,
    KEY_PATH,
    MANIFEST_LIFETIME_S,
    ManifestSigner,
)
from meshnet_common.web.http import install_error_handlers
from meshnet_common.web.shards import ShardServer, shards_router
from meshnet_node.swarm import fetch
from meshnet_node.swarm.fetch import Trust, cached_shard, fetch_shard

MODEL = "meshnet-tiny/llama"
TRACKER, PEER = "http://tracker.test", "http://peer.test"
LAYERS = LayerRange(2, 4)


def shard_app(snapshot: Path | None, signer: ManifestSigner | None = None, **kw) -> FastAPI:
    def resolve(model_id: str) -> Path:
        if snapshot is None or model_id != MODEL:
            raise NotFound(model_id)
        return snapshot

    app = FastAPI()
    install_error_handlers(app)
    app.state.shards = ShardServer(resolve, signer=signer, **kw)
    app.include_router(shards_router())
    if signer is not None:

        @app.get(KEY_PATH)
        def key():
            return {"algorithm": ALGORITHM, "public_key": signer.public().text}

    return app


class Hosts:
    """In-memory HTTP to FastAPI apps by origin; counts the downloads each one served."""

    def __init__(self, **apps: FastAPI) -> None:
        self.apps = {f"http://{name}.test": TestClient(app) for name, app in apps.items()}
        self.downloads: dict[str, int] = dict.fromkeys(self.apps, 0)

    def handle(self, request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}"
        if origin not in self.apps:
            raise httpx.ConnectError("unreachable", request=request)
        if request.url.path.endswith("/download"):
            self.downloads[origin] += 1
        resp = self.apps[origin].request(
            request.method, request.url.path, params=request.url.params,
            headers={k: v for k, v in request.headers.items() if k in ("range",)},
        )  # fmt: skip
        return httpx.Response(resp.status_code, headers=resp.headers, content=resp.content)


@pytest.fixture
def use(monkeypatch):
    def install(**apps: FastAPI) -> Hosts:
        hosts = Hosts(**apps)
        monkeypatch.setattr(
            Trust, "client",
            lambda self, timeout=60.0: httpx.Client(transport=httpx.MockTransport(hosts.handle)),
        )  # fmt: skip
        return hosts

    return install


@pytest.fixture
def snapshot(tiny_snapshot) -> Path:
    return tiny_snapshot("llama")


def test_bytes_from_a_peer_are_checked_against_the_trackers_signed_manifest(
    use, snapshot, tmp_path
):
    signer = ManifestSigner.generate()
    hosts = use(tracker=shard_app(snapshot, signer), peer=shard_app(snapshot))
    trust = Trust(tracker=TRACKER)  # the key is asked of the tracker
    path = fetch_shard(MODEL, LAYERS, (PEER,), tmp_path, trust=trust, hub=False)
    assert (path / SUBSET_FILE).exists() and hosts.downloads[PEER] > 0
    assert hosts.downloads[TRACKER] == 0  # only the manifest came from the tracker
    pinned = Trust(tracker=TRACKER, tracker_key=signer.public().text)
    assert cached_shard(tmp_path, MODEL, LAYERS) == path
    assert fetch_shard(MODEL, LAYERS, (PEER,), tmp_path, trust=pinned, hub=False) == path


def test_a_dead_tracker_of_the_swarm_gives_way_to_the_next_for_the_key_and_manifest(
    use, snapshot, tmp_path
):
    """--tracker URL1,URL2: the first down, the second (same swarm key) signs the manifest;
    weights fetched from the trackers come from the one that answers."""
    signer = ManifestSigner.generate()
    hosts = use(second=shard_app(snapshot, signer))  # tracker.test refuses connections
    trust = Trust(tracker=f"{TRACKER},http://second.test")
    path = fetch_shard(MODEL, LAYERS, trust.trackers.in_order(), tmp_path, trust=trust, hub=False)
    assert (path / SUBSET_FILE).exists() and hosts.downloads["http://second.test"] > 0
    assert trust.trackers.current == "http://second.test"
    other = use(second=shard_app(snapshot, ManifestSigner.generate()))  # a key of its own
    pinned = Trust(tracker=f"{TRACKER},http://second.test", tracker_key=signer.public().text)
    with pytest.raises(ModelError, match="signature"):
        fetch_shard(MODEL, LAYERS, (PEER,), tmp_path / "again", trust=pinned, hub=False)
    assert other.downloads["http://second.test"] == 0


def test_a_peers_own_manifest_is_never_taken_in_the_trackers_place(use, snapshot, tmp_path):
    # The tracker has no files of the model: a peer could send anything with a manifest of
    # its own making. Nothing is fetched.
    hosts = use(tracker=shard_app(None, ManifestSigner.generate()), peer=shard_app(snapshot))
    with pytest.raises(ModelError, match="has no manifest"):
        fetch_shard(MODEL, LAYERS, (PEER,), tmp_path, trust=Trust(tracker=TRACKER), hub=False)
    assert hosts.downloads[PEER] == 0
    assert not list(tmp_path.rglob(MANIFEST_FILE))
    # The tracker unreachable: the same.
    use(peer=shard_app(snapshot))
    with pytest.raises(ModelError, match="unreachable"):
        fetch_shard(MODEL, LAYERS, (PEER,), tmp_path, trust=Trust(tracker=TRACKER), hub=False)


def test_an_unsigned_or_foreign_signed_manifest_is_refused(use, snapshot, tmp_path):
    other = ManifestSigner.generate().public().text
    use(tracker=shard_app(snapshot, ManifestSigner.generate()))
    pinned = Trust(tracker=TRACKER, tracker_key=other)  # someone answering as the tracker
    with pytest.raises(ModelError, match="not the tracker's"):
        fetch_shard(MODEL, LAYERS, (TRACKER,), tmp_path, trust=pinned, hub=False)
    # A shard server that signs nothing (a node's) cannot stand in for the tracker.
    use(tracker=shard_app(snapshot))
    with pytest.raises(ModelError, match="no key|signature"):
        fetch_shard(MODEL, LAYERS, (TRACKER,), tmp_path, trust=Trust(tracker=TRACKER), hub=False)
    with pytest.raises(ModelError, match="signature"):
        fetch_shard(MODEL, LAYERS, (TRACKER,), tmp_path, trust=Trust(tracker=TRACKER,
                    tracker_key=other), hub=False)  # fmt: skip
    assert not list(tmp_path.rglob(MANIFEST_FILE))


class _StaleSigner:
    """The tracker's key signing as it did two manifest lifetimes ago: a replayed manifest."""

    def __init__(self) -> None:
        self.signer = ManifestSigner.generate()
        self.public = self.signer.public

    def sign_manifest(self, body: bytes) -> str:
        return self.signer.sign_manifest(body, now=time.time() - 2 * MANIFEST_LIFETIME_S)


def test_an_expired_manifest_signature_is_refused(use, snapshot, tmp_path):
    stale = _StaleSigner()
    use(tracker=shard_app(snapshot, stale))
    pinned = Trust(tracker=TRACKER, tracker_key=stale.public().text)
    with pytest.raises(ModelError, match="expired"):
        fetch_shard(MODEL, LAYERS, (TRACKER,), tmp_path, trust=pinned, hub=False)
    assert not list(tmp_path.rglob(MANIFEST_FILE))
    # the expiry is signed: moving it on breaks the signature
    key, body = stale.public(), b'{"a":1}'
    header = stale.signer.sign_manifest(body, now=1000)
    assert key.manifest_problem(body, header, now=1000) is None
    assert "expired" in key.manifest_problem(body, header, now=1000 + MANIFEST_LIFETIME_S + 121)
    later = f"{int(header.split('.')[0]) + 10**6}.{header.split('.', 1)[1]}"
    assert "not the tracker's" in key.manifest_problem(body, later, now=1000)
    for junk in (None, "", "²³.abc", "123", "x.y"):
        assert key.manifest_problem(body, junk, now=1000) is not None


def test_without_a_tracker_the_named_source_is_trusted(use, snapshot, tmp_path):
    use(peer=shard_app(snapshot))
    path = fetch_shard(MODEL, LAYERS, (PEER,), tmp_path, trust=Trust(), hub=False)
    assert (path / MANIFEST_FILE).exists()


def test_a_cached_shard_is_hashed_again_before_use(use, snapshot, tmp_path):
    hosts = use(tracker=shard_app(snapshot, ManifestSigner.generate()))
    trust = Trust(tracker=TRACKER)
    path = fetch_shard(MODEL, LAYERS, (TRACKER,), tmp_path, trust=trust, hub=False)
    good = (path / SUBSET_FILE).read_bytes()
    fetched = hosts.downloads[TRACKER]
    # Same size, one byte flipped (a rotting disk, an edit): not used, fetched again.
    rotten = bytearray(good)
    rotten[len(rotten) // 2] ^= 0xFF
    (path / SUBSET_FILE).write_bytes(bytes(rotten))
    assert cached_shard(tmp_path, MODEL, LAYERS) is None
    assert fetch_shard(MODEL, LAYERS, (TRACKER,), tmp_path, trust=trust, hub=False) == path
    assert (path / SUBSET_FILE).read_bytes() == good
    assert hosts.downloads[TRACKER] > fetched


def test_a_cached_shard_of_another_revision_is_not_used(use, snapshot, tmp_path):
    trust = Trust(tracker=TRACKER)
    use(tracker=shard_app(snapshot, ManifestSigner.generate()))
    path = fetch_shard(MODEL, LAYERS, (TRACKER,), tmp_path, trust=trust, hub=False)
    old = (path / SUBSET_FILE).read_bytes()
    # The tracker now serves other weights under the same id: the cache is stale.
    other = make_tiny(tmp_path / "models", "llama", MODEL, seed=7)
    hosts = use(tracker=shard_app(other, ManifestSigner.generate()))
    assert cached_shard(tmp_path, MODEL, LAYERS) == path  # intact on its own terms
    assert fetch_shard(MODEL, LAYERS, (TRACKER,), tmp_path, trust=trust, hub=False) == path
    assert hosts.downloads[TRACKER] > 0 and (path / SUBSET_FILE).read_bytes() != old


def test_a_peer_holding_another_revision_sends_no_byte(use, snapshot, tmp_path):
    # The peer's copy has another config (another revision): each download names the
    # tracker's revision, so the peer refuses it and the next source serves the shard.
    other = tmp_path / "other"
    shutil.copytree(snapshot, other)
    config = other / "config.json"
    config.write_text(config.read_text().replace("{", '{"meshnet_edit": 1,', 1))
    hosts = use(tracker=shard_app(snapshot, ManifestSigner.generate()), peer=shard_app(other))
    trust = Trust(tracker=TRACKER)
    path = fetch_shard(MODEL, LAYERS, (PEER, TRACKER), tmp_path / "cache", trust=trust, hub=False)
    assert hosts.downloads[PEER] == 1  # the first file's request, answered 404
    assert hosts.downloads[TRACKER] > 0 and (path / MANIFEST_FILE).exists()


def test_without_a_tracker_a_pinned_commit_is_asked_of_the_source(use, snapshot, tmp_path):
    held, other = "a" * 40, "b" * 40
    commit = tmp_path / "hub" / "snapshots" / held  # the HF cache's layout: a commit folder
    shutil.copytree(snapshot, commit)
    hosts = use(peer=shard_app(commit))
    with pytest.raises(ModelError, match="no manifest"):
        fetch_shard(MODEL, LAYERS, (PEER,), tmp_path / "c", trust=Trust(), hub=False,
                    revision=other)  # fmt: skip
    assert hosts.downloads[PEER] == 0
    path = fetch_shard(MODEL, LAYERS, (PEER,), tmp_path / "c", trust=Trust(), hub=False,
                       revision=held)  # fmt: skip
    assert json.loads((path / MANIFEST_FILE).read_text())["revision"] == held


def test_the_signing_key_file_persists_and_a_bad_pin_is_refused(tmp_path):
    key_file = tmp_path / "tracker.key"
    first = ManifestSigner.from_file(key_file)
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert ManifestSigner.from_file(key_file).public() == first.public()
    body = b'{"a":1}'
    assert first.public().verify(body, first.sign(body))
    assert not first.public().verify(b'{"a":2}', first.sign(body))
    assert not first.public().verify(body, "not base64!")
    with pytest.raises(fetch.FetchError, match="no key"):
        fetch.tracker_key(httpx.Client(), Trust(tracker=TRACKER, tracker_key="xyz"))
    shutil.copy(key_file, tmp_path / "copy")
    assert ManifestSigner.from_file(tmp_path / "copy").public() == first.public()

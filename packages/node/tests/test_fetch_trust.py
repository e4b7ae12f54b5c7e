"""Manifests come from the trusted tracker, and can be pinned with a signing key."""

from __future__ import annotations

import httpx
import pytest

from meshnet_common.models.shardfiles import H_MANIFEST_SIGNATURE, canonical_json, sign_manifest
from meshnet_node.swarm.fetch import FetchError, Trust, get_manifest

TRACKER = "http://tracker.test"
PEER = "http://peer.test"
GOOD = {"model_id": "a/b", "revision": "r1", "files": [], "shard_start": 0, "shard_end": 1}
FORGED = {**GOOD, "revision": "evil"}


def client(manifests: dict[str, dict], key: str | None = None, signer: str | None = None):
    def handler(request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}"
        if origin not in manifests:
            return httpx.Response(404, json={"error": {"message": "no"}})
        body = canonical_json(manifests[origin])
        headers = {H_MANIFEST_SIGNATURE: sign_manifest(body, signer)} if signer else {}
        return httpx.Response(200, content=body, headers=headers)

    return httpx.Client(transport=httpx.MockTransport(handler))


PARAMS = {"model": "a/b", "start": 0, "end": 1}


def test_the_tracker_manifest_wins_over_the_peer():
    with client({TRACKER: GOOD, PEER: FORGED}) as c:
        assert get_manifest(c, PEER, PARAMS, Trust(tracker=TRACKER)) == GOOD
        # Without a tracker to ask, the source's own manifest is all there is.
        assert get_manifest(c, PEER, PARAMS, Trust()) == FORGED


def test_peer_manifest_is_used_only_when_the_tracker_lacks_the_model():
    with client({PEER: GOOD}) as c:
        assert get_manifest(c, PEER, PARAMS, Trust(tracker=TRACKER)) == GOOD


def test_signature_is_required_and_checked():
    with client({TRACKER: GOOD}, signer="k1") as c:
        assert get_manifest(c, TRACKER, PARAMS, Trust(tracker=TRACKER, manifest_key="k1")) == GOOD
        with pytest.raises(FetchError, match="signature"):
            get_manifest(c, TRACKER, PARAMS, Trust(tracker=TRACKER, manifest_key="other"))
    with client({TRACKER: GOOD}) as c, pytest.raises(FetchError, match="signature"):
        get_manifest(c, TRACKER, PARAMS, Trust(tracker=TRACKER, manifest_key="k1"))

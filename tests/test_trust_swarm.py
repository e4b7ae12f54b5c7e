"""Trust against a member, with real processes (docs/adr/0032): a swarm-token holder can
neither take over a node's id, nor quarantine or remove the tracker node, nor lift a
quarantine; a tracker or node listening beyond loopback without a token refuses to start."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from swarm_harness import covered, wait_for

from meshnet_common.protocol import H_SWARM_TOKEN, Heartbeat, NodeAnnouncement, NodeState
from meshnet_common.trust.identity import Identity, issue
from meshnet_common.trust.manifest_keys import ManifestSigner
from meshnet_node.swarm.membership import Membership

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "meshnet-tiny/llama"
TOKEN = {H_SWARM_TOKEN: "swarm-secret-35"}
F32 = ("--quantization", "float32")


def _nodes(tracker) -> dict[str, dict]:
    dash = httpx.get(f"{tracker.url}/v1/dashboard", headers=TOKEN, timeout=5).json()
    return {n["node_id"]: n for n in dash["nodes"]}


def test_a_token_holder_cannot_take_over_quarantine_or_remove_members(tiny_snapshot, swarm_factory):
    tiny_snapshot("llama")
    swarm = swarm_factory()
    auth = ("--swarm-token", TOKEN[H_SWARM_TOKEN])
    tracker = swarm.tracker(
        *auth, "--model-id", MODEL, "--shard-start", "0", "--shard-end", "3", *F32,
        "--operator-token", "op-35",
    ).wait_healthy()  # fmt: skip
    tail = swarm.node(tracker, MODEL, 3, 6, *auth, "--node-id", "tail", *F32).wait_healthy()
    wait_for(lambda: covered(tracker, MODEL), timeout=60)
    base = f"{tracker.url}/v1/nodes"

    # Take over the tail's id (as joining: no call-back) and beat as serving: refused.
    thief = {
        "node_id": "tail", "url": "http://127.0.0.1:9", "num_layers": 6, "device": "cpu",
        "shard": {"model_id": MODEL, "shard_start": 3, "shard_end": 6},
        "quantization": "float32", "memory_declared_bytes": 1, "memory_free_bytes": 1,
        "state": "joining",
    }  # fmt: skip
    taken = httpx.post(f"{base}/register", json=thief, headers=TOKEN, timeout=5)
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "node_id_taken"
    beat = {"node_id": "tail", "state": "serving", "active_sessions": 0, "kv_tokens": 0,
            "memory_free_bytes": 1}  # fmt: skip
    assert httpx.post(f"{base}/heartbeat", json=beat, headers=TOKEN, timeout=5).status_code == 401
    assert _nodes(tracker)["tail"]["url"] == tail.url

    # Verdicts with and without the token, any number of them: nobody is quarantined.
    verdict = {"model_id": MODEL, "reporter": "tail", "shard_start": 0, "shard_end": 3,
               "error": 1.0, "tolerance": 1e-3, "witnesses": ["tail"]}  # fmt: skip
    for headers in ({}, TOKEN, TOKEN):
        resp = httpx.post(f"{base}/tracker-node/verdicts", json=verdict, headers=headers)
        assert resp.status_code == 401
    assert {n["state"] for n in _nodes(tracker).values()} == {"serving"}

    # Removing the tracker node or the tail, lifting a quarantine: the operator's calls.
    for path in ("/tracker-node", "/tail", "/tail/quarantine"):
        assert httpx.delete(f"{base}{path}", headers=TOKEN, timeout=5).status_code == 401
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}
    done = httpx.post(f"{tracker.url}/v1/completions", json=body, headers=TOKEN, timeout=60)
    assert done.status_code == 200, done.text

    # Node-to-node routes take calls signed by a certified node only (docs/adr/0032): the
    # completion above crossed tracker node -> tail on a signed hop stream.
    forward = f"{tail.url}/v1/forward"
    unsigned = httpx.post(forward, content=b"", headers=TOKEN, timeout=5)
    assert unsigned.status_code == 401
    assert "swarm nodes only" in unsigned.json()["error"]["message"]
    forged = Identity()
    forged.adopt(issue(ManifestSigner.generate(), "tracker-node", forged.key.public))
    host = tail.url.split("://", 1)[1]
    resp = httpx.post(forward, content=b"", timeout=5,
                      headers={**TOKEN, **forged.headers("POST", host, "/v1/forward")})  # fmt: skip
    assert resp.status_code == 401 and "not the tracker's" in resp.json()["error"]["message"]
    # a member registered as joining (no call-back) gets no certificate: its calls to peers
    # go unsigned and are refused; the tail, called back as serving, holds one
    member = Identity()
    joined = httpx.post(f"{base}/register", timeout=5, headers=TOKEN, json={
        **thief, "node_id": "member-x", "public_key": member.key.public})  # fmt: skip
    assert joined.status_code == 200, joined.text
    assert joined.json()["tracker_key"] == httpx.get(f"{tracker.url}/v1/tracker/key").json()[
        "public_key"]  # fmt: skip
    assert joined.json()["certificate"] is None
    member.adopt(joined.json()["certificate"])
    resp = httpx.post(forward, content=b"", timeout=5,
                      headers={**TOKEN, **member.headers("POST", host, "/v1/forward")})  # fmt: skip
    assert resp.status_code == 401

    # The tail still heartbeats with its own secret, and leaves with it on shutdown.
    assert _nodes(tracker)["tail"]["state"] == "serving"
    tail.popen.terminate()
    tail.popen.wait(timeout=60)
    wait_for(lambda: "tail" not in _nodes(tracker), timeout=10)
    assert "could not deregister" not in tail.log()


@pytest.mark.parametrize("module", ["meshnet_tracker.cli", "meshnet_node.cli"])
def test_listening_beyond_loopback_needs_a_swarm_token_or_insecure(module):
    args = [sys.executable, "-m", module, "--host", "0.0.0.0", "--port", "1"]
    if module == "meshnet_node.cli":
        args += ["--tracker", "http://127.0.0.1:1"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode != 0
    [line] = done.stderr.strip().splitlines()[-1:]
    assert "--swarm-token" in line and "--insecure" in line and "0.0.0.0" in line


def test_a_restarted_node_that_lost_its_secret_gets_its_id_back_after_expiry(swarm_factory):
    """Membership against a real tracker: the first process stops without leaving (killed);
    the second, with the same id and no secret, is told ``node_id_taken`` and retries until
    the old record misses its heartbeats and expires."""
    swarm = swarm_factory(heartbeat_s=0.3)
    tracker = swarm.tracker().wait_healthy()
    ann = NodeAnnouncement.model_validate({
        "node_id": "phoenix", "url": "http://127.0.0.1:9", "num_layers": 6, "device": "cpu",
        "shard": {"model_id": MODEL, "shard_start": 0, "shard_end": 6},
        "quantization": "float32", "memory_declared_bytes": 1, "memory_free_bytes": 1,
        "state": "joining",
    })  # fmt: skip
    beat = Heartbeat(node_id="phoenix", state=NodeState.JOINING, active_sessions=0,
                     kv_tokens=0, memory_free_bytes=1)  # fmt: skip
    first = Membership(tracker.url, lambda: ann, lambda: beat, 0.3)
    first.register_once()
    old = first.secret
    first.start()
    second = Membership(tracker.url, lambda: ann, lambda: beat, 0.3)
    try:
        with pytest.raises(ValueError, match="missed heartbeats"):
            second.register_once()  # the first one still beats: its id is held
        first.stop(deregister=False)  # killed: no leave
        assert second.register_until_accepted()  # once the old record expires
        assert second.secret and second.secret != old
        assert second.beat().known is True
        first_beat = httpx.post(f"{tracker.url}/v1/nodes/heartbeat", content=beat.model_dump_json(),
                                headers={"x-meshnet-node-secret": old}, timeout=5)  # fmt: skip
        assert first_beat.status_code == 401  # the old secret died with the old record
    finally:
        second.stop()


def test_a_remote_heads_verdicts_carry_its_node_secret(tiny_snapshot, swarm_factory):
    """A head that is not the tracker node audits with --verify-fraction 1 and reports the
    faulty replica as itself (its node secret): the tracker counts it and quarantines."""
    tiny_snapshot("llama")
    swarm = swarm_factory()
    tracker = swarm.tracker("--quarantine-after", "1").wait_healthy()
    swarm.node(tracker, MODEL, 0, 2, "--node-id", "head", "--verify-fraction", "1",
               *F32).wait_healthy()  # fmt: skip
    swarm.node(tracker, MODEL, 4, 6, "--node-id", "tail", *F32).wait_healthy()
    swarm.node(tracker, MODEL, 2, 4, "--node-id", "mid-ok", *F32).wait_healthy()
    swarm.node(tracker, MODEL, 2, 4, "--node-id", "mid-bad", "--test-only-perturb", "0.5",
               *F32).wait_healthy()  # fmt: skip
    wait_for(lambda: covered(tracker, MODEL) and len(_nodes(tracker)) == 4, timeout=60)
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    for _ in range(12):
        if _nodes(tracker)["mid-bad"]["state"] == "quarantined":
            break
        httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=60)
    assert _nodes(tracker)["mid-bad"]["state"] == "quarantined"
    assert _nodes(tracker)["mid-ok"]["state"] == "serving"
    assert "node_unauthenticated" not in "".join(p.log() for p in swarm.procs)

"""Node identities (docs/adr/0032): a tracker certificate over a node's key, calls signed
with it, checked with the tracker key alone; the auth middleware attributes or refuses."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from meshnet_common.protocol import H_SWARM_TOKEN
from meshnet_common.trust.identity import (
    CERT_LIFETIME_S,
    H_NODE_CALL,
    H_NODE_CERT,
    MAX_SKEW_S,
    CallChecker,
    Identity,
    IdentityError,
    issue,
)
from meshnet_common.trust.manifest_keys import ManifestSigner
from meshnet_common.web.auth import PEER_SCOPE_KEY, install_auth

TRACKER = ManifestSigner.generate()
HOST, TARGET = "127.0.0.1:9000", "/v1/forward"


def _certified(node_id: str = "node-a", signer: ManifestSigner = TRACKER) -> Identity:
    identity = Identity()
    identity.adopt(issue(signer, node_id, identity.key.public))
    return identity


def test_a_certified_call_names_its_node_and_nothing_else_passes():
    checker = CallChecker(TRACKER.public())
    identity = _certified()
    assert len(identity.key.public) == 43  # what NodeAnnouncement.public_key takes
    headers = identity.headers("POST", HOST, TARGET)
    assert checker.caller("POST", HOST, TARGET, headers) == "node-a"
    assert checker.caller("POST", HOST, TARGET, {}) is None  # unsigned: not attributed
    # the same signature for another method, peer or target: refused (no relaying)
    for method, host, target in (("GET", HOST, TARGET), ("POST", "127.0.0.1:9001", TARGET),
                                 ("POST", HOST, "/v1/sessions/s")):  # fmt: skip
        with pytest.raises(IdentityError, match="not signed"):
            checker.caller(method, host, target, headers)
    with pytest.raises(IdentityError, match="both"):
        checker.caller("POST", HOST, TARGET, {H_NODE_CERT: headers[H_NODE_CERT]})


def test_a_certificate_from_another_key_or_altered_is_refused():
    checker = CallChecker(TRACKER.public())
    forged = _certified(signer=ManifestSigner.generate()).headers("POST", HOST, TARGET)
    with pytest.raises(IdentityError, match="not the tracker's"):
        checker.caller("POST", HOST, TARGET, forged)
    # another node's key under node-a's certificate: the call's signature fails
    mine, theirs = _certified("node-a"), _certified("node-b")
    mixed = {**theirs.headers("POST", HOST, TARGET), H_NODE_CERT: mine.certificate}
    with pytest.raises(IdentityError, match="not signed by 'node-a'"):
        checker.caller("POST", HOST, TARGET, mixed)
    # renaming the id inside the certificate breaks the tracker's signature
    parts = mine.certificate.split(".")
    parts[1] = "bm9kZS1i"  # "node-b"
    renamed = {**mine.headers("POST", HOST, TARGET), H_NODE_CERT: ".".join(parts)}
    with pytest.raises(IdentityError, match="not the tracker's"):
        checker.caller("POST", HOST, TARGET, renamed)
    for junk in ("", "v1", "v2.a.b.1.c", "v1.!!.b.1.c", "x" * 600):
        with pytest.raises(IdentityError):
            checker.caller("POST", HOST, TARGET, {H_NODE_CERT: junk, H_NODE_CALL: "1.x"})
    with pytest.raises(IdentityError, match="does not know"):  # no tracker key yet
        CallChecker().caller("POST", HOST, TARGET, mine.headers("POST", HOST, TARGET))


def test_expired_certificates_and_stale_calls_are_refused():
    identity = _certified()
    headers = identity.headers("POST", HOST, TARGET)
    when = int(headers[H_NODE_CALL].split(".")[0])
    late = CallChecker(TRACKER.public(), clock=lambda: when + MAX_SKEW_S + 1)
    with pytest.raises(IdentityError, match="too far"):
        late.caller("POST", HOST, TARGET, headers)
    expired = CallChecker(TRACKER.public(), clock=lambda: when + CERT_LIFETIME_S + MAX_SKEW_S + 2)
    with pytest.raises(IdentityError, match="expired"):
        expired.caller("POST", HOST, TARGET, headers)
    assert Identity().headers("POST", HOST, TARGET) == {}  # no certificate yet: unsigned


def _app(checker: CallChecker) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/forward")
    async def forward(request: Request) -> dict:
        body = (await request.body()).decode()
        return {"peer": request.scope.get(PEER_SCOPE_KEY), **({"body": body} if body else {})}

    @app.get("/v1/shards/x")
    async def shards(request: Request) -> dict:
        return {"peer": request.scope.get(PEER_SCOPE_KEY)}

    install_auth(app, swarm_token="tok", api_key=None, peers=checker)
    return app


def test_the_middleware_attributes_signed_calls_and_refuses_unsigned_node_calls():
    checker = CallChecker()
    client = TestClient(_app(checker), base_url="http://127.0.0.1:9000")
    token = {H_SWARM_TOKEN: "tok"}
    # before the node knows its tracker's key, nothing is attributed nor required
    assert client.post("/v1/forward", headers=token).json() == {"peer": None}
    checker.tracker_key = TRACKER.public()
    refused = client.post("/v1/forward", headers=token)
    assert refused.status_code == 401 and "swarm nodes only" in refused.json()["error"]["message"]
    assert client.get("/v1/shards/x", headers=token).json() == {"peer": None}  # not a node route
    identity = _certified("node-a")

    def signed(method: str, path: str) -> dict[str, str]:  # as an httpx client's hook signs
        request = httpx.Request(method, f"http://127.0.0.1:9000{path}")
        identity.sign_request(request)
        return {k: request.headers[k] for k in (H_NODE_CERT, H_NODE_CALL)}

    ok = client.post("/v1/forward", headers={**token, **signed("POST", "/v1/forward")})
    assert ok.json() == {"peer": "node-a"}
    shard = client.get("/v1/shards/x", headers={**token, **signed("GET", "/v1/shards/x")})
    assert shard.json() == {"peer": "node-a"}
    wrong = {H_SWARM_TOKEN: "wrong", **signed("POST", "/v1/forward")}
    assert client.post("/v1/forward", headers=wrong).status_code == 401
    forged = _certified("node-a", ManifestSigner.generate())
    bad = forged.headers("POST", "127.0.0.1:9000", "/v1/forward")
    resp = client.post("/v1/forward", headers={**token, **bad})
    assert resp.status_code == 401 and "bad node identity" in resp.json()["error"]["message"]
    # elsewhere a stale certificate (a tracker restarted with a new key) is only not believed
    stale = forged.headers("GET", "127.0.0.1:9000", "/v1/shards/x")
    assert client.get("/v1/shards/x", headers={**token, **stale}).json() == {"peer": None}


def test_the_first_tracker_key_seen_is_kept_and_a_changed_one_refused():
    old, new = TRACKER, ManifestSigner.generate()
    learned = CallChecker()  # no --tracker-key: trust on first use
    assert learned.adopt(old.public()) and learned.adopt(old.public())
    assert not learned.adopt(new.public())  # a tracker answering with another key
    assert learned.tracker_key == old.public()
    after = _certified("node-a", new).headers("POST", HOST, TARGET)
    with pytest.raises(IdentityError, match="not the tracker's"):  # its certificates refused
        learned.caller("POST", HOST, TARGET, after)
    pinned = CallChecker.pinned(new.public().text)  # the operator pins the new key
    assert pinned.adopt(new.public()) and not pinned.adopt(old.public())
    assert pinned.caller("POST", HOST, TARGET, after) == "node-a"


def test_a_call_signed_for_one_node_is_refused_by_another():
    """A member that received a signed call cannot relay it: the callee checks the signed
    authority against the URL it answers at, not against the Host header the relay writes."""
    node_a, node_b = CallChecker(TRACKER.public()), CallChecker(TRACKER.public())
    node_a.answers_at(["http://10.0.0.1:9000"])
    node_b.answers_at(["http://10.0.0.2:9000/"])
    headers = _certified("caller").headers("POST", "10.0.0.1:9000", TARGET, b"{}")
    assert node_a.caller("POST", "10.0.0.1:9000", TARGET, headers, b"{}") == "caller"
    with pytest.raises(IdentityError, match="signed for another node"):  # Host kept as A's
        node_b.caller("POST", "10.0.0.1:9000", TARGET, headers, b"{}")
    with pytest.raises(IdentityError, match="not signed"):  # Host rewritten to B's
        node_b.caller("POST", "10.0.0.2:9000", TARGET, headers, b"{}")
    # through the middleware of node B: the relayed call is refused on a node route
    app = _app(node_b)
    client = TestClient(app, base_url="http://10.0.0.2:9000")
    relayed = client.post("/v1/forward", content=b"{}",
                          headers={H_SWARM_TOKEN: "tok", "host": "10.0.0.1:9000", **headers})  # fmt: skip
    assert relayed.status_code == 401 and "another node" in relayed.json()["error"]["message"]
    own = _certified("caller").headers("POST", "10.0.0.2:9000", TARGET, b"{}")
    ok = client.post("/v1/forward", content=b"{}", headers={H_SWARM_TOKEN: "tok", **own})
    assert ok.json() == {"peer": "caller", "body": "{}"}
    # a loopback URL answers under each loopback name, a default port with or without it
    local = CallChecker(TRACKER.public())
    local.answers_at(["http://127.0.0.1:9000", "https://node.example", None])
    assert {"localhost:9000", "[::1]:9000", "node.example", "node.example:443"} <= local.authorities
    wildcard = CallChecker(TRACKER.public())
    wildcard.answers_at(["http://0.0.0.0:9000"])
    assert wildcard.authorities == set()  # not known yet: the Host header stands in


def test_a_body_swapped_under_a_signature_is_refused():
    checker = CallChecker(TRACKER.public())
    headers = _certified().headers("POST", HOST, TARGET, b'{"ids": [1]}')
    assert checker.caller("POST", HOST, TARGET, headers, b'{"ids": [1]}') == "node-a"
    with pytest.raises(IdentityError, match="not signed"):
        checker.caller("POST", HOST, TARGET, headers, b'{"ids": [2]}')
    client = TestClient(_app(checker), base_url=f"http://{HOST}")
    token = {H_SWARM_TOKEN: "tok"}
    swapped = client.post("/v1/forward", content=b'{"ids": [2]}', headers={**token, **headers})
    assert swapped.status_code == 401
    ok = client.post("/v1/forward", content=b'{"ids": [1]}', headers={**token, **headers})
    assert ok.json() == {"peer": "node-a", "body": '{"ids": [1]}'}  # the body reaches the route

    def signed(request: httpx.Request) -> httpx.Response:  # an httpx hook signs what it sends
        return httpx.Response(200, json=dict(request.headers))

    identity = _certified()
    hooked = httpx.Client(transport=httpx.MockTransport(signed),
                          event_hooks={"request": [identity.sign_request]})  # fmt: skip
    sent = hooked.post(f"http://{HOST}{TARGET}", json={"ids": [1]}).json()
    body = b'{"ids":[1]}'
    assert checker.caller("POST", HOST, TARGET, sent, body) == "node-a"
    with pytest.raises(IdentityError):
        checker.caller("POST", HOST, TARGET, sent, b'{"ids":[2]}')


async def _raw_post(app, path: str, headers: dict[str, bytes]) -> httpx.Response:
    """Header bytes reach the app as they are (``TestClient`` re-encodes them as UTF-8)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:9000") as raw:
        return await raw.post(path, headers=headers)


def test_unicode_digits_in_a_certificate_or_a_call_time_are_refused_with_401():
    """``"²".isdigit()`` is true and ``int("²")`` raises: such an expiry or call time is an
    identity failure (401), never a 500; the next well-formed call still passes."""
    checker = CallChecker(TRACKER.public())
    client = TestClient(_app(checker), base_url="http://127.0.0.1:9000")
    identity = _certified("node-a")

    def signed() -> dict[str, str]:
        request = httpx.Request("POST", "http://127.0.0.1:9000/v1/forward")
        identity.sign_request(request)
        return {H_SWARM_TOKEN: "tok", **{k: request.headers[k] for k in (H_NODE_CERT, H_NODE_CALL)}}

    good = signed()
    parts = good[H_NODE_CERT].split(".")
    bad_expiry = {**good, H_NODE_CERT: ".".join([*parts[:3], "²", parts[4]])}
    bad_time = {**good, H_NODE_CALL: "²." + good[H_NODE_CALL].partition(".")[2]}
    for headers in (bad_expiry, bad_time):
        with pytest.raises(IdentityError):
            checker.caller("POST", HOST, "/v1/forward", headers)
        raw = {k: v.encode("latin-1") for k, v in headers.items()}  # as a server reads it
        resp = asyncio.run(_raw_post(client.app, "/v1/forward", raw))
        assert resp.status_code == 401 and "bad node identity" in resp.json()["error"]["message"]
    assert client.post("/v1/forward", headers=signed()).json() == {"peer": "node-a"}

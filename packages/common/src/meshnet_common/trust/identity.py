"""Who is calling (docs/adr/0032): node-to-node calls signed by the calling node, checked
with the tracker's key alone.

- Each node makes an Ed25519 key pair at start (``NodeKey``; it never leaves the process)
  and sends the public key with its registration.
- The tracker answers with a *certificate*: its own signature (the tracker key that signs
  manifests) over the node id, that public key and an expiry (``CERT_LIFETIME_S``). Every
  heartbeat answer renews it, so a node the tracker forgot loses its identity within that
  lifetime; one it removed or quarantined loses it at once (``trust.revocation``: the key
  is listed in heartbeat answers and ``CallChecker.revoked`` refuses it).
- A node calling a peer sends its certificate and its signature over the method, the
  peer's authority (the host and port it dials: the callee as the swarm names it), the
  request target, the SHA-256 of the body and the time (``x-meshnet-node-cert``,
  ``x-meshnet-node-call``). A hop stream signs its handshake once.
- The peer checks both with the tracker key it already holds (``CallChecker``), with no
  round trip to the tracker, and attributes the call to that node id. It checks the signed
  authority against its own (``answers_at``: the URL the tracker registered it under, not
  the ``Host`` header a relaying member would write), and the digest against the body it
  received. A signature is good for ``MAX_SKEW_S`` around its time, so a member that
  received a signed call can neither relay it to another node nor swap its body.

Hand-written because the pieces it uses are the ``cryptography`` package's Ed25519 and
the tracker key of ``manifest_keys``; what is signed and when is this project's own.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import time
from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping
from urllib.parse import urlsplit

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshnet_common.trust.manifest_keys import ManifestKey, ManifestSigner

H_NODE_CERT = "x-meshnet-node-cert"  # the caller's certificate (``Certificate.text``)
H_NODE_CALL = "x-meshnet-node-call"  # "TIME.SIGNATURE": the caller's signature of this call
CERT_LIFETIME_S = 600  # a certificate's life; heartbeats renew it
MAX_SKEW_S = 120  # how far a call's time may be from the checker's clock
MAX_CERT_CHARS = 512
_CACHE = 1024  # certificates checked once, then remembered


class IdentityError(ValueError):
    """A call's identity headers are present but do not prove anything."""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _digits(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes "²", which ``int`` then refuses."""
    return text.isascii() and text.isdigit()


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _certificate_body(node_id: str, public_key: str, not_after: int) -> bytes:
    return f"meshnet-node-certificate\0{node_id}\0{public_key}\0{not_after}".encode()


def call_body(method: str, authority: str, target: str, when: int, body: bytes = b"") -> bytes:
    """What a caller signs: the method, the peer's authority, the target, the SHA-256 of
    the request body and the time."""
    digest = hashlib.sha256(body).hexdigest()
    return (
        f"meshnet-node-call/2\0{method.upper()}\0{authority.lower()}\0{target}\0{digest}\0{when}"
    ).encode()


_LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def authorities(url: str) -> set[str]:
    """The ``Host`` values a caller dialling ``url`` sends (lower case; the default port
    with and without it; loopback under each of its names). Empty for a wildcard host,
    which no caller dials."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if not host or host in ("0.0.0.0", "::"):
        return set()
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return set()
    hosts = {f"[{host}]" if ":" in host else host}
    if hosts & set(_LOOPBACK):
        hosts = set(_LOOPBACK)
    found = {f"{name}:{port}" for name in hosts}
    if port == _DEFAULT_PORTS.get(parts.scheme):
        found |= hosts
    return found


def issue(
    signer: ManifestSigner, node_id: str, public_key: str, *, now: float | None = None
) -> str:
    """The tracker's certificate for ``node_id`` holding ``public_key`` (``NodeKey.public``):
    ``v1.ID.KEY.NOT_AFTER.SIGNATURE``, each part URL-safe base64 but the expiry."""
    not_after = int(time.time() if now is None else now) + CERT_LIFETIME_S
    signature = base64.b64decode(signer.sign(_certificate_body(node_id, public_key, not_after)))
    return f"v1.{_b64(node_id.encode())}.{public_key}.{not_after}.{_b64(signature)}"


class NodeKey:
    """This node's key pair: made at start, never written anywhere."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.public = _b64(_raw_public(self._key.public_key()))

    def sign(self, body: bytes) -> str:
        return _b64(self._key.sign(body))


class Identity:
    """This node's key and the certificate the tracker issued for it (None before the
    first registration is answered: its calls then go unsigned)."""

    def __init__(self, key: NodeKey | None = None) -> None:
        self.key = key or NodeKey()
        self.certificate: str | None = None

    def adopt(self, certificate: str | None) -> None:
        """A certificate from a registration or heartbeat answer (None: keep the last)."""
        if certificate:
            self.certificate = certificate

    def headers(
        self, method: str, authority: str, target: str, body: bytes = b""
    ) -> dict[str, str]:
        """The headers that sign one call (none before a certificate is issued)."""
        if self.certificate is None:
            return {}
        when = int(time.time())
        signature = self.key.sign(call_body(method, authority, target, when, body))
        return {H_NODE_CERT: self.certificate, H_NODE_CALL: f"{when}.{signature}"}

    def sign_request(self, request) -> None:
        """An httpx request hook (a blocking client's): signs the body it sends too."""
        target = request.url.raw_path.decode("ascii")
        body = request.read()  # the bytes it sends (a streamed body is read into memory)
        request.headers.update(self.headers(request.method, request.headers["host"], target, body))

    async def sign_async_request(self, request) -> None:
        """An httpx request hook (an async client's)."""
        await request.aread()
        self.sign_request(request)


class CallChecker:
    """Checks the identity headers of calls to this process against the tracker key.

    ``tracker_key`` is None until the node knows its tracker's key (``--tracker-key``, else
    the first registration answer's, kept from then on: trust on first use): calls are
    then not attributed. ``required``: whether
    node-to-node routes refuse a call without identity: once the key is known, where the
    process serves such routes (``serves_nodes``: a tracker without a tracker node has
    none, and answers 404 for them as for any unknown path)."""

    def __init__(
        self, tracker_key: ManifestKey | None = None, *, serves_nodes: bool = True, clock=time.time
    ) -> None:
        self.tracker_key = tracker_key
        self.serves_nodes = serves_nodes
        self.clock = clock
        self.is_pinned = False  # the operator's --tracker-key: never replaced
        # The Host values this process answers at (``answers_at``); empty: not known yet,
        # and the Host header the call came with stands in.
        self.authorities: set[str] = set()
        # Node keys whose certificates the tracker revoked (``trust.revocation``): the
        # tracker's own ``Revocations``, or on a node the list of its last heartbeat answer.
        self.revoked: Container[str] = frozenset()
        self._known: OrderedDict[str, tuple[str, Ed25519PublicKey, int, str]] = OrderedDict()

    @classmethod
    def pinned(cls, tracker_key: str | None) -> CallChecker:
        """With the ``--tracker-key`` pinned (if any) from the start; without one, the key
        comes with the first registration's answer."""
        checker = cls(ManifestKey.from_text(tracker_key) if tracker_key else None)
        checker.is_pinned = tracker_key is not None
        return checker

    def adopt(self, tracker_key: ManifestKey) -> bool:
        """The key a registration answer carried: taken when none is known yet (trust on
        first use); False when it differs from the key known (pinned, or first seen). A
        tracker whose key changed (restarted without --signing-key, or an impostor) is not
        believed until the operator pins its new key with --tracker-key."""
        if self.tracker_key is None:
            self.tracker_key = tracker_key
            self._known.clear()
        return self.tracker_key == tracker_key

    def answers_at(self, urls: Iterable[str | None]) -> None:
        """The URLs peers reach this process at (its registered URL, its advertised one):
        a signed call must name one of them."""
        for url in urls:
            if url:
                self.authorities |= authorities(url)

    @property
    def required(self) -> bool:
        return self.serves_nodes and self.tracker_key is not None

    def caller(
        self, method: str, authority: str, target: str, headers: Mapping[str, str],
        body: bytes = b"",
    ) -> str | None:  # fmt: skip
        """The node id that signed this call of ``body``; None when it carries no identity
        headers. IdentityError when it carries them and they do not check out, or were
        signed for another node."""
        cert, call = headers.get(H_NODE_CERT), headers.get(H_NODE_CALL)
        if cert is None and call is None:
            return None
        if self.tracker_key is None:
            raise IdentityError("this node does not know its tracker's key yet")
        if not cert or not call:
            raise IdentityError(f"a signed call needs both {H_NODE_CERT} and {H_NODE_CALL}")
        now = self.clock()
        node_id, key, not_after, public = self._certificate(cert)
        if public in self.revoked:
            raise IdentityError(f"the certificate of {node_id!r} was revoked")
        if not_after < now - MAX_SKEW_S:
            raise IdentityError(f"the certificate of {node_id!r} expired")
        when_text, _, signature = call.partition(".")
        if not _digits(when_text) or abs(int(when_text) - now) > MAX_SKEW_S:
            raise IdentityError("the call's time is missing or too far from this node's clock")
        try:
            signed = call_body(method, authority, target, int(when_text), body)
            key.verify(_unb64(signature), signed)
        except (InvalidSignature, binascii.Error, ValueError) as exc:
            raise IdentityError(f"the call is not signed by {node_id!r}") from exc
        if self.authorities and authority.lower() not in self.authorities:
            raise IdentityError(f"the call of {node_id!r} was signed for another node")
        return node_id

    def _certificate(self, text: str) -> tuple[str, Ed25519PublicKey, int, str]:
        known = self._known.get(text)
        if known is not None:
            self._known.move_to_end(text)
            return known
        if len(text) > MAX_CERT_CHARS:
            raise IdentityError("the certificate is too long")
        parts = text.split(".")
        if len(parts) != 5 or parts[0] != "v1" or not _digits(parts[3]):
            raise IdentityError("not a node certificate")
        _, id_part, public, not_after_text, signature = parts
        try:
            node_id = _unb64(id_part).decode()
            key = Ed25519PublicKey.from_public_bytes(_unb64(public))
            raw_signature = _unb64(signature)
        except (binascii.Error, ValueError) as exc:
            raise IdentityError("not a node certificate") from exc
        not_after = int(not_after_text)
        body = _certificate_body(node_id, public, not_after)
        if not self.tracker_key.verify(body, base64.b64encode(raw_signature).decode()):
            raise IdentityError("the certificate is not the tracker's")
        self._known[text] = (node_id, key, not_after, public)
        if len(self._known) > _CACHE:
            self._known.popitem(last=False)
        return node_id, key, not_after, public

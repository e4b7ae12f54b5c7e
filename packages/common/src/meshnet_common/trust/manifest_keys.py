"""The root of trust for weights (docs/adr/0032): the tracker signs every shard manifest with
an Ed25519 key of its own; nodes hold only the public key, so no node can forge a manifest
that another node would accept.

The key file is PEM (PKCS#8), created on first use with mode 0600; an existing one that
group or others may read or write is refused, as ssh refuses such a private key. Without one
the tracker makes a new key per run (nodes ask it for its key at start, or pin it with --tracker-key).
The public key travels as the base64 of its 32 raw bytes, the signature as the base64 of
its 64 bytes. A manifest's signature (``x-meshnet-manifest-signature: NOT_AFTER.SIGNATURE``)
covers its canonical JSON (``shardfiles.canonical_json``) and an expiry
``MANIFEST_LIFETIME_S`` on, which verifiers check: an old signed manifest (of a revision
since replaced) cannot be replayed to a node for ever.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshnet_common.errors import InvalidRequest

H_MANIFEST_SIGNATURE = "x-meshnet-manifest-signature"
KEY_PATH = "/v1/tracker/key"  # GET: {"algorithm": "ed25519", "public_key": BASE64}
ALGORITHM = "ed25519"
MANIFEST_LIFETIME_S = 3600  # how long a manifest's signature is good for
MANIFEST_SKEW_S = 120  # how far the verifier's clock may be behind or ahead


def _manifest_body(body: bytes, not_after: int) -> bytes:
    return b"meshnet-manifest/2\0" + str(not_after).encode() + b"\0" + body


class ManifestSigner:
    """The tracker's private key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key

    @classmethod
    def generate(cls) -> ManifestSigner:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_file(cls, path: Path) -> ManifestSigner:
        """The key in ``path``; a new one written there (0600) if the file does not exist."""
        path = Path(path)
        if not path.exists():
            signer = cls.generate()
            raw = signer._key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )  # fmt: skip
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(raw)
            return signer
        _check_private(path)
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"{path}: not a PEM private key ({exc})") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise InvalidRequest(f"{path}: not an Ed25519 key")
        return cls(key)

    def public(self) -> ManifestKey:
        return ManifestKey(self._key.public_key())

    def sign(self, body: bytes) -> str:
        return base64.b64encode(self._key.sign(body)).decode()

    def sign_manifest(self, body: bytes, *, now: float | None = None) -> str:
        """``x-meshnet-manifest-signature`` of a manifest's canonical JSON: NOT_AFTER.SIGNATURE."""
        not_after = int(time.time() if now is None else now) + MANIFEST_LIFETIME_S
        return f"{not_after}.{self.sign(_manifest_body(body, not_after))}"


def _check_private(path: Path) -> None:
    """InvalidRequest when group or others may read or write the key file (POSIX only)."""
    if os.name != "posix":
        return
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise InvalidRequest(
            f"--signing-key {path}: permissions {mode:04o} let group or others read it; "
            f"a private key must be 0600 (chmod 600 {path})"
        )


class ManifestKey:
    """The public key nodes check manifests with."""

    def __init__(self, key: Ed25519PublicKey) -> None:
        self._key = key

    @classmethod
    def from_text(cls, text: str) -> ManifestKey:
        """From the base64 of the 32 raw bytes (what ``text`` gives); InvalidRequest if not."""
        try:
            raw = base64.b64decode(text.strip(), validate=True)
            return cls(Ed25519PublicKey.from_public_bytes(raw))
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest(
                f"not an Ed25519 public key (base64 of 32 bytes): {text[:60]!r}",
                param="tracker_key",
            ) from exc

    @property
    def text(self) -> str:
        raw = self._key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return base64.b64encode(raw).decode()

    def verify(self, body: bytes, signature: str | None) -> bool:
        """Whether ``signature`` (base64) signs ``body`` under this key."""
        if not signature:
            return False
        try:
            self._key.verify(base64.b64decode(signature, validate=True), body)
        except (InvalidSignature, binascii.Error, ValueError):
            return False
        return True

    def manifest_problem(
        self, body: bytes, header: str | None, *, now: float | None = None
    ) -> str | None:
        """Why ``header`` (``sign_manifest``'s) does not vouch for ``body`` now; None when
        it does."""
        when, _, signature = (header or "").partition(".")
        if not (when.isascii() and when.isdigit() and len(when) <= 12) or not signature:
            return "manifest signature missing or malformed"
        if not self.verify(_manifest_body(body, int(when)), signature):
            return "manifest signature not the tracker's"
        if int(when) < (time.time() if now is None else now) - MANIFEST_SKEW_S:
            return "manifest signature expired"
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ManifestKey) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

"""Evidence for a verdict (docs/adr/0032): output rows that nodes signed, and the tracker's
check of them. Torch-free (the tracker checks verdicts without torch).

A node that answers an audit's recomputation signs what it computed: ``HMAC-SHA256(its node
secret, "meshnet-audit/1" | node id | start layer | sha256 of the inputs frame | sha256 of the
output row)``, the row being the float32 values of the last position's output, little-
endian. The tracker issued every node's secret, so it can check each signature and no node
can sign for another. A verdict then counts only if its evidence shows, over one inputs
frame and one start layer, either that two witnesses agree with each other and not with
the suspect, or that the suspect gave two answers to the same inputs that disagree (it does
not reproduce its own output) — judged with the tolerance of the suspect's own precision.

Only rows of nodes the tracker called back count (a joining registration signs nothing
that counts), and a witness must be one the suspect cannot be framed by cheaply: serving
and unquarantined, of the suspect's model and precision, holding every audited layer, on a
host of its own (not the suspect's, not another witness's), serving for ``witness_age_s``
on the tracker's clock (``Signer``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from meshnet_common.layers import LayerRange
from meshnet_common.protocol import Evidence, SignedRow

DOMAIN = b"meshnet-audit/1"
H_AUDIT_SIGNATURE = "x-meshnet-audit-signature"


@dataclass(frozen=True)
class Signer:
    """What the tracker knows of a node whose signed rows a verdict shows."""

    secret: str
    called_back: bool  # its serving registration was confirmed by the tracker's call-back
    serving: bool  # serving now, not quarantined
    model_id: str
    precision: str
    layers: LayerRange
    # Names of the machine it runs on: its URL's host, and the address (an IPv6 one's /64)
    # its registration came from; a witness shares none with the suspect or another witness.
    hosts: frozenset[str]
    since: float  # when its current registration began (the tracker's clock)


def row_bytes(values) -> bytes:
    """A row's float32 little-endian bytes (from a sequence of floats)."""
    return array("f", values).tobytes()


def sign_row(secret: str, node_id: str, start: int, inputs_sha256: str, row: bytes) -> str:
    message = b"\0".join(
        (DOMAIN, node_id.encode(), str(start).encode(), inputs_sha256.encode(),
         hashlib.sha256(row).hexdigest().encode())
    )  # fmt: skip
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signed_row(node_id: str, row: bytes, signature: str) -> SignedRow:
    return SignedRow(node_id=node_id, row=base64.b64encode(row).decode(), signature=signature)


def _values(row: SignedRow) -> array:
    values = array("f")
    values.frombytes(base64.b64decode(row.row, validate=True))
    return values


def relative_error(output: array, reference: array) -> float:
    """||output - reference|| / ||reference||, as the verifier measures it."""
    if len(output) != len(reference):
        return math.inf
    diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(output, reference, strict=True)))
    return diff / max(math.sqrt(sum(b * b for b in reference)), 1e-30)


def check_evidence(
    evidence: Evidence | None, suspect: str, signer_of: Callable[[str], Signer | None],
    tolerance: float, *, now: float, witness_age_s: float,
) -> str | None:  # fmt: skip
    """Why ``evidence`` does not show that ``suspect`` computed wrong; None when it does.
    ``signer_of``: the tracker's view of a node id (None: no live record); ``now`` and
    ``witness_age_s``: a witness must have served since ``now - witness_age_s``."""
    if evidence is None:
        return "a verdict needs evidence: rows signed by the suspect and its witnesses"
    signers: dict[str, Signer] = {}
    for row in (*evidence.suspect_rows, *evidence.witness_rows):
        signer = signers.get(row.node_id) or signer_of(row.node_id)
        if signer is None or not signer.secret:
            return f"{row.node_id!r} is no registered node"
        if not signer.called_back:
            return f"{row.node_id!r} was never called back: a joining node signs nothing"
        signers[row.node_id] = signer
        try:
            raw = base64.b64decode(row.row, validate=True)
        except ValueError:
            return f"a row of {row.node_id!r} is not base64"
        if len(raw) % 4:
            return f"a row of {row.node_id!r} is not float32 values"
        want = sign_row(
            signer.secret, row.node_id, evidence.start_layer, evidence.inputs_sha256, raw
        )
        if not hmac.compare_digest(want, row.signature):
            return f"the signature of {row.node_id!r}'s row is not its own"
    if any(r.node_id != suspect for r in evidence.suspect_rows):
        return "a suspect row is not the suspect's"
    own = [_values(r) for r in evidence.suspect_rows]
    if len(own) >= 2 and relative_error(own[0], own[1]) > tolerance:
        return None  # it does not reproduce its own output from the same inputs
    accused = signers[suspect]
    if not accused.layers.start <= evidence.start_layer < accused.layers.end:
        return f"layer {evidence.start_layer} is not in the suspect's range {accused.layers}"
    audited = LayerRange(evidence.start_layer, accused.layers.end)
    hosts = set(accused.hosts)
    agreeing = []
    for row in evidence.witness_rows:
        why = _unfit_witness(row.node_id, signers[row.node_id], accused, audited, hosts,
                             now - witness_age_s)  # fmt: skip
        if why is not None:
            return f"witness {row.node_id!r} {why}"
        hosts |= signers[row.node_id].hosts
        agreeing.append(_values(row))
    if len(agreeing) < 2:
        return "two witnesses that agree, or two answers of the suspect, are needed"
    if any(relative_error(a, b) > tolerance for a in agreeing for b in agreeing):
        return "the witnesses disagree with each other"
    if any(relative_error(own[0], w) <= tolerance for w in agreeing):
        return "the suspect's row agrees with a witness"
    return None


def _unfit_witness(
    node_id: str, witness: Signer, accused: Signer, audited: LayerRange, hosts: set[str],
    served_since: float,
) -> str | None:  # fmt: skip
    """Why ``witness`` cannot testify against ``accused`` (None: it can). ``hosts``: those
    of the suspect and of the witnesses counted so far."""
    if witness is accused:
        return "is the suspect"
    if not witness.serving:
        return "is not serving (joining, draining or quarantined)"
    if (witness.model_id, witness.precision) != (accused.model_id, accused.precision):
        return (
            f"serves {witness.model_id} at {witness.precision}, not the suspect's model at "
            f"{accused.precision}"
        )
    if not (witness.layers.start <= audited.start and audited.end <= witness.layers.end):
        return f"holds {witness.layers}, not every audited layer of {audited}"
    if shared := witness.hosts & hosts:
        return f"shares its host {min(shared)} with the suspect or another witness"
    if witness.since > served_since:
        return "has not served long enough to witness"
    return None

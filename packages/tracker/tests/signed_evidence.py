"""Evidence as a node signs it (``meshnet_common.trust.evidence``), for tests that post
verdicts: the suspect's two answers to one input, which disagree."""

from __future__ import annotations

import base64

from meshnet_common.trust.evidence import row_bytes, sign_row

DIGEST = "0" * 64


def evidence(secret: str, suspect: str, start: int = 0) -> dict:
    rows = []
    for value in (1.0, 2.0):
        raw = row_bytes([value] * 8)
        rows.append({"node_id": suspect, "row": base64.b64encode(raw).decode(),
                     "signature": sign_row(secret, suspect, start, DIGEST, raw)})  # fmt: skip
    return {"inputs_sha256": DIGEST, "start_layer": start, "suspect_rows": rows}

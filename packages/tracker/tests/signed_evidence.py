"""Evidence as a node signs it (``meshnet_common.trust.evidence``), for tests that post
verdicts: the suspect's two answers to one input, which disagree; and the registrations of
the trust tests' model."""

from __future__ import annotations

import base64

from meshnet_common.trust.evidence import row_bytes, sign_row

DIGEST = "0" * 64
MODEL = "org/trust"


def evidence(secret: str, suspect: str, start: int = 0) -> dict:
    rows = []
    for value in (1.0, 2.0):
        raw = row_bytes([value] * 8)
        rows.append({"node_id": suspect, "row": base64.b64encode(raw).decode(),
                     "signature": sign_row(secret, suspect, start, DIGEST, raw)})  # fmt: skip
    return {"inputs_sha256": DIGEST, "start_layer": start, "suspect_rows": rows}


def announcement(node_id: str, start: int = 0, end: int = 4, **changes) -> dict:
    """A node's registration of layers [start, end) of MODEL (4 layers, float32)."""
    return {
        "node_id": node_id, "url": changes.pop("url", f"http://{node_id}.test:8000"),
        "shard": {"model_id": MODEL, "shard_start": start, "shard_end": end},
        "num_layers": 4, "quantization": "float32", "device": "cpu",
        "memory_declared_bytes": 1 << 30, "memory_free_bytes": 1 << 29, **changes,
    }  # fmt: skip

"""Prefix blocks: a prompt's full 128-token blocks, each named by a hash chain over the token
ids so far (docs/adr/0035). Block ``i``'s hash names the whole prefix ``[0, 128 * (i + 1))``:
two prompts share block ``i``'s hash only when their first ``i + 1`` blocks are the same ids.

The chain starts from a seed naming the model, the tenant (the API key the client was checked
with, as ``web.auth.tenant_of`` names it) and the request's ``cache_salt``: requests of two
keys, or with different salts, never share a block. The blocks are the prefill's wire chunks (ADR-0010), so
a block reused is computed exactly as the chunk that would compute it again."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import NamedTuple

from meshnet_common.config import defaults

BLOCK_TOKENS = defaults.CHUNK_TOKENS  # 128: one prefill wire chunk
SEED_PATTERN = r"^[0-9a-f]{32}$"


class PrefixPlan(NamedTuple):
    """What a session leaves in the prefix cache when it closes: the blocks of its first
    ``tokens`` positions, its prompt (computed in prefill chunks, as a later prompt starting
    with it would compute them; the decoded tokens after it are not), named from ``seed``."""

    seed: str
    tokens: int


def seed_of(model_id: str, salt: str | None = None, tenant: str | None = None) -> str:
    """The chain's seed: the model, the tenant and the salt (both None: the cache that
    keyless clients without a salt share)."""
    text = json.dumps(["meshnet-prefix-v2", model_id, tenant, salt]).encode()
    return hashlib.blake2b(text, digest_size=16).hexdigest()


def block_hashes(seed: str, ids: Sequence[int]) -> list[str]:
    """One hash per full block of ``ids``; a last partial block has none."""
    hashes, prev = [], bytes.fromhex(seed)
    for lo in range(0, len(ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block = struct.pack(f"<{BLOCK_TOKENS}q", *ids[lo : lo + BLOCK_TOKENS])
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        hashes.append(prev.hex())
    return hashes


def reusable_blocks(prompt_tokens: int) -> int:
    """The most blocks a prompt may take from the cache: its last token is always computed,
    so that the tail has logits to sample from."""
    return max(prompt_tokens - 1, 0) // BLOCK_TOKENS

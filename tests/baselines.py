"""Single-process baselines and an in-process split runner, for exactness tests and benchmarks.

``hf_chunked_greedy`` runs the unsplit HF model with the same chunking a swarm uses;
``split_greedy`` runs a list of in-process stages passing only hidden states between them.
Both return the generated token ids and the last-position logits of every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from meshnet_node.engine.stage import DEFAULT_CHUNK_TOKENS, Stage


def load_reference_model(snapshot: Path | str, dtype: torch.dtype) -> torch.nn.Module:
    """The whole model in one process, as a user of plain transformers would load it."""
    return AutoModelForCausalLM.from_pretrained(snapshot, dtype=dtype).eval()


@torch.inference_mode()
def hf_chunked_greedy(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with the full model, prefill fed in ``chunk_tokens`` pieces."""
    cache = DynamicCache(config=model.config)
    feed = list(prompt_ids)
    position = 0
    tokens: list[int] = []
    logits_seq: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        while feed:
            chunk, feed = feed[:chunk_tokens], feed[chunk_tokens:]
            ids = torch.tensor([chunk])  # (1, T)
            position_ids = torch.arange(position, position + len(chunk)).unsqueeze(0)
            out = model(input_ids=ids, position_ids=position_ids, cache=cache, use_cache=True)
            position += len(chunk)
        logits = out.logits[0, -1].float()  # (V,)
        logits_seq.append(logits)
        token = int(torch.argmax(logits))
        tokens.append(token)
        feed = [token]
    return tokens, logits_seq


def split_greedy(
    stages: Sequence[Stage],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    session_id: str = "reference",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    stop_ids: Sequence[int] = (),
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding through in-process stages; only hidden states cross a boundary."""
    for stage in stages:
        stage.open_session(session_id)
    try:
        feed = list(prompt_ids)
        position = 0
        tokens: list[int] = []
        logits_seq: list[torch.Tensor] = []
        for _ in range(max_new_tokens):
            while feed:
                chunk, feed = feed[:chunk_tokens], feed[chunk_tokens:]
                out = stages[0].step(session_id, position, token_ids=torch.tensor([chunk]))
                for stage in stages[1:]:
                    out = stage.step(session_id, position, hidden=out.hidden)
                position += len(chunk)
            logits_seq.append(out.logits)
            token = out.token.token_id
            tokens.append(token)
            if token in stop_ids:
                break
            feed = [token]
        return tokens, logits_seq
    finally:
        for stage in stages:
            stage.close_session(session_id)

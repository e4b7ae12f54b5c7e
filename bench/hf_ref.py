"""The single-process baseline: plain transformers ``generate`` with its KV cache, in bf16.

Used by ``perf.py`` and ``pipeline.py``. EOS is switched off (``eos_token_id = None``), so
``generate`` always makes ``new_tokens`` tokens and picks the same greedy tokens as
meshnet with ``ignore_eos``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Generated:
    """One timed ``generate`` call."""

    elapsed_s: float
    token_ids: list[int]
    logprobs: list[float] | None  # log-probability of each greedy token (when asked for)


def load_model(snapshot: Path):
    """The whole model in bf16, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.bfloat16).eval()


def greedy(model, ids: list[int], new_tokens: int, *, logprobs: bool = False) -> Generated:
    """Greedy ``generate`` of exactly ``new_tokens`` tokens; wall time includes the prefill.

    With ``logprobs`` the scores of every step are kept (one (1, V) float32 copy per step)
    and turned into the chosen tokens' log-probabilities after the clock stopped.
    """
    import torch

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # like meshnet's ignore_eos: no early stop, no EOS masking
    config.pad_token_id = 0
    config.do_sample = False
    config.max_new_tokens = new_tokens
    config.min_new_tokens = None
    config.use_cache = True
    config.output_scores = logprobs
    config.return_dict_in_generate = True
    inputs = torch.tensor([ids])  # (1, T)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            inputs, attention_mask=torch.ones_like(inputs), generation_config=config
        )
    elapsed = time.perf_counter() - t0
    tokens = out.sequences[0, len(ids) :].tolist()
    chosen = None
    if logprobs:
        chosen = [
            float(torch.log_softmax(scores[0].float(), dim=-1)[token])  # scores: (1, V)
            for scores, token in zip(out.scores, tokens, strict=True)
        ]
    return Generated(elapsed, tokens, chosen)


def prefill_ms(model, ids: list[int]) -> float:
    """Time to first token of the baseline: ``generate`` with one new token (one pass)."""
    return greedy(model, ids, 1).elapsed_s * 1000


@contextmanager
def bf16_kernel(model) -> Iterator[bool]:
    """Within the block, the model's bf16 linears run on meshnet's bf16 product kernel (the
    same numbers as torch's, faster where torch multiplies bf16 one row at a time: ADR-0030),
    so that a comparison with meshnet measures the distribution alone. Yields whether the
    kernel applies here (else the model is left as it is)."""
    import types

    import torch
    from torch import nn

    from meshnet_node.kernels import bf16_dot

    if not bf16_dot.start("cpu") or bf16_dot.wait() is None:
        yield False
        return
    linears = [
        m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype is torch.bfloat16
    ]
    for m in linears:
        m.forward = types.MethodType(bf16_dot._forward, m)
    try:
        yield True
    finally:
        for m in linears:
            del m.forward

"""TESTING ONLY: faults a node can be started with, to test what must catch or survive them.
Each is composed at start-up (``meshnet_node.runtime``) only when its flag is set; a real
node has none.

- ``NoisyOutputs`` (``--test-only-perturb``): noise on everything the stage computes, as
  faulty hardware would (what ``--verify-fraction`` must catch, docs/adr/0026);
- ``SlowCompute`` (``--step-delay-ms``, hidden): every compute pass that much slower, holding
  the compute thread as real compute would (a slow shard, as on a big model).
"""

from __future__ import annotations

import time

import torch


class NoisyOutputs:
    """An output filter for ``Stage``: ``out`` with noise of ``scale`` times each row's RMS
    added (hidden states a stage sends on, a tail's logits)."""

    def __init__(self, scale: float) -> None:
        if scale <= 0.0:
            raise ValueError(f"noise scale must be positive, not {scale}")
        self.scale = scale

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        rows = out.float()
        rms = rows.pow(2).mean(dim=-1, keepdim=True).sqrt()
        return (rows + torch.randn_like(rows) * rms * self.scale).to(out.dtype)


class SlowCompute:
    """Run before each compute pass, on the thread running it: sleeps ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        if delay_s <= 0.0:
            raise ValueError(f"delay must be positive, not {delay_s}")
        self.delay_s = delay_s

    def __call__(self) -> None:
        time.sleep(self.delay_s)


def noisy_outputs(scale: float) -> NoisyOutputs | None:
    """``--test-only-perturb``'s fault, or None when it is 0 (a real node)."""
    return NoisyOutputs(scale) if scale else None


def slow_compute(delay_ms: float) -> SlowCompute | None:
    """``--step-delay-ms``'s fault, or None when it is 0 (a real node)."""
    return SlowCompute(delay_ms / 1000.0) if delay_ms else None

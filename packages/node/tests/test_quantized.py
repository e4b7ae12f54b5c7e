"""bitsandbytes nf4 shards run on CPU, and every precision on CUDA when present (int8 and int4
are meshnet's own packed weights: test_lowbit.py)."""

from __future__ import annotations

import pytest
import torch
from baselines import split_greedy

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.bnb


def run(snapshot, precision, device="cpu", n=6):
    stages = [
        Stage(load_shard(snapshot, LayerRange(a, b), precision, device=device))
        for a, b in ((0, 3), (3, 6))
    ]
    prompt = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    return split_greedy(stages, prompt, n), stages


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])
def test_nf4_runs_on_widths_multiple_of_32(tiny_snapshot, family):
    snapshot = tiny_snapshot(family)
    (ref_tokens, ref_logits), _ = run(snapshot, Precision.BFLOAT16, n=1)
    (tokens, logits), stages = run(snapshot, Precision.NF4, n=1)
    import bitsandbytes as bnb

    assert any(isinstance(m, bnb.nn.Linear4bit) for m in stages[1].shard.modules.modules())
    assert torch.isfinite(logits[0]).all()
    # 4-bit weights perturb a random model's logits, but they stay strongly correlated.
    corr = torch.corrcoef(torch.stack([logits[0], ref_logits[0]]))[0, 1]
    assert corr > 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "precision", [Precision.BFLOAT16, Precision.INT8, Precision.INT4, Precision.NF4]
)
def test_cuda_shards_match_cpu_first_token(tiny_snapshot, precision):
    snapshot = tiny_snapshot("llama")
    (cpu_tokens, _), _ = run(snapshot, Precision.BFLOAT16, n=1)
    (gpu_tokens, gpu_logits), _ = run(snapshot, precision, device="cuda", n=1)
    assert torch.isfinite(gpu_logits[0]).all()
    if precision is Precision.BFLOAT16:
        assert gpu_tokens == cpu_tokens

"""Test-only faults (``meshnet_node.engine.faults``): composed at start-up only behind their
flags (``--test-only-perturb``, ``--step-delay-ms``), and doing what the tests that start
nodes with them rely on."""

from __future__ import annotations

import asyncio

import pytest
import torch

from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.dataplane.service import NodeService
from meshnet_node.engine.faults import NoisyOutputs, SlowCompute, noisy_outputs, slow_compute
from meshnet_node.runtime import load_stage
from meshnet_node.scheduling.scheduler import ComputeScheduler
from meshnet_node.settings import NodeSettings


@pytest.fixture(scope="module")
def settings(tiny_snapshot) -> NodeSettings:
    return NodeSettings(model_id="meshnet-tiny/llama", model_path=tiny_snapshot("llama"),
                        layers=LayerRange(0, 3), quantization=Precision.FLOAT32,
                        device="cpu")  # fmt: skip


def test_a_real_node_has_no_fault(settings):
    assert noisy_outputs(0.0) is None and slow_compute(0.0) is None
    stage = load_stage(settings)
    assert stage.output_fault is None
    service = NodeService(stage, settings, model_id=settings.model_id)
    assert service.scheduler.before_pass is None
    asyncio.run(service.aclose())


def test_a_perturbed_stage_sends_noisy_rows_and_records_them(settings):
    """The noise is part of what the stage computes: its record (what audits read) holds
    the noisy row it sent, as a node with faulty hardware would."""
    middle = settings.replace(layers=LayerRange(2, 4))
    clean, noisy = load_stage(middle), load_stage(middle.replace(test_only_perturb=0.5))
    assert isinstance(noisy.output_fault, NoisyOutputs) and noisy.output_fault.scale == 0.5
    hidden = torch.randn(1, 4, clean.shard.hidden_size, generator=torch.Generator().manual_seed(0))
    outs = []
    for stage in (clean, noisy):
        stage.open_session("s", start_layer=2, record=True)
        outs.append(stage.step("s", 0, hidden=hidden, sample=False).hidden)
        assert torch.equal(stage.sessions.get("s").record.last, outs[-1][0, -1])
    assert outs[0].shape == outs[1].shape and outs[0].dtype == outs[1].dtype
    relative = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert 0.2 < relative < 1.0  # about 0.5 of each row's RMS


def test_slow_compute_holds_the_compute_thread_and_counts_in_the_pass(settings):
    stage = load_stage(settings)
    stage.open_session("s")
    compute = ComputeScheduler(before_pass=SlowCompute(0.2))

    async def run():
        return await compute.rows(stage.step, "s", 0, token_ids=torch.tensor([[5]]), rows=1)

    out = asyncio.run(run())
    compute.shutdown()
    assert out.compute_s >= 0.2  # as a slow shard's pass would measure
    with pytest.raises(ValueError):
        SlowCompute(0.0)

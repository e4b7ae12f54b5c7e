"""The head's own pass is "hop 0" of a step (issue 51, docs/adr/0040): the head builds one
``Step`` and runs its layers from it through the same ``NodeService.run`` every hop's
parsed step takes; the next hop gets that step with the route after it."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import torch
from transformers import AutoConfig

from meshnet_common import wire
from meshnet_common.layers import LayerRange
from meshnet_common.precision import Precision
from meshnet_node.dataplane.service import NodeService
from meshnet_node.dataplane.steps import Step
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import Stage
from meshnet_node.head.chain import GenerationRequest, HeadPasses, as_result
from meshnet_node.settings import NodeSettings


def test_the_heads_pass_runs_from_the_step_the_next_hop_gets(tiny_snapshot):
    snapshot = tiny_snapshot("llama")
    layers = LayerRange(0, AutoConfig.from_pretrained(snapshot).num_hidden_layers)
    stage = Stage(load_shard(snapshot, layers, Precision.FLOAT32))
    settings = NodeSettings(model_id="meshnet-tiny/llama", model_path=snapshot, layers=layers,
                            prefix_cache=False)  # fmt: skip
    prompt = [5, 17, 42, 99, 7]
    route = ("http://127.0.0.1:1/", "http://127.0.0.1:2/")
    ran: list[tuple[Step, torch.Tensor]] = []
    sent: list[tuple[str, Step]] = []

    async def run() -> None:
        service = NodeService(stage, settings, model_id=settings.model_id)
        original = service.run

        async def recorded(stage_, step, tensor, ahead=None, encode=None):
            ran.append((step, tensor))
            return await original(stage_, step, tensor, ahead, encode)

        async def send(hop, out, step):  # the rest of the chain: not here
            sent.append((hop, step))
            return as_result(out)

        service.run = recorded
        passes = HeadPasses(service)
        passes.send = send
        stage.open_session("s", owner="k")
        request = GenerationRequest(prompt_ids=prompt, max_tokens=2)
        await passes.prefill(stage, "s", "k", request, route=())
        await passes.step(stage, "s", "k", [11], len(prompt), route)
        await service.aclose()

    asyncio.run(run())
    (piece, ids), (hop0, token) = ran
    ids = ids.tensor() if isinstance(ids, wire.WireTensor) else ids
    assert piece.ids == tuple(prompt) and piece.position == 0 and ids.tolist() == [prompt]
    # a decode step's token: made a tensor on the compute thread (ADR-0011 decision 7)
    assert isinstance(token, wire.WireTensor) and token.tensor().tolist() == [[11]]
    assert hop0.route == route and hop0.ids == (11,) and hop0.sample
    assert (hop0.session_id, hop0.session_key, hop0.position) == ("s", "k", len(prompt))
    assert sent == [(route[0], replace(hop0, route=route[1:]))]

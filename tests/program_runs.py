"""Runs of the same shards through both stage engines (decode programs, ADR-0041/0043)."""

from __future__ import annotations

import pytest
import torch
from baselines import split_greedy

from meshnet_common.layers import LayerRange
from meshnet_node.engine.loader import load_shard
from meshnet_node.engine.stage import DecodeItem, Stage
from meshnet_node.programs import DecodeProgram


def engines(snapshot, bounds, precision, dtype=None) -> tuple[list[Stage], list[Stage]]:
    """The same loaded shards run by the modules and the program engines (the programs call
    the same modules)."""
    shards = [load_shard(snapshot, LayerRange(a, b), precision, dtype=dtype) for a, b in bounds]
    return [Stage(s, engine="modules") for s in shards], [
        Stage(s, engine="program") for s in shards
    ]


def same_run(reference: list[Stage], programs: list[Stage], prompt, steps: int) -> None:
    """Both engines give the same tokens and logits; every decode step's layers ran as
    programs (none of these steps has an attention mask)."""
    assert all(s.layers.engine == "modules" for s in reference)
    assert all(s.layers.engine == "program" for s in programs)
    calls = []
    original = DecodeProgram.__call__

    def counted(self, *args):
        calls.append(self)
        return original(self, *args)

    want_tokens, want_logits = split_greedy(reference, prompt, steps)
    assert not calls
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeProgram, "__call__", counted)
        tokens, logits = split_greedy(programs, prompt, steps)
    layers = sum(len(s.layers.layers) for s in programs)
    assert len(calls) == (steps - 1) * layers
    assert tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))


def batched_run(stages: list[Stage], prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Each session's prompt alone, then ``steps`` batched decode steps of all of them."""
    sids = [f"b{i}" for i in range(len(prompts))]
    position, last, logits = {}, {}, []
    for sid, prompt in zip(sids, prompts, strict=True):
        for stage in stages:
            stage.open_session(sid)
        out = stages[0].step(sid, 0, token_ids=torch.tensor([prompt]))
        for stage in stages[1:]:
            out = stage.step(sid, 0, hidden=out.hidden)
        position[sid], last[sid] = len(prompt), out.token.token_id
    for _ in range(steps):
        outs = stages[0].step_batch(
            [DecodeItem(s, position[s], token_ids=torch.tensor([[last[s]]])) for s in sids]
        )
        for stage in stages[1:]:
            outs = stage.step_batch(
                [
                    DecodeItem(s, position[s], hidden=o.hidden)
                    for s, o in zip(sids, outs, strict=True)
                ]  # fmt: skip
            )
        for sid, out in zip(sids, outs, strict=True):
            logits.append(out.logits)
            position[sid], last[sid] = position[sid] + 1, out.token.token_id
    for stage in stages:
        for sid in sids:
            stage.close_session(sid)
    return logits

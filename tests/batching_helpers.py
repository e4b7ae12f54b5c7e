"""Three sessions decoded through two in-process stages, batched or one at a time: the check
that a batched pass gives every session its own tokens (test_batching, test_lowbit)."""

from __future__ import annotations

import torch

from meshnet_node.engine.stage import DecodeItem, Stage


def prompts() -> list[list[int]]:
    return [
        torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (5, 70, 140)
    ]


def prefill(stages: list[Stage], sid: str, prompt: list[int]) -> int:
    for stage in stages:
        stage.open_session(sid)
    for start in range(0, len(prompt), 128):
        out = stages[0].step(sid, start, token_ids=torch.tensor([prompt[start : start + 128]]))
        out = stages[1].step(sid, start, hidden=out.hidden)
    return out.token.token_id


def decode_sessions(stages: list[Stage], batched: bool, steps: int = 8) -> dict[str, list[int]]:
    sids = [f"s{i}" for i in range(3)]
    tokens = {sid: [prefill(stages, sid, p)] for sid, p in zip(sids, prompts(), strict=True)}
    position = {sid: len(p) for sid, p in zip(sids, prompts(), strict=True)}
    for _ in range(steps):
        if batched:
            items = [
                DecodeItem(s, position[s], token_ids=torch.tensor([[tokens[s][-1]]])) for s in sids
            ]
            mids = stages[0].step_batch(items)
            outs = stages[1].step_batch(
                [
                    DecodeItem(s, position[s], hidden=m.hidden)
                    for s, m in zip(sids, mids, strict=True)
                ]
            )
        else:
            outs = []
            for s in sids:
                mid = stages[0].step(s, position[s], token_ids=torch.tensor([[tokens[s][-1]]]))
                outs.append(stages[1].step(s, position[s], hidden=mid.hidden))
        for s, out in zip(sids, outs, strict=True):
            tokens[s].append(out.token.token_id)
            position[s] += 1
    for stage in stages:
        for s in sids:
            stage.close_session(s)
    return tokens

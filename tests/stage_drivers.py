"""Drivers of in-process stages shared by tests: three sessions decoded batched or one at a
time (a batched pass gives every session its own tokens), and greedy decoding whose steps
carry drafts (verification keeps plain decoding's tokens). Used by test_batching,
test_speculation and test_lowbit."""

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


def hidden_steps(stage: Stage, batched: bool, lengths: tuple[int, ...] = (5, 70, 140),
                 steps: int = 4) -> list[torch.Tensor]:  # fmt: skip
    """Sessions prefilled to ``lengths`` on a middle stage, then ``steps`` one-token steps of
    random bf16 rows: each step's hidden output, batched or one session at a time."""
    width = stage.shard.hidden_size
    gen = torch.Generator().manual_seed(3)
    sids = [f"h{i}" for i in range(len(lengths))]
    for sid, n in zip(sids, lengths, strict=True):
        stage.open_session(sid)
        stage.step(sid, 0, hidden=torch.randn(1, n, width, generator=gen).to(torch.bfloat16))
    position = dict(zip(sids, lengths, strict=True))
    outs = []
    for _ in range(steps):
        rows = {s: torch.randn(1, 1, width, generator=gen).to(torch.bfloat16) for s in sids}
        if batched:
            got = stage.step_batch([DecodeItem(s, position[s], hidden=rows[s]) for s in sids])
        else:
            got = [stage.step(s, position[s], hidden=rows[s]) for s in sids]
        outs += [g.hidden for g in got]
        for s in sids:
            position[s] += 1
    for sid in sids:
        stage.close_session(sid)
    return outs


def draft_plan(step: int, truth: list[int], vocab: int) -> list[int]:
    """Drafts of 1-4 tokens from the true continuation: all right, the last one wrong, or
    the first one wrong, in turn (every accept / reject path of the verification)."""
    k = min(step % 4 + 1, len(truth))
    drafts = truth[:k]
    if drafts and step % 3 == 1:
        drafts[-1] = (drafts[-1] + 1) % vocab
    elif drafts and step % 3 == 2:
        drafts[0] = (drafts[0] + 1) % vocab
    return drafts


def speculative_greedy(stages, prompt: list[int], reference: list[int], vocab: int):
    """Greedy decoding through in-process stages, each decode step carrying drafts."""
    sid = "spec"
    for stage in stages:
        stage.open_session(sid)
    try:
        position, out = 0, None
        for lo in range(0, len(prompt), 128):
            chunk = prompt[lo : lo + 128]
            out = stages[0].step(sid, position, token_ids=torch.tensor([chunk]))
            for stage in stages[1:]:
                out = stage.step(sid, position, hidden=out.hidden)
            position += len(chunk)
        tokens = [out.token.token_id]
        step = 0
        while len(tokens) < len(reference):
            drafts = draft_plan(step, reference[len(tokens) :], vocab)
            drafts = drafts[: len(reference) - len(tokens) - 1]
            ids = [tokens[-1], *drafts]
            out = stages[0].step(sid, position, token_ids=torch.tensor([ids]),
                                 drafts=tuple(drafts))  # fmt: skip
            for stage in stages[1:]:
                out = stage.step(sid, position, hidden=out.hidden, drafts=tuple(drafts))
            got = [out.token.token_id, *(t.token_id for t in out.more or ())]
            assert len(got) <= len(drafts) + 1
            kept = len(got) - 1
            assert got[:kept] == drafts[:kept]
            tokens.extend(got)
            position += 1 + kept  # the next step starts after the kept drafts
            step += 1
        assert all(len(s.sessions) == 1 for s in stages)
        return tokens[: len(reference)]
    finally:
        for stage in stages:
            stage.close_session(sid)

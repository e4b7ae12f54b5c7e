"""Decode steps run ahead on a stage that is head and tail (docs/adr/0047).

Where one process holds the whole model, each token's step used to go back to the event loop
before the next one started: the loop saw the pass end, the head turned the token into text
and submitted the next step, and the compute thread woke for it, ~0.4-0.6 ms of a ~5 ms
SmolLM2 token in which the cores computed nothing. A step that runs ahead goes on, on the
compute thread, with the token it sampled: each further step is the same single-token step
(``Stage.step``) the head would have submitted, so it computes the same bits and samples the
same token, and the head receives the tokens as it receives a verified step's kept drafts
(``StepOutput.more``: every token but the last is in the cache, the last is the next
step's input).

It stops at ``limit`` further steps, at a token in ``ends`` (end of sequence, stop ids), and
as soon as ``go_on`` says no: another pass waits for the compute thread (another session's
step must not wait behind this one) or the pass has taken long enough for the head to stream
what it has. A stop string the head finds in the text leaves the tokens after it unused;
the cache then holds the model's own continuation past it, which the head never sends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from meshnet_common.errors import MeshnetError
from meshnet_node.engine.stage import DecodeItem, Stage, StepOutput

AHEAD_TOKENS = 8  # further steps a pass may run ahead: 8 of ~5 ms (SmolLM2) stream at once


class Down(Protocol):
    """Where a head that is not the tail sends a step that runs ahead and hears its token
    (``meshnet_node.dataplane.lane_burst.LaneBurst``, docs/adr/0059)."""

    steps: int  # how many steps of the head it ran (0: it did not run)

    def run(
        self, stage: Stage, item: DecodeItem, go_on: Callable[[], bool],
        timed: Callable[[Callable[[], object]], tuple[object, float]],
        give: Callable[[], None],
    ) -> StepOutput: ...  # fmt: skip


@dataclass(frozen=True)
class Ahead:
    """How far a session's decode step may run ahead: on a stage that is head and tail, or
    (``down``) on a head whose chain answers on its decode lane."""

    limit: int  # further steps at most (the request's tokens left, the context's room)
    ends: frozenset[int] = frozenset()  # tokens after which nothing follows
    down: Down | None = None  # a head that is not the tail: where its steps go


def run_ahead(
    stage: Stage, item: DecodeItem, ahead: Ahead, go_on: Callable[[], bool]
) -> StepOutput:
    """``item``'s step, then up to ``ahead.limit`` more of the same session, each with the
    token the last one sampled, while ``go_on()``; the first step's output, the later
    tokens in its ``more``."""
    out = stage.step(
        item.session_id, item.position, token_ids=item.token_ids, owner=item.owner, sample=True
    )
    more = []
    token, position = out.token, item.position + 1
    while (
        token is not None
        and len(more) < ahead.limit
        and token.token_id not in ahead.ends
        and go_on()
    ):
        ids = torch.tensor([[token.token_id]], dtype=torch.int64)
        try:
            token = stage.step(item.session_id, position, token_ids=ids, owner=item.owner).token
        except MeshnetError:  # refused before any layer ran (the KV budget): the head's
            break  # own next step meets it, with the tokens so far delivered
        if token is not None:
            more.append(token)
        position += 1
    if more:
        out.more = more
    return out


def steps_of(out: StepOutput) -> int:
    """How many single-token steps a pass that ran ahead computed."""
    return 1 + len(out.more or ())

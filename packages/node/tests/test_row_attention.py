"""A batched decode step's attention (``engine/row_attention.py``): per row, its projections
computed for all rows at once; the same outputs as row by row, every row run once."""

from __future__ import annotations

import torch
from torch import nn

from meshnet_node.engine.row_attention import RowAttention


class ToyAttention(nn.Module):
    """Projections around a per-row step with a side effect (a cache that grows)."""

    def __init__(self, width: int = 8, *, norm_first: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.o_proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width) if norm_first else None
        self.seen: list[int] = []  # rows run, in order (the "cache")

    def forward(self, hidden, b):
        self.seen.append(b)
        x = self.norm(hidden) if self.norm is not None else hidden
        q, k = self.q_proj(x), self.k_proj(x).tanh()
        return self.o_proj(q * k + b), None


def row_by_row(module, hidden):
    return torch.cat([module(hidden[b : b + 1], b)[0] for b in range(hidden.shape[0])])


def call(module, row, b):
    return module(row, b)[0]


def test_projections_are_batched_and_each_row_runs_once():
    attend = RowAttention()
    module = ToyAttention()
    hidden = torch.randn(5, 1, 8)
    want = row_by_row(module, hidden)
    module.seen.clear()
    for _ in range(2):  # learning the plan (first call), then using it
        got = attend(module, hidden, call)
        torch.testing.assert_close(got, want)
        assert module.seen == [0, 1, 2, 3, 4]
        module.seen.clear()
    plan = attend._plans[module]
    assert plan.inputs == ("q_proj", "k_proj") and plan.output == "o_proj"
    assert isinstance(module.q_proj, nn.Linear) and isinstance(module.o_proj, nn.Linear)


def test_a_projection_that_does_not_read_the_row_runs_as_written():
    attend = RowAttention()
    module = ToyAttention(norm_first=True)  # the projections read the normed row
    hidden = torch.randn(3, 1, 8)
    want = row_by_row(module, hidden)
    module.seen.clear()
    for _ in range(2):
        torch.testing.assert_close(attend(module, hidden, call), want)
    assert attend._plans[module].inputs == ()


def test_one_row():
    attend = RowAttention()
    module = ToyAttention()
    hidden = torch.randn(1, 1, 8)
    want = row_by_row(module, hidden)
    for _ in range(2):
        torch.testing.assert_close(attend(module, hidden, call), want)

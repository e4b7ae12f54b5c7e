"""A CPU shard's weights in one arena of 2 MiB pages (docs/adr/0048): the same values,
shapes and sharing, the old memory let go, and a stage computing the same bits."""

from __future__ import annotations

import gc

import torch
from torch import nn

from meshnet_common.layers import LayerRange
from meshnet_common.models.gguf_import import smollm2_gguf_path
from meshnet_common.precision import Precision
from meshnet_node.engine import huge_pages, loader
from meshnet_node.engine.huge_pages import HUGE_PAGE, hold_in_huge_pages
from meshnet_node.engine.stage import Stage
from meshnet_node.kernels.fused_linears import FusedPart


class Holder(nn.Module):
    """Weights as parameters, buffers, a view of them kept as a plain attribute, and a
    module outside the tree over the same memory."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(1024, 1024, bias=False)  # 4 MiB
        self.register_buffer("table", torch.arange(40000, dtype=torch.float32))
        self.small = nn.Parameter(torch.ones(8))
        self.rows = self.big.weight.detach()[10:20]  # a plain attribute: a view
        outside = nn.Linear(1024, 8, bias=False)
        outside.weight = nn.Parameter(self.big.weight.detach()[:8])
        self.__dict__["outside"] = outside  # not a child


def _old_alive(addresses: set[int]) -> int:
    gc.collect()
    return sum(
        1
        for o in gc.get_objects()
        if type(o) in (torch.Tensor, nn.Parameter) and not o.is_meta
        and o.untyped_storage().data_ptr() in addresses
    )  # fmt: skip


def test_weights_move_into_one_aligned_arena_as_they_were(monkeypatch):
    monkeypatch.setattr(huge_pages, "LEAST_WEIGHTS", 1 << 20)  # a 4 MiB module moves too
    torch.manual_seed(0)
    module = Holder()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    old = {
        module.big.weight.untyped_storage().data_ptr(),
        module.table.untyped_storage().data_ptr(),
    }
    small = module.small.untyped_storage().data_ptr()
    assert hold_in_huge_pages(module) == 1024 * 1024 * 4 + 40000 * 4
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    arena = module.big.weight.untyped_storage()
    assert module.table.untyped_storage().data_ptr() == arena.data_ptr()  # one arena
    assert module.big.weight.data_ptr() % HUGE_PAGE == 0  # the first weight on a huge page
    assert module.small.untyped_storage().data_ptr() == small  # small ones stay
    # views stay views of what moved: the plain attribute and the module outside the tree
    assert module.rows.data_ptr() == module.big.weight[10].data_ptr()
    assert module.outside.weight.data_ptr() == module.big.weight.data_ptr()
    assert isinstance(module.big.weight, nn.Parameter)
    del before
    assert _old_alive(old) == 0  # the old memory went back


def test_a_packed_stage_in_huge_pages_computes_the_same_bits(monkeypatch):
    path, layers = smollm2_gguf_path(), LayerRange(0, 20)  # over the 64 MiB floor
    held = loader.load_shard(path, layers, Precision.INT4, dtype=torch.float32)
    monkeypatch.setattr(loader, "hold_in_huge_pages", lambda modules, release: 0)
    plain = loader.load_shard(path, layers, Precision.INT4, dtype=torch.float32)
    layer = held.modules.layers[0]
    part = layer.mlp.gate_proj
    assert isinstance(part, FusedPart)  # its own product (prompts) reads the fused weight
    fused = part.group.fused.packed.packed
    assert part.packed.packed.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    big = [t for t in [*held.modules.parameters(), *held.modules.buffers()]
           if t.untyped_storage().nbytes() >= huge_pages.SMALLEST]  # fmt: skip
    assert len({t.untyped_storage().data_ptr() for t in big}) == 1
    outs = []
    for shard in (held, plain):
        stage = Stage(shard)
        stage.open_session("s")
        prompt = stage.step("s", 0, token_ids=torch.tensor([[1, 504, 3575, 282, 4649, 314]]))
        step = stage.step("s", 6, token_ids=torch.tensor([[prompt.hidden[0, -1].argmax() % 1000]]))
        outs.append((prompt.hidden, step.hidden))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))

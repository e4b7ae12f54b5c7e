"""Attention of a batched decode step, one session (row) at a time, with the projections of
every row computed at once.

A batched decode pass runs B sessions' tokens through a layer together, but each session
attends to its own KV cache, so the attention module is called once per row. Called as
transformers wrote it, each row then also runs the module's projections on its own: B
matrix-vector products per weight, each reading the whole weight, where one (B x H)
product reads it once. On a CPU that is most of a batched pass (SmolLM2, 10 layers, 16
sessions: 95 ms against 19 ms for one).

``attend_rows`` keeps every family's attention code as transformers wrote it and only
moves its projections out of the per-row loop. The first time it meets a module it runs
row 0 through it with each ``nn.Linear`` child watched (``_Watch``), to learn which
children read the row itself (the input projections: ``q_proj``, ``k_proj``, ``v_proj``;
DeepSeek's ``q_a_proj`` and ``kv_a_proj_with_mqa``; Phi-3's ``qkv_proj``) and whether
one child's output is what the module returns (the output projection, ``o_proj``). From
then on the input projections run once on all rows and hand each row its slice
(``_Rows``), and the output projection runs once on all rows' results. Anything else in
the module (norms on q and k, rotary, the cache update, the attention itself, sinks,
soft-capping, a projection of a projection) runs per row, unchanged.

``attend_together`` goes further where a module's attention goes through transformers'
attention interface (every supported family): the module runs once for all rows, as
written (projections, norms, rotary on the whole batch), and only what depends on a
row's own session runs per row: its cache update (``RowCaches``) and the attention
function itself, called with the row's keys, values and mask exactly as a one-token step
calls it (``enable_together`` points the module at ``_rows_attention``). A row's result
is then the one-token step's bit for bit. Rows repeating a session (a verification pass)
take ``attend_rows``: their masks must see the rows before them.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from meshnet_node.engine.bf16_upcast import upcast_min_rows
from meshnet_node.engine.growing_cache import update_rows
from meshnet_node.kernels import row_sdpa
from meshnet_node.kernels.fused_linears import FusedPart

RowCall = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]  # (module, row, b) -> output


@dataclass(frozen=True)
class _Plan:
    inputs: tuple[str, ...]  # Linear children that read the row (each once)
    output: str | None  # the Linear child whose output the module returns, if any


class _Watch(nn.Module):
    """Stands in for a Linear child while a row runs: notes what it was given and gave."""

    def __init__(self, inner: nn.Linear, row: torch.Tensor) -> None:
        super().__init__()
        self.inner, self.row = inner, row
        self.calls = 0
        self.read_row = False
        self.out: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.read_row = x is self.row
        self.out = self.inner(x)
        return self.out


class _Rows(nn.Module):
    """Stands in for an input projection: row ``b``'s slice of its output for all rows.

    ``row``, ``out`` and ``b`` change for every row of every layer: ``point`` writes them
    straight into the instance dict, past ``nn.Module.__setattr__`` and its checks (~10 µs
    a call here, six calls per row and layer)."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner
        self.point(None, None, 0)

    def point(self, row: torch.Tensor | None, out: torch.Tensor | None, b: int) -> None:
        state = self.__dict__
        state["row"], state["out"], state["b"] = row, out, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x is self.row:
            return self.out[self.b : self.b + 1]
        return self.inner(x)  # not the row after all: computed as written


class _Later(nn.Module):
    """Stands in for the output projection: passes the row's result through, to be
    projected with every other row's at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _swapped(module: nn.Module, stand_ins: dict[str, nn.Module]) -> dict[str, nn.Module]:
    children = module._modules
    originals = {name: children[name] for name in stand_ins}
    children.update(stand_ins)
    return originals


def _learn(module: nn.Module, row: torch.Tensor, call: RowCall) -> tuple[_Plan, torch.Tensor]:
    """Run row 0 through ``module`` as written, watching its Linear children."""
    watches = {
        name: _Watch(child, row)
        for name, child in module.named_children()
        if isinstance(child, nn.Linear | FusedPart)
    }
    originals = _swapped(module, watches)
    try:
        result = call(module, row, 0)
    finally:
        module._modules.update(originals)
    inputs = tuple(n for n, w in watches.items() if w.calls == 1 and w.read_row)
    outputs = [n for n, w in watches.items() if w.calls == 1 and not w.read_row
               and w.out is result]  # fmt: skip
    return _Plan(inputs, outputs[0] if len(outputs) == 1 else None), result


class RowAttention:
    """The plans learned so far, one per attention module."""

    def __init__(self) -> None:
        self._plans: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()
        self._stand_ins: weakref.WeakKeyDictionary[nn.Module, dict[str, _Rows]] = (
            weakref.WeakKeyDictionary()
        )

    def __call__(self, module: nn.Module, hidden: torch.Tensor, call: RowCall) -> torch.Tensor:
        """``call(module, row, b)`` for each row ``b`` of ``hidden`` (B, 1, H), that is the
        module's output for that row; returns every row's, concatenated (B, 1, H').

        Each row runs through the module exactly once (its KV cache grows by one)."""
        rows = [hidden[b : b + 1] for b in range(hidden.shape[0])]
        done: list[torch.Tensor] = []  # rows already through the whole module
        plan = self._plans.get(module)
        if plan is None:
            plan, first = _learn(module, rows[0], call)
            self._plans[module] = plan
            self._stand_ins[module] = {n: _Rows(module._modules[n]) for n in plan.inputs}
            done.append(first)
        todo = range(len(done), len(rows))
        if not todo:
            return torch.cat(done)
        stand_ins = self._stand_ins[module]
        rest = hidden if not done else hidden[len(done) :]
        swap: dict[str, nn.Module] = {}
        for name, stand_in in stand_ins.items():
            stand_in.point(None, stand_in.inner(rest), 0)  # every row's projection at once
            swap[name] = stand_in
        output = module._modules[plan.output] if plan.output is not None else None
        if output is not None:
            swap[plan.output] = _LATER
        results: list[torch.Tensor] = []
        originals = _swapped(module, swap)
        try:
            for b in todo:
                for stand_in in stand_ins.values():
                    stand_in.point(rows[b], stand_in.out, b - len(done))
                results.append(call(module, rows[b], b))
        finally:
            module._modules.update(originals)
            for stand_in in stand_ins.values():
                stand_in.point(None, None, 0)
        attended = torch.cat(results)
        if output is not None:
            attended = output(attended)
        return torch.cat([*done, attended]) if done else attended


_LATER = _Later()


TOGETHER = "meshnet_rows"  # the attention implementation ``enable_together`` installs
_together = threading.local()  # .rows: the RowCaches of the call in progress on this thread


class NotTogether(Exception):
    """The module changed what the cache returned before attending to it (DeepSeek's MLA
    expands its latent cache): its rows must run one by one."""


class RowCaches:
    """Stands in for the cache while a module runs once for all rows. The update is held
    until the attention function runs (``_rows_attention``), which checks that it was given
    what ``update`` returned, then writes each row's keys and values to its own session's
    cache and attends row by row."""

    def __init__(self, caches: Sequence[Cache], masks: Sequence[torch.Tensor | None]) -> None:
        self.caches, self.masks = caches, masks
        self.held: tuple | None = None  # (keys, values, layer_idx, args, kwargs)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.held = (key_states, value_states, layer_idx, args, kwargs)
        return key_states, value_states

    def write(self, key, value) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each row's keys and values after its cache took the new ones."""
        if self.held is None or key is not self.held[0] or value is not self.held[1]:
            raise NotTogether  # nothing written yet: the caller can still go row by row
        keys, values, layer_idx, args, kwargs = self.held
        return update_rows(self.caches, keys, values, layer_idx, *args, **kwargs)


def _rows_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention function of a module ``enable_together`` set up: outside
    ``attend_together`` the one it had (bit for bit the same call), inside it that function
    once per row, on the row's own keys, values and mask."""
    original = module.__dict__["_meshnet_attention"]
    rows: RowCaches | None = getattr(_together, "rows", None)
    if rows is None:
        return original(module, query, key, value, attention_mask, **kwargs)
    kv = rows.write(key, value)
    position_ids = kwargs.pop("position_ids", None)
    dtype = query.dtype
    wide = module.__dict__.get("_meshnet_widen", False) and len(kv) >= upcast_min_rows(
        attention=True
    )
    if wide:  # --widen-bf16 (ADR-0027): many rows attend in float32, rounded back once
        query = query.float()
    else:  # the same calls, the rows over the compute thread's team (ADR-0051)
        attended = row_sdpa.attend(module, original, query, kv, rows.masks, kwargs)
        if attended is not None:
            return attended, None
    outs = []
    for b, ((k, v), mask) in enumerate(zip(kv, rows.masks, strict=True)):
        if position_ids is not None:
            kwargs["position_ids"] = position_ids[b : b + 1]
        if wide:
            k, v = k.float(), v.float()
            if mask is not None and mask.is_floating_point():
                mask = mask.float()
        outs.append(original(module, query[b : b + 1], k, v, mask, **kwargs)[0])
    attended = torch.cat(outs)
    return (attended.to(dtype) if wide else attended), None


AttentionInterface.register(TOGETHER, _rows_attention)


def enable_together(module: nn.Module) -> bool:
    """Route ``module``'s attention function through ``_rows_attention`` (its own config
    copy names it; the shard's config, which builds the masks, is left alone). False where
    the module has no transformers attention implementation to keep."""
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == TOGETHER:
        return True
    if implementation == "eager":
        original = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    elif implementation in AttentionInterface._global_mapping:
        original = AttentionInterface._global_mapping[implementation]
    else:
        original = None
    if original is None:
        return False
    own = copy.copy(config)
    own._attn_implementation_internal = TOGETHER
    module.config = own
    module.__dict__["_meshnet_attention"] = original
    return True


def widen_attention(module: nn.Module) -> bool:
    """With ``--widen-bf16`` where bf16 arithmetic is emulated (ADR-0027): the per-row
    attention calls of a batched step of many rows run in float32 on the bf16 keys and
    values, rounded back to bf16 (torch's bf16 SDPA costs ~2.5-6x float32's per call on
    such a CPU). Only for transformers' SDPA, whose float32 kernel takes the same
    arguments; False, and nothing changed, for any other attention function."""
    if module.__dict__.get("_meshnet_attention") is not sdpa_attention_forward:
        return False
    module.__dict__["_meshnet_widen"] = True
    return True


def together_ok(module: nn.Module, caches: Sequence[Cache]) -> bool:
    """Whether ``attend_together`` may serve these rows: the module is set up for it (and
    has not shown it cannot be), and no two rows share a session (a row's mask must not
    see another row of its own session)."""
    state = module.__dict__
    return (
        "_meshnet_attention" in state
        and not state.get("_meshnet_rows_only", False)
        and len({id(c) for c in caches}) == len(caches)
    )


def together_plain(module: nn.Module, caches: Sequence[Cache]) -> bool:
    """``together_ok``, and the rows' attention calls are the module's function as it is
    (not widened to float32, ``widen_attention``): what a decode program's batched step
    reproduces (docs/adr/0041)."""
    return together_ok(module, caches) and not module.__dict__.get("_meshnet_widen", False)


def attend_together(
    module: nn.Module,
    caches: Sequence[Cache],
    masks: Sequence[torch.Tensor | None],
    run: Callable[[RowCaches], torch.Tensor],
) -> torch.Tensor | None:
    """``run(row_caches)`` (``module`` called once, for every row, with ``cache=row_caches``)
    with each row's attention against its own cache and mask; ``masks`` are built before
    any row's cache grows, as a one-token step builds its mask. None, with no cache
    touched, when the module turns out not to attend to what its cache returned: it then
    always goes row by row (``attend_rows``)."""
    rows = RowCaches(caches, masks)
    _together.rows = rows
    try:
        return run(rows)
    except NotTogether:
        module.__dict__["_meshnet_rows_only"] = True
        return None
    finally:
        _together.rows = None

"""Which path a pass takes through a stage's layers (docs/adr/0041)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch
from torch import nn

from meshnet_node.programs.decode import DecodeProgram, decode_programs
from meshnet_node.programs.native import NativeStack, native_stack

ENGINES = ("native", "program", "modules")


class StageLayers:
    """A stage's decoder layers, run for one pass.

    - ``engine="native"`` (docs/adr/0044): every pass of a packed low-bit stage whose layers
      all have C++ steps runs through its ``NativeStack`` (prompt chunks, steps, batches, drafts);
      other stages run as with ``"program"``.
    - ``engine="program"``: a one-token step, and a batched step of distinct sessions,
      through each layer's ``DecodeProgram`` (where every layer has one): transformers'
      numbers bit for bit; prompt chunks and verification passes through the modules.
    - ``engine="modules"``: every pass through transformers' modules (the reference)."""

    def __init__(
        self, layers: Sequence[nn.Module], layer_types: Sequence[str], call_layer: Callable,
        call_batched: Callable, engine: str = "native",
    ) -> None:  # fmt: skip
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        self.layers, self.layer_types = list(layers), list(layer_types)
        self.call_layer, self.call_batched = call_layer, call_batched
        self.programs: list[DecodeProgram] | None = None
        self.native: NativeStack | None = None
        if engine != "modules":
            self.programs = decode_programs(self.layers)
        if engine == "native" and self.programs is not None:
            self.native = native_stack(self.layers, self.programs, self.layer_types)

    @property
    def engine(self) -> str:
        """The path this stage's passes take: ``native``, ``program`` or ``modules``."""
        if self.native is not None:
            return "native"
        return "modules" if self.programs is None else "program"

    def run(
        self, hidden: torch.Tensor, *, first: int, masks: dict, rotary: dict, position_ids,
        cache,
    ) -> torch.Tensor:  # fmt: skip
        """``hidden`` (1, T, H) through layers ``first..`` (local), each appending to
        ``cache``; ``masks`` and ``rotary`` by attention type (``build_masks``)."""
        if self.native is not None and first < len(self.layers):  # positions as rows
            rows = hidden.shape[1]
            cos, sin = (t[0].unsqueeze(1) for t in rotary[self.layer_types[first]])
            out = self._native(hidden[0].unsqueeze(1), first, cos, sin, [(cache, rows)])
            return out.view(hidden.shape)
        programs = self.programs if hidden.shape[1] == 1 else None
        for i in range(first, len(self.layers)):
            layer_type = self.layer_types[i]
            mask = masks[layer_type]
            if programs is not None:
                hidden = programs[i](hidden, cache, mask, rotary[layer_type])
                continue
            hidden = self.call_layer(
                self.layers[i], hidden, mask=mask, position_ids=position_ids, cache=cache,
                position_embeddings=rotary[layer_type],
            )  # fmt: skip
        return hidden

    def stepping(
        self, hidden: torch.Tensor, *, first: int, masks: dict, rotary: dict, position_ids,
        cache,
    ) -> Generator[None, None, torch.Tensor]:  # fmt: skip
        """``run``, yielding after each layer but the last (a prompt's pass, ADR-0053): the
        same calls, so the same bits, whatever runs between them. The native stack runs its
        layers in one call."""
        if self.native is not None and first < len(self.layers):
            return self.run(hidden, first=first, masks=masks, rotary=rotary,
                            position_ids=position_ids, cache=cache)  # fmt: skip
        for i in range(first, len(self.layers)):
            if i > first:
                yield
            layer_type = self.layer_types[i]
            hidden = self.call_layer(
                self.layers[i], hidden, mask=masks[layer_type], position_ids=position_ids,
                cache=cache, position_embeddings=rotary[layer_type],
            )  # fmt: skip
        return hidden

    def run_batch(
        self, hidden: torch.Tensor, *, first: int, rows_for: Callable[[str], list],
        together: bool,
    ) -> torch.Tensor:  # fmt: skip
        """B rows' one-token steps (B, 1, H) through layers ``first..``; ``rows_for(type)``:
        each row's ``SessionContext`` for a layer of that attention type; ``together``: the
        rows are distinct sessions whose attention modules would each run once for all
        rows, as written (``together_plain``): then through the programs. The native
        engine takes every batch: rows of one session (drafts) are consecutive."""
        if self.native is not None and first < len(self.layers):
            contexts = rows_for(self.layer_types[first])
            cos = torch.cat([c.position_embeddings[0] for c in contexts])
            sin = torch.cat([c.position_embeddings[1] for c in contexts])
            groups: list[list] = []
            for c in contexts:
                if groups and groups[-1][0] is c.cache:
                    groups[-1][1] += 1
                else:
                    groups.append([c.cache, 1])
            return self._native(hidden, first, cos, sin, groups)
        programs = self.programs if together else None
        for i in range(first, len(self.layers)):
            rows = rows_for(self.layer_types[i])
            if programs is not None:
                hidden = programs[i].rows(hidden, rows)
            else:
                hidden = self.call_batched(self.layers[i], hidden, rows)
        return hidden

    def _native(self, rows: torch.Tensor, first: int, cos, sin, groups) -> torch.Tensor:
        """Rows (N, 1, H) through the native stack from layer ``first`` (one rotary for
        them all: the engine runs full attention only)."""
        return self.native(first, rows, cos, sin, groups)  # type: ignore[misc]


def drain(steps: Generator[None, None, object]):
    """Run a generator of steps (``Stage.stepping``) to its end: its return value."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value

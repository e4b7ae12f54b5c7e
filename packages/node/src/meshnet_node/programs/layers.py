"""Which path a pass takes through a stage's layers (docs/adr/0041)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from meshnet_node.programs.decode import DecodeProgram, decode_programs

ENGINES = ("program", "modules")


class StageLayers:
    """A stage's decoder layers, run for one pass: a one-token step, and a batched step of
    distinct sessions, through each layer's ``DecodeProgram`` (``engine="program"``, where
    every layer has one); transformers' modules otherwise (prompt chunks, verification
    passes, and every pass with ``engine="modules"``: the reference path)."""

    def __init__(
        self, layers: Sequence[nn.Module], layer_types: Sequence[str], call_layer: Callable,
        call_batched: Callable, engine: str = "program",
    ) -> None:  # fmt: skip
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        self.layers, self.layer_types = list(layers), list(layer_types)
        self.call_layer, self.call_batched = call_layer, call_batched
        self.programs: list[DecodeProgram] | None = None
        if engine == "program":
            self.programs = decode_programs(self.layers)

    @property
    def engine(self) -> str:
        """``program`` where one-token steps take the programs, else ``modules``."""
        return "modules" if self.programs is None else "program"

    def run(
        self, hidden: torch.Tensor, *, first: int, masks: dict, rotary: dict, position_ids,
        cache,
    ) -> torch.Tensor:  # fmt: skip
        """``hidden`` (1, T, H) through layers ``first..`` (local), each appending to
        ``cache``; ``masks`` and ``rotary`` by attention type (``build_masks``)."""
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

    def run_batch(
        self, hidden: torch.Tensor, *, first: int, rows_for: Callable[[str], list],
        together: bool,
    ) -> torch.Tensor:  # fmt: skip
        """B rows' one-token steps (B, 1, H) through layers ``first..``; ``rows_for(type)``:
        each row's ``SessionContext`` for a layer of that attention type; ``together``: the
        rows are distinct sessions whose attention modules would each run once for all
        rows, as written (``together_plain``): then through the programs."""
        programs = self.programs if together else None
        for i in range(first, len(self.layers)):
            rows = rows_for(self.layer_types[i])
            if programs is not None:
                hidden = programs[i].rows(hidden, rows)
            else:
                hidden = self.call_batched(self.layers[i], hidden, rows)
        return hidden

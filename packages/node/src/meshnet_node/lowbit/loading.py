"""Packing a stage's weights as they are read, one tensor (one expert) at a time.

The loader hands this the range's tensor names before it loads anything else; the packer
takes the Linear weights and expert tensors its precision packs, reads each alone from the
checkpoint, packs it and puts a ``PackedLinear`` / ``PackedExperts`` in the model, so the
range never sits in memory at 16 bits (peak: the packed range plus one matrix). What it
leaves (norms, routers, embeddings, attention of an MXFP4 model) loads as before.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn
from transformers.pytorch_utils import Conv1D

from meshnet_common.errors import ModelError
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.int4_formats import Int4Format
from meshnet_common.models.native_formats import fp8_dequantize, mxfp4_dequantize
from meshnet_common.precision import Precision, quantized_tensor
from meshnet_node.lowbit.gguf_blocks import (
    BLOCKS,
    FLOAT_TYPES,
    GROUP,
    KEPT,
    GgufTensors,
    int4_weight,
    int8_weight,
    kept_weight,
)
from meshnet_node.lowbit.int4_checkpoints import Int4Linears
from meshnet_node.lowbit.modules import PackedExperts, PackedLinear
from meshnet_node.lowbit.packed import Int4Weight, Int8Weight, PackedWeight
from meshnet_node.lowbit.shipped import DenseWeight, Fp8Weight, Mxfp4Weight

logger = logging.getLogger(__name__)

PACKED = (Precision.INT8, Precision.INT4, Precision.FP8, Precision.MXFP4)
SCALE_INV = "_scale_inv"
# Routers choose experts: a rounding there changes which experts run, for a few bytes saved.
_ROUTERS = (".gate.weight", ".router.weight", "shared_expert_gate.weight")
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+?)\."
    r"(?P<kind>weight|weight_scale_inv|qweight|weight_packed|qzeros|scales|g_idx|weight_scale"
    r"|weight_zero_point|weight_shape)$"
)
_FUSED_EXPERTS = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<kind>|_blocks|_scales|_bias)$"
)
_ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
          "down_proj": "down", "w2": "down"}  # fmt: skip


@dataclass
class _Plan:
    """Which of the range's tensors the packer takes, and how."""

    linears: dict[str, str] = field(default_factory=dict)  # module path -> weight name
    experts: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    taken: set[str] = field(default_factory=set)


class ShardPacker:
    """Packs the Linear layers and experts of a layer range at ``precision`` (int8, int4:
    quantized from the checkpoint's values; fp8, mxfp4: the checkpoint's own bytes)."""

    def __init__(self, index: CheckpointIndex, precision: Precision, dtype: torch.dtype,
                 group_size: int, native: tuple[str, tuple[int, int]] | None,
                 int4: Int4Format | None = None) -> None:  # fmt: skip
        if precision not in PACKED:
            raise ValueError(f"{precision.value} is not a packed precision")
        self.index, self.precision, self.dtype = index, precision, dtype
        self.group_size = group_size
        self.fp8_block = native[1] if native is not None and native[0] == "fp8" else (128, 128)
        self._files = ExitStack()
        self._handles: dict[str, object] = {}
        self._gguf = GgufTensors(index) if index.gguf is not None else None
        # an int4 checkpoint's packed Linears (GPTQ / AWQ / compressed-tensors)
        self._int4 = Int4Linears(int4, self._read) if int4 is not None else None
        self._present = set(index.tensors)

    # -- what to take ---------------------------------------------------------------------

    def plan(self, names: list[str], model: nn.Module) -> _Plan:
        """Split the range's tensor names: packed Linears, experts per layer, the rest."""
        plan = _Plan()
        present = set(names)
        for name in names:
            layer = self.index.layer_of(name)
            if layer is None:
                continue
            if _PER_EXPERT.match(name) or _FUSED_EXPERTS.match(name):
                plan.experts[layer].append(name)
                plan.taken.add(name)
            elif (path := self._shipped_int4(name, model)) is not None:
                plan.linears[path] = name
                plan.taken.update(self._int4.parts_of(path, present))
                plan.taken.update(n for n in (path + ".bias",) if n in present)
            elif self._packs_linear(name, present, model):
                path = name[: -len(".weight")]
                plan.linears[path] = name
                plan.taken.update(
                    n for n in (name, name + SCALE_INV, path + ".bias") if n in present
                )
        return plan

    def _shipped_int4(self, name: str, model: nn.Module) -> str | None:
        """The path of the Linear whose int4 codes ``name`` holds, if the model has it."""
        path = self._int4.path_of(name) if self._int4 is not None else None
        if path is None:
            return None
        try:
            module = model.get_submodule(path)
        except AttributeError as exc:
            raise ModelError(f"{name}: packed int4 codes for no Linear of the model") from exc
        return path if isinstance(module, nn.Linear) else None

    def _packs_linear(self, name: str, present: set[str], model: nn.Module) -> bool:
        if not name.endswith(".weight") or name.endswith(_ROUTERS):
            return False
        try:
            module = model.get_submodule(name[: -len(".weight")])
        except AttributeError:
            return False  # renamed by the family's conversion: loads as a plain tensor
        if not isinstance(module, nn.Linear | Conv1D):
            return False
        shape = tuple(self.index.tensors[name].shape)
        return quantized_tensor(
            name, shape, self.precision, gpt2=isinstance(module, Conv1D),
            group_size=self.group_size, names=present,
        )  # fmt: skip

    # -- reading --------------------------------------------------------------------------

    def _handle(self, name: str):
        fname = self.index.tensors[name].file
        if fname not in self._handles:
            path = str(self.index.root / fname)
            self._handles[fname] = self._files.enter_context(safe_open(path, framework="pt"))
        return self._handles[fname]

    def _read(self, name: str) -> torch.Tensor:
        """The tensor, backed by the file's mapping: what is packed from it is a new tensor,
        what is kept as read must be copied (``_kept``). A GGUF's: its values in float32."""
        if self._gguf is not None:
            return self._gguf.dense(name, torch.float32)
        return self._handle(name).get_tensor(name)

    def _read_expert(self, name: str, expert: int) -> torch.Tensor:
        return self._handle(name).get_slice(name)[expert]

    def _kept(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        tensor = self._read(name)
        return tensor.to(dtype=dtype or tensor.dtype, copy=True)  # detached from the mapping

    def close(self) -> None:
        self._files.close()
        self._handles.clear()

    # -- packing --------------------------------------------------------------------------

    def quantize(self, weight: torch.Tensor | list[torch.Tensor]) -> PackedWeight:
        """An ``[out, in]`` matrix (or its row blocks, stacked) at this precision; dense where
        the format cannot hold it."""
        parts = weight if isinstance(weight, list) else [weight]
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        if self.precision is Precision.INT8:
            return Int8Weight.quantize(weight, self.dtype)
        group = Int4Weight.group_for(shape, self.group_size)
        # each part packs alone as the memory accounting prices it (gate and up separately)
        if (
            self.precision is Precision.INT4
            and group is not None
            and all(Int4Weight.group_for(tuple(p.shape), self.group_size) == group for p in parts)
        ):
            return Int4Weight.quantize(weight, group, self.dtype)
        return DenseWeight(torch.cat([p.to(self.dtype) for p in parts]))

    def _matrix(self, name: str, stored: torch.Tensor | None = None) -> PackedWeight:
        """A Linear weight by checkpoint name: FP8 bytes kept or dequantized, then packed;
        a GGUF's blocks go straight to int4 / int8 (``_gguf_blocks``)."""
        if stored is None and self._gguf_blocks(name):
            raw, fmt = self._gguf.raw(name), self._gguf.fmt(name)
            if fmt in KEPT:  # Q5_*, Q6_K, Q8_0: their own values (docs/adr/0049)
                return kept_weight(raw, fmt)
            if fmt in BLOCKS and self._int4_holds(name):  # 4-bit blocks as they are, at int8 too
                return int4_weight(raw, fmt, self.dtype)
            if self.precision is Precision.INT8:
                return int8_weight(raw, fmt, self.dtype)
            return int4_weight(raw, fmt, self.dtype)
        if stored is None and self._int4 is not None and (path := self._int4.path_of(name)):
            weight = self._int4.weight(path, self.dtype, self._present)  # as shipped
            if self.precision is Precision.INT4:
                return weight
            return self.quantize(weight.dequantize(torch.float32))
        weight = self._read(name) if stored is None else stored
        if weight.dtype == torch.float8_e4m3fn:
            scale = self._read(name + SCALE_INV)
            if self.precision is Precision.FP8:
                return Fp8Weight(weight.clone(), scale.clone(), self.fp8_block)
            weight = fp8_dequantize(weight, scale, self.fp8_block)
        return self.quantize(weight)

    def _gguf_blocks(self, name: str) -> bool:
        """Whether ``name`` is a GGUF block tensor packed from its blocks, 256 rows at a time
        (``gguf_blocks``): Q5_*, Q6_K and Q8_0 kept in their values, Q4_0/Q4_1/Q4_K as
        they are (int4, group 32) where int4 holds the shape, at int4 and int8 alike; any
        other type rounded from its values, at int4 to group 32, at int8 to a scale per row.
        Float tensors and shapes int4 cannot hold are read as values and packed as any
        checkpoint's."""
        if self._gguf is None or self._gguf.fmt(name) in FLOAT_TYPES:
            return False
        if self.precision is Precision.INT8 or self._gguf.fmt(name) in KEPT:
            return True
        return self.precision is Precision.INT4 and self._int4_holds(name)

    def _int4_holds(self, name: str) -> bool:
        shape = tuple(self.index.tensors[name].shape)
        return Int4Weight.group_for(shape, GROUP) == GROUP

    def pack_linears(self, model: nn.Module, plan: _Plan, after_layer=lambda: None) -> int:
        """Put a PackedLinear in place of each planned Linear; ``after_layer`` runs when a
        layer's are done (the loader hands freed temporaries back to the OS there)."""
        last_layer = None
        for path, name in plan.linears.items():
            if last_layer is not None and self.index.layer_of(name) != last_layer:
                after_layer()
            last_layer = self.index.layer_of(name)
            parent_path, _, attr = path.rpartition(".")
            module = model.get_submodule(path)
            weight = None  # read by _matrix, which may take a GGUF's blocks as they are
            if isinstance(module, Conv1D):
                weight = self._read(name).t()  # GPT-2 stores [in, out]
            bias_name = path + ".bias"
            bias = self._kept(bias_name, self.dtype) if bias_name in self.index.tensors else None
            setattr(model.get_submodule(parent_path), attr,
                    PackedLinear(self._matrix(name, weight), bias))  # fmt: skip
        return len(plan.linears)

    def pack_experts(
        self, layer: nn.Module, names: list[str], after_expert=lambda: None
    ) -> PackedExperts:
        """The layer's routed experts, read and packed expert by expert (``after_expert``
        runs after each: the loader hands its temporaries back to the OS there)."""
        path, family_module = _experts_module(layer)
        per_expert: dict[int, dict[str, str]] = defaultdict(dict)
        fused: dict[str, str] = {}
        for name in names:
            if m := _PER_EXPERT.match(name):
                if m["kind"] in ("weight", "qweight", "weight_packed"):
                    role = _ROLES.get(m["proj"])
                    if role is None:
                        raise ModelError(f"{name}: an expert projection meshnet does not know")
                    per_expert[int(m["expert"])][role] = name
            elif m := _FUSED_EXPERTS.match(name):
                fused[m["proj"] + m["kind"]] = name
        gate_up: list[list[PackedWeight]] = []
        down: list[PackedWeight] = []
        for e in range(family_module.num_experts):
            if per_expert:
                gate_up.append(self._gate_up(per_expert[e]))
                down.append(self._matrix(per_expert[e]["down"]))
            else:
                gate_up.append([self._fused(fused, "gate_up_proj", e)])
                down.append(self._fused(fused, "down_proj", e))
            after_expert()
        biases = tuple(
            self._kept(fused[b], self.dtype) if b in fused else None
            for b in ("gate_up_proj_bias", "down_proj_bias")
        )
        packed = PackedExperts(family_module, gate_up, down, *biases)
        parent_path, _, attr = path.rpartition(".")
        setattr(layer.get_submodule(parent_path) if parent_path else layer, attr, packed)
        return packed

    def _gate_up(self, names: dict[str, str]) -> list[PackedWeight]:
        if self._int4 is not None and self._int4.path_of(names["gate"]):
            return [self._matrix(names["gate"]), self._matrix(names["up"])]  # each as shipped
        if self._gguf_blocks(names["gate"]) and self._gguf_blocks(names["up"]):
            # a GGUF's blocks, each part its own weight (int8's scale per row: the same values
            # as one weight of both)
            return [self._matrix(names["gate"]), self._matrix(names["up"])]
        gate, up = self._read(names["gate"]), self._read(names["up"])
        if self.precision is Precision.FP8 and gate.dtype == torch.float8_e4m3fn:
            # kept as shipped: each part has its own tile grid (a ragged edge may sit between)
            return [self._matrix(names["gate"], gate), self._matrix(names["up"], up)]
        # (2I, H): one product per expert, quantized from the two parts (no stacked copy)
        return [self.quantize([self._plain(names["gate"], gate), self._plain(names["up"], up)])]

    def _plain(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype == torch.float8_e4m3fn:
            weight = fp8_dequantize(weight, self._read(name + SCALE_INV), self.fp8_block)
        return weight

    def _fused(self, fused: dict[str, str], proj: str, expert: int) -> PackedWeight:
        """gpt-oss: one expert of a fused ``[E, in, out]`` tensor, or of its MXFP4 blocks."""
        if proj + "_blocks" in fused:
            blocks = self._read_expert(fused[proj + "_blocks"], expert)  # (out, in/32, 16)
            scales = self._read_expert(fused[proj + "_scales"], expert)  # (out, in/32)
            if self.precision is Precision.MXFP4:
                return Mxfp4Weight(blocks.clone(), scales.clone())
            weight = mxfp4_dequantize(blocks[None], scales[None])[0].t()  # (out, in)
            return self.quantize(weight)
        if proj not in fused:
            raise ModelError(f"{self.index.root}: experts lack {proj}")
        return self.quantize(self._read_expert(fused[proj], expert).t())  # (out, in)


def _experts_module(layer: nn.Module) -> tuple[str, nn.Module]:
    """The family's experts module in a decoder layer (fused 3-D expert parameters)."""
    for path, module in layer.named_modules():
        down = getattr(module, "down_proj", None)
        if isinstance(down, nn.Parameter) and down.dim() == 3:
            return path, module
    raise ModelError("expert tensors for a layer without an experts module")

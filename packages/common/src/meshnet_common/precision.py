"""Weight precisions a node may declare, which tensors each one quantizes, and what they
cost in memory. Pure Python: the tracker prices ranges with it and never imports torch."""

from __future__ import annotations

import re
from collections.abc import Collection
from enum import StrEnum
from typing import TYPE_CHECKING

from meshnet_common.errors import InvalidRequest

if TYPE_CHECKING:  # torch is imported only where a dtype is asked for (never on a tracker)
    import torch

# What --quantization accepts: a precision, or auto (the checkpoint's own packed format if it
# ships one, else the compute dtype).
QUANTIZATION_CHOICES = ("auto", "bfloat16", "float32", "int8", "int4", "nf4", "fp8", "mxfp4")
# --dtype: activations, norms, embeddings, KV cache; auto: float32 for a GGUF (as llama.cpp
# computes the files it makes), else bfloat16 (docs/adr/0046)
DTYPE_CHOICES = ("auto", "bfloat16", "float32")
AUTO_DTYPE = "auto"
GROUP_SIZES = (32, 64, 128)  # --quant-group-size: int4 weights sharing one scale and zero
DEFAULT_GROUP_SIZE = 64
NATIVE_FORMATS = ("fp8", "mxfp4")  # formats checkpoints ship and nodes keep packed
BLOCK_FORMATS = ("int4", "int8")  # what a GGUF's blocks run as by default (``gguf_index``)


class Precision(StrEnum):
    """The format a shard holds its weights in (resolved: never ``auto``).

    bfloat16 / float32: plain weights. int8: per-output-channel int8 with one scale per row.
    int4: group-wise int4, a scale and a zero per ``group_size`` weights of a row. nf4:
    bitsandbytes 4-bit. fp8 / mxfp4: the checkpoint's own packed format (FP8 e4m3 with block
    scales; gpt-oss' MXFP4 experts), kept packed in memory. The compute dtype (``--dtype``) is
    a separate choice; ``compute_dtype`` is this precision's default one."""

    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    INT8 = "int8"
    INT4 = "int4"
    NF4 = "nf4"
    FP8 = "fp8"
    MXFP4 = "mxfp4"

    @property
    def default_dtype(self) -> str:
        """The compute dtype's name when none is given: float32 for float32, else bfloat16."""
        return "float32" if self is Precision.FLOAT32 else "bfloat16"

    @property
    def compute_dtype(self) -> torch.dtype:
        """Default dtype of activations, norms and embeddings on a shard of this precision."""
        import torch

        return torch.float32 if self is Precision.FLOAT32 else torch.bfloat16

    @property
    def verify_tolerance(self) -> float:
        """How far two replicas' outputs for the same input may lie apart (relative L2 of a
        row) and still count as the same computation: the square root of the activation
        dtype's machine epsilon, ~0.088 in bfloat16 and ~3.5e-4 in float32. Decode steps and
        a recomputation in one prefill are other arithmetic: measured up to 1.1e-2 (bfloat16)
        and 6e-7 (float32) on ten SmolLM2 layers (docs/adr/0026)."""
        return (2.0**-7 if self is not Precision.FLOAT32 else 2.0**-23) ** 0.5

    @property
    def is_quantized(self) -> bool:
        """Whether some weights are held in fewer bits than the compute dtype."""
        return self in (
            Precision.INT8, Precision.INT4, Precision.NF4, Precision.FP8, Precision.MXFP4
        )  # fmt: skip

    @property
    def is_native(self) -> bool:
        """A format only a checkpoint that ships it can be served in (fp8, mxfp4)."""
        return self in (Precision.FP8, Precision.MXFP4)

    @property
    def linear_bytes_per_param(self) -> float:
        """Nominal bytes per quantized weight, scales included, at a bfloat16 compute dtype
        (int8: rows of 4096; int4: groups of 64; fp8: 128x128 blocks). Memory accounting
        prices each tensor exactly (``meshnet_common.memory``); this is for summaries."""
        return {
            Precision.BFLOAT16: 2.0,
            Precision.FLOAT32: 4.0,
            Precision.INT8: 1.0 + 2.0 / 4096,  # int8 + one bf16 scale per output row
            Precision.INT4: 0.5 + 2 * 2.0 / 64,  # 4 bit + a bf16 scale and zero per group
            Precision.NF4: 0.5 + 4.0 / 64,  # 4 bit + one fp32 absmax per 64-weight block
            Precision.FP8: 1.0 + 4.0 / (128 * 128),  # e4m3 + one fp32 scale per block
            Precision.MXFP4: 0.5 + 1.0 / 32,  # e2m1 + one e8m0 scale per 32 values
        }[self]

    @property
    def other_bytes_per_param(self) -> float:
        """Bytes per parameter of tensors left unquantized (embeddings, norms, biases) at
        this precision's default compute dtype."""
        return 4.0 if self is Precision.FLOAT32 else 2.0


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element at a compute dtype name (``bfloat16`` or ``float32``)."""
    if dtype not in DTYPE_CHOICES or dtype == AUTO_DTYPE:
        raise InvalidRequest(f"unknown compute dtype {dtype!r}; expected bfloat16 or float32")
    return 4 if dtype == "float32" else 2


def resolve_precision(quantization: str, dtype: str, native: str | None) -> Precision:
    """The precision a node serves a checkpoint in, from ``--quantization`` and ``--dtype``
    and the checkpoint's shipped format ``native`` (``fp8``, ``mxfp4``, a GGUF's ``int4`` /
    ``int8``, or None; see ``native_format_name``).

    auto: the shipped format if any (kept packed), else the compute dtype. bfloat16: plain
    weights at the compute dtype (a shipped FP8/MXFP4 checkpoint is dequantized). float32:
    float32 weights. fp8/mxfp4: only on a checkpoint that ships that format
    (InvalidRequest otherwise). int8/int4/nf4: as given."""
    if dtype not in DTYPE_CHOICES:
        raise InvalidRequest(f"--dtype {dtype}: expected one of {', '.join(DTYPE_CHOICES)}")
    if native is not None and native not in (*NATIVE_FORMATS, *BLOCK_FORMATS):
        raise InvalidRequest(f"unknown checkpoint format {native!r}")
    plain = Precision.FLOAT32 if dtype == "float32" else Precision.BFLOAT16
    if quantization == "auto":
        return Precision(native) if native is not None else plain
    if quantization == "bfloat16":
        return plain
    if quantization not in QUANTIZATION_CHOICES:
        raise InvalidRequest(
            f"--quantization {quantization}: expected one of {', '.join(QUANTIZATION_CHOICES)}"
        )
    precision = Precision(quantization)
    if precision.is_native and native != quantization:
        shipped = f"ships {native}" if native else "ships plain weights"
        raise InvalidRequest(
            f"--quantization {quantization}: this checkpoint {shipped}; {quantization} is "
            f"served only from a checkpoint that ships it (use auto, bfloat16, int8 or int4)"
        )
    return precision


def compute_dtype_name(
    precision: Precision, dtype: str | None = None, *, gguf: bool = False
) -> str:
    """The compute dtype a shard of ``precision`` runs in when ``--dtype`` says ``dtype``
    (None or auto: float32 for a ``gguf`` checkpoint, else the precision's default): float32
    weights always compute in float32."""
    if precision is Precision.FLOAT32:
        return "float32"
    if dtype is None or dtype == AUTO_DTYPE:
        return "float32" if gguf else precision.default_dtype
    return dtype


def native_format_name(config: dict) -> str | None:
    """``fp8``, ``mxfp4`` or None: the packed format a checkpoint's ``config.json`` declares
    (InvalidRequest for a quantization nodes cannot read); for a GGUF ``int4`` / ``int8``, what
    its blocks run as; ``int4`` for a GPTQ, AWQ or compressed-tensors w4a16 checkpoint."""
    from meshnet_common.models.int4_formats import int4_format
    from meshnet_common.models.native_formats import native_format

    spec = config.get("quantization_config") or {}
    if spec.get("quant_method") == "gguf":  # int4 / int8 blocks, or None (``gguf_index``)
        return spec.get("runtime")
    if int4_format(config) is not None:  # GPTQ / AWQ / compressed-tensors w4a16
        return "int4"
    found = native_format(config)
    return None if found is None else found[0]


def describe_precision(
    precision: str, dtype: str | None = None, group_size: int | None = None
) -> str:
    """How logs and the dashboard name a node's weights: ``int4 g64``, ``fp8``,
    ``bfloat16``, with `` · float32`` when a quantized format computes in float32."""
    text = str(precision)
    if text == Precision.INT4 and group_size:
        text += f" g{group_size}"
    if dtype == "float32" and text != Precision.FLOAT32:
        text += " · float32"
    return text


# -- which tensors a precision quantizes ---------------------------------------------------

# Inside a decoder layer: "model.layers.3.", "transformer.h.3." (and a stage's "layers.3.").
_IN_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.\d+\.")
# Routers stay at the compute dtype: they are small, and top-k picks are sensitive.
_ROUTERS = (".gate.weight", ".router.weight", "shared_expert_gate.weight")
# gpt-oss' fused experts, stored [experts, in, out] (transposed against a Linear).
_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
INT4_OUT_MULTIPLE = 16  # int4 packs rows in tiles of 16 output channels


def int4_group(in_width: int, group_size: int) -> int | None:
    """The group int4 uses for a weight ``in_width`` wide: ``group_size``, or the largest
    smaller one of ``GROUP_SIZES`` that divides the width (SmolLM2's 576 in groups of 64
    when 128 is asked); None when none does (the weight stays at the compute dtype)."""
    for group in sorted(GROUP_SIZES, reverse=True):
        if group <= group_size and in_width % group == 0:
            return group
    return None


def linear_widths(name: str, shape: tuple[int, ...], *, gpt2: bool) -> tuple[int, int] | None:
    """(out, in) of a weight int8/int4 may quantize, or None: a 2-D ``.weight`` inside a
    decoder layer (Linear [out, in], GPT-2 Conv1D [in, out]) or a fused 3-D expert tensor
    ([experts, in, out]); never a router, norm, bias or embedding."""
    if not _IN_LAYER.search(name):
        return None
    if len(shape) == 2 and name.endswith(".weight") and not name.endswith(_ROUTERS):
        return (shape[1], shape[0]) if gpt2 else (shape[0], shape[1])
    if len(shape) == 3 and name.endswith(_FUSED_EXPERTS):
        return shape[2], shape[1]
    return None


def quantized_tensor(
    name: str,
    shape: tuple[int, ...],
    precision: Precision,
    *,
    gpt2: bool,
    group_size: int = DEFAULT_GROUP_SIZE,
    names: Collection[str] = (),
) -> bool:
    """Whether ``precision`` holds this checkpoint tensor quantized (else: at the compute
    dtype). The loader and memory accounting both ask this, so what is priced is what is
    loaded.

    int8: every weight ``linear_widths`` accepts. int4: those whose out width is a multiple
    of 16 and in width a multiple of ``group_size``. nf4: 2-D ``.weight`` tensors inside
    decoder layers (MoE models are refused for nf4). fp8: the weights stored as FP8, i.e.
    whose ``<name>_scale_inv`` partner is among ``names`` (the checkpoint's tensor names).
    mxfp4: the ``*_blocks`` tensors. ``name`` and ``shape`` are as a plain checkpoint holds
    the tensor (a dequantized MXFP4 ``X_blocks`` is ``X``, [experts, in, out])."""
    if precision in (Precision.INT8, Precision.INT4):
        widths = linear_widths(name, shape, gpt2=gpt2)
        if widths is None:
            return False
        out, width = widths
        return precision is Precision.INT8 or (
            out % INT4_OUT_MULTIPLE == 0 and int4_group(width, group_size) is not None
        )
    if precision is Precision.NF4:
        return bool(_IN_LAYER.search(name)) and name.endswith(".weight") and len(shape) == 2
    if precision is Precision.FP8:
        return name.endswith(".weight") and f"{name}_scale_inv" in names
    if precision is Precision.MXFP4:
        return name.endswith("_blocks")
    return False

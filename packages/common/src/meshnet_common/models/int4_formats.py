"""Which int4 safetensors checkpoint a ``config.json`` declares, read without torch (the
tracker resolves a model's precision from it too).

Three formats ship most 4-bit checkpoints on the hub: GPTQ (``quant_method: gptq``),
AWQ (``awq``, GEMM packing) and compressed-tensors ``pack-quantized`` w4a16 (the
"-quantized.w4a16" repos of llm-compressor). Each stores, per quantized Linear, 4-bit codes
packed eight to an int32 word with a scale (and a zero) per group of inputs; nodes run them
as int4 in the checkpoint's own group (``meshnet_node.lowbit.int4_checkpoints``). Anything
else they declare (other bit widths, act-order, activation quantization, other packings)
is refused in one line here, before a node loads a byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnet_common.errors import InvalidRequest

METHODS = ("gptq", "awq", "compressed-tensors")
GROUPS = (32, 64, 128)  # the groups the int4 runtime holds


@dataclass(frozen=True)
class Int4Format:
    """An int4 checkpoint's packing: ``method``, the inputs per scale (``group``),
    ``symmetric`` (no stored zeros), ``v1`` (GPTQ's original format: zeros stored minus one)."""

    method: str
    group: int
    symmetric: bool = False
    v1: bool = True

    @property
    def packed_suffix(self) -> str:
        """The tensor that names a packed Linear: ``PATH.<suffix>``."""
        return "weight_packed" if self.method == "compressed-tensors" else "qweight"

    @property
    def parts(self) -> tuple[str, ...]:
        """Every tensor suffix a packed Linear may have (its bias aside)."""
        if self.method == "compressed-tensors":
            return ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
        if self.method == "gptq":
            return ("qweight", "qzeros", "scales", "g_idx")
        return ("qweight", "qzeros", "scales")


def int4_format(config: dict) -> Int4Format | None:
    """The int4 format of a checkpoint's ``quantization_config``; None when it declares none
    of ``METHODS``; InvalidRequest (one line) for a variant the runtime cannot hold."""
    spec = config.get("quantization_config") or {}
    method = spec.get("quant_method")
    if method == "gptq":
        return _gptq(spec)
    if method == "awq":
        return _awq(spec)
    if method == "compressed-tensors":
        return _compressed(spec)
    return None


def _group(method: str, group) -> int:
    if group not in GROUPS:
        raise InvalidRequest(
            f"{method} checkpoint with group_size {group}: int4 runs groups of "
            f"{', '.join(map(str, GROUPS))} (per-channel and other groups are not served)"
        )
    return int(group)


def _bits(method: str, bits) -> None:
    if bits != 4:
        raise InvalidRequest(f"{method} checkpoint of {bits}-bit weights: only 4-bit is served")


def _gptq(spec: dict) -> Int4Format:
    _bits("gptq", spec.get("bits"))
    if spec.get("desc_act"):
        raise InvalidRequest(
            "act-order GPTQ (desc_act: true) is not served; use a checkpoint quantized "
            "without desc_act"
        )
    fmt = spec.get("checkpoint_format") or spec.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise InvalidRequest(f"GPTQ checkpoint_format {fmt!r}: gptq and gptq_v2 are served")
    return Int4Format(
        "gptq", _group("gptq", spec.get("group_size")), bool(spec.get("sym", True)),
        v1=fmt == "gptq",
    )  # fmt: skip


def _awq(spec: dict) -> Int4Format:
    _bits("awq", spec.get("bits", spec.get("w_bit")))
    version = str(spec.get("version", "gemm")).lower()
    if version != "gemm":
        raise InvalidRequest(f"AWQ version {version!r}: only the GEMM packing is served")
    if spec.get("zero_point") is False:
        raise InvalidRequest("AWQ without zero points is not served (GEMM checkpoints have them)")
    return Int4Format("awq", _group("awq", spec.get("group_size", spec.get("q_group_size"))))


def _compressed(spec: dict) -> Int4Format:
    groups = spec.get("config_groups") or {}
    groups = list(groups.values()) if isinstance(groups, dict) else [groups]
    if len(groups) != 1:
        raise InvalidRequest(
            f"compressed-tensors checkpoint with {len(groups)} config groups: one w4a16 group "
            "is served"
        )
    group = groups[0]
    if not isinstance(group, dict) or not isinstance(group.get("weights") or {}, dict):
        raise InvalidRequest("compressed-tensors config group or its weights is not an object")
    weights = group.get("weights") or {}
    fmt = group.get("format") or spec.get("format")
    if fmt != "pack-quantized":
        raise InvalidRequest(f"compressed-tensors format {fmt!r}: pack-quantized (w4a16) is served")
    if group.get("input_activations") or group.get("output_activations"):
        raise InvalidRequest("compressed-tensors with quantized activations: only w4a16 is served")
    _bits("compressed-tensors", weights.get("num_bits"))
    if weights.get("type", "int") != "int" or weights.get("strategy") != "group":
        raise InvalidRequest(
            f"compressed-tensors {weights.get('type')} weights by {weights.get('strategy')}: "
            "int weights by group are served"
        )
    if weights.get("actorder"):
        raise InvalidRequest("compressed-tensors with actorder is not served")
    return Int4Format(
        "compressed-tensors", _group("compressed-tensors", weights.get("group_size")),
        bool(weights.get("symmetric", True)),
    )  # fmt: skip

"""nf4 through bitsandbytes: the one precision meshnet does not pack itself (int8, int4, fp8
and mxfp4 are ``meshnet_node.lowbit``)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from meshnet_common.errors import ModelError
from meshnet_common.precision import Precision

logger = logging.getLogger(__name__)


NF4_CPU_BLOCK = 32  # bitsandbytes' CPU 4-bit kernel needs output widths divisible by this


def _bnb():
    try:
        import bitsandbytes
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ModelError("nf4 needs bitsandbytes: pip install bitsandbytes") from exc
    return bitsandbytes


def check_nf4_widths(out_widths: dict[str, int], device: str) -> None:
    """Refuse nf4 on CPU when a Linear's output width is not a multiple of 32."""
    if device != "cpu":
        return
    bad = {name: w for name, w in out_widths.items() if w % NF4_CPU_BLOCK}
    if bad:
        sample = ", ".join(f"{n} ({w})" for n, w in list(bad.items())[:3])
        raise ModelError(
            f"nf4 on CPU needs every Linear output width to be a multiple of {NF4_CPU_BLOCK}; "
            f"these are not: {sample}. Use --quantization int8 or bfloat16."
        )


def _as_linear(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """(weight [out, in], bias, in, out) of a Linear or GPT-2 Conv1D."""
    if isinstance(module, Conv1D):  # GPT-2 stores weight as [in, out]
        weight = module.weight.data.t().contiguous()
    else:
        weight = module.weight.data
    bias = module.bias.data if module.bias is not None else None
    out_features, in_features = weight.shape
    return weight, bias, in_features, out_features


def quantize_linears(root: nn.Module, precision: Precision, device: str) -> int:
    """At nf4: replace every Linear/Conv1D under ``root`` by bitsandbytes' 4-bit one, in place.

    Weights must already be real (not meta). Returns the number of layers replaced.
    """
    if precision is not Precision.NF4:
        return 0
    bnb = _bnb()
    targets = [
        (parent, child_name, child)
        for parent in root.modules()
        for child_name, child in parent.named_children()
        if isinstance(child, nn.Linear | Conv1D)
    ]
    for parent, child_name, child in targets:
        weight, bias, in_features, out_features = _as_linear(child)
        new = bnb.nn.Linear4bit(
            in_features, out_features, bias=bias is not None, compute_dtype=torch.bfloat16,
            quant_type="nf4", device="meta",
        )  # fmt: skip
        new.weight = bnb.nn.Params4bit(
            weight.to(torch.bfloat16), requires_grad=False, quant_type="nf4"
        )
        if bias is not None:
            new.bias = nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)
        setattr(parent, child_name, new.to(device))  # .to() performs the quantization
    logger.info("quantized %d linear layers to %s", len(targets), precision.value)
    return len(targets)

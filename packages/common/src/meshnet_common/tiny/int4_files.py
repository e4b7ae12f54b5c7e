"""Tiny int4 safetensors checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) made
from a plain snapshot by our own rounding and packing code, for tests: never a downloaded
file, never the formats' own libraries.

Every Linear weight of the decoder layers (experts included, routers not) is rounded to
16 levels per group of inputs of a row — asymmetric: ``q = round(w / s) + z`` with
``s = (max - min) / 15``; symmetric: ``z = 8``, ``s = max |w| / 7.5`` — with the scale
stored in float16 as the formats store it, then packed eight codes to an int32 word in the
format's layout. ``write_int4`` returns the weights the codes stand for,
``(q - z) * s`` in float32, computed here from the codes (not by any reader), so a test can
build the HF model a node must equal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshnet_common.models.checkpoint import CheckpointIndex

METHODS = ("gptq", "awq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8j + AWQ_ORDER[i]
_ROUTERS = (".gate.weight", ".router.weight", "shared_expert_gate.weight")


def _words(codes: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """``[rows, n]`` codes (0..15) -> int32 ``[rows, n / 8]``: field i of word j holds code
    ``8j + order[i]`` (bit 31 wraps, as the formats store it)."""
    rows, n = codes.shape
    picked = codes.long().reshape(rows, n // 8, 8)[..., list(order)]
    words = (picked << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _round(w: torch.Tensor, group: int, symmetric: bool):
    """Codes ``[out, in]``, zeros and float16 scales ``[out, groups]`` of ``w``."""
    out, k = w.shape
    g = w.float().reshape(out, k // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-6).half()
        zero = torch.full(scale.shape, 8, dtype=torch.long)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half()
        zero = torch.round(-lo / scale.float()).clamp(0, 15).long()
    q = (torch.round(g / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).long()
    return q.reshape(out, k), zero, scale


def _pack(name: str, q, zero, scale, group: int, method: str, symmetric: bool, v1: bool):
    """The format's tensors for the Linear weight ``name`` (``PATH.weight``)."""
    path = name[: -len(".weight")]
    out, k = q.shape
    if method == "gptq":
        return {
            f"{path}.qweight": _words(q).t().contiguous(),  # [in/8, out]
            f"{path}.qzeros": _words((zero - 1 if v1 else zero).t().contiguous()),
            f"{path}.scales": scale.t().contiguous(),  # [groups, out]
            f"{path}.g_idx": torch.arange(k, dtype=torch.int32) // group,
        }
    if method == "awq":
        return {
            f"{path}.qweight": _words(q.t().contiguous(), AWQ_ORDER),  # [in, out/8]
            f"{path}.qzeros": _words(zero.t().contiguous(), AWQ_ORDER),
            f"{path}.scales": scale.t().contiguous(),
        }
    tensors = {
        f"{path}.weight_packed": _words(q),  # [out, in/8]: codes stored as (q - 8) + 8
        f"{path}.weight_scale": scale.contiguous(),  # [out, groups]
        f"{path}.weight_shape": torch.tensor([out, k], dtype=torch.int64),
    }
    if not symmetric:  # zero points (z - 8) + 8, packed along the output
        tensors[f"{path}.weight_zero_point"] = _words(zero.t().contiguous()).t().contiguous()
    return tensors


def _config(method: str, group: int, symmetric: bool, v1: bool) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": symmetric,
                "desc_act": False, "checkpoint_format": "gptq" if v1 else "gptq_v2"}  # fmt: skip
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
               "group_size": group, "actorder": None}  # fmt: skip
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head"], "quantization_status": "compressed",
    }  # fmt: skip


def write_int4(
    snapshot: Path, dest: Path, method: str, *, group: int = 64, symmetric: bool = False,
    v1: bool = True,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Write ``snapshot`` as an int4 checkpoint of ``method`` at ``dest``; returns the
    float32 weights its codes stand for, by the plain checkpoint's names."""
    if method not in METHODS:
        raise ValueError(f"unknown int4 method {method!r}")
    if method == "awq" and symmetric:
        raise ValueError("AWQ GEMM checkpoints are asymmetric")
    index = CheckpointIndex.load(snapshot)
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for fname in sorted({info.file for info in index.tensors.values()}):
        with safe_open(str(index.root / fname), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no iterator
                w = fh.get_tensor(name)
                if not _quantizable(index, name, w, group):
                    tensors[name] = w
                    continue
                q, zero, scale = _round(w, group, symmetric)
                tensors.update(_pack(name, q, zero, scale, group, method, symmetric, v1))
                steps = scale.float().repeat_interleave(group, 1)
                reference[name] = (q - zero.repeat_interleave(group, 1)).float() * steps
    save_file(tensors, dest / "model.safetensors")
    config = dict(index.config)
    config["quantization_config"] = _config(method, group, symmetric, v1)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for aux in index.auxiliary_files():
        if aux != "config.json":
            shutil.copy2(index.root / aux, dest / aux)
    return reference


def _quantizable(index: CheckpointIndex, name: str, w: torch.Tensor, group: int) -> bool:
    return (
        index.layer_of(name) is not None
        and name.endswith("_proj.weight")
        and not name.endswith(_ROUTERS)
        and w.dim() == 2
        and w.shape[1] % group == 0
        and w.shape[0] % 8 == 0
    )

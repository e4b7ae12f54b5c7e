"""The quantized formats big MoE checkpoints ship in, written and read back without
transformers: FP8 E4M3 weights with block scales (``weight_scale_inv``; DeepSeek-V3/R1,
Kimi K2) and MXFP4 experts (``*_blocks`` + ``*_scales``; gpt-oss).

Nodes load these through transformers' own dequantizing loaders (``meshnet_node.engine.
loader.native_quantizer``); this module writes tiny checkpoints in the formats, and
dequantizes them independently, so tests can check a node against a reference built
from the dequantized weights. Needs torch (the ``models`` extra)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from meshnet_common.errors import InvalidRequest
from meshnet_common.models.checkpoint import INDEX_FILE
from meshnet_common.models.int4_formats import METHODS as INT4_METHODS
from meshnet_common.models.int4_formats import int4_format

if TYPE_CHECKING:
    import torch

FORMATS = ("bf16", "fp8", "mxfp4")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size
MXFP4_BLOCK = 32  # values sharing one E8M0 scale
# E2M1 values by code: bit 3 is the sign (OCP microscaling spec).
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)

# DeepSeek-V3 quantizes every Linear of its decoder layers; embeddings, norms, the router
# and lm_head stay bfloat16.
_FP8_WEIGHT = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")
# gpt-oss ships its experts (and only them) as MXFP4.
_MXFP4_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


# -- FP8 with block scales ---------------------------------------------------------------


def fp8_quantize(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 ``weight_scale_inv``): one scale per block x block tile,
    so that ``weight ~= fp8 * scale`` tile by tile (ragged edge tiles allowed)."""
    import torch

    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    w = weight.float()
    padded = torch.zeros(grid[0] * block, grid[1] * block)
    padded[:rows, :cols] = w
    tiles = padded.reshape(grid[0], block, grid[1], block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # (R, C)
    q = (tiles / scale[:, None, :, None]).reshape_as(padded)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def fp8_dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
) -> torch.Tensor:
    """float32 weight from an FP8 tensor and its ``block`` tile scales. Edge tiles may be
    ragged (DeepSeek-V3's 576-row ``kv_a_proj_with_mqa`` has 4.5 tiles of 128 rows): each
    scale covers ``block`` rows and columns from the top left, whatever the shape."""
    rows, cols = q.shape
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    if full.shape[0] < rows or full.shape[1] < cols:
        raise InvalidRequest(f"scale grid {tuple(scale.shape)} does not cover {rows}x{cols}")
    return q.float() * full[:rows, :cols]


# -- MXFP4 -------------------------------------------------------------------------------


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 blocks, uint8 scales) of an expert tensor as gpt-oss stores it.

    ``weight`` is the module's layout, (experts, in, out); the checkpoint holds its
    transpose (experts, out, in) in groups of 32 values: ``blocks`` (E, out, in/32, 16), two
    E2M1 codes per byte (low nibble first), ``scales`` (E, out, in/32) as E8M0 exponents +127.
    """
    import torch

    w = weight.float().transpose(1, 2).contiguous()  # (E, out, in)
    experts, out, width = w.shape
    if width % MXFP4_BLOCK:
        raise InvalidRequest(f"MXFP4 needs the input width ({width}) in groups of {MXFP4_BLOCK}")
    groups = w.reshape(experts, out, width // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # largest code is 6
    scaled = groups / torch.exp2(exponent)[..., None]
    values = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - values).abs().argmin(dim=-1).to(torch.uint8)  # nearest code
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.to(torch.uint8), (exponent + 127).to(torch.uint8)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 expert tensor in the module's layout (experts, in, out)."""
    import torch

    values = torch.tensor(FP4_VALUES)
    low, high = values[(blocks & 0x0F).long()], values[(blocks >> 4).long()]
    codes = torch.stack([low, high], dim=-1).reshape(*blocks.shape[:-1], -1)  # (E, out, G, 32)
    x = codes * torch.exp2(scales.to(torch.float32) - 127)[..., None]
    return x.reshape(*x.shape[:-2], -1).transpose(1, 2).contiguous()


# -- reading a range of a native checkpoint ----------------------------------------------


def native_format(config: dict) -> tuple[str, tuple[int, int]] | None:
    """(format, FP8 block) of a checkpoint's ``quantization_config``; None for a plain one;
    InvalidRequest for a format nodes cannot read."""
    spec = config.get("quantization_config")
    if not spec:
        return None
    method = spec.get("quant_method")
    if method == "gguf":  # block tensors read by the node's GGUF reader, not converted here
        return None
    if method in INT4_METHODS:  # int4 checkpoints: checked here, read by the node's unpackers
        int4_format(config)
        return None
    if method == "fp8":
        if spec.get("fmt", "e4m3") != "e4m3":
            raise InvalidRequest(f"FP8 format {spec.get('fmt')!r}: only e4m3 is supported")
        block = spec.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK]
        if not (isinstance(block, list) and len(block) == 2
                and all(type(b) is int and 0 < b <= 1 << 16 for b in block)):  # fmt: skip
            raise InvalidRequest(f"FP8 weight_block_size {str(block)[:40]}: two block sizes")
        return "fp8", (block[0], block[1])
    if method == "mxfp4":
        return "mxfp4", (1, MXFP4_BLOCK)
    raise InvalidRequest(
        f"checkpoint quantized as {method!r}; nodes read fp8 (block-scaled e4m3: DeepSeek-V3, "
        "Kimi K2), mxfp4 (gpt-oss), gptq, awq and compressed-tensors w4a16 checkpoints, "
        "else convert it to bfloat16 first"
    )


def dequantize_tensors(
    tensors: dict[str, torch.Tensor], native: tuple[str, tuple[int, int]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The tensors of a range of a native-format checkpoint with every quantized weight
    dequantized to ``dtype`` and the scale tensors consumed: what a plain checkpoint of
    that range would hold. Other tensors are cast to ``dtype``."""
    import torch

    fmt, block = native
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("weight_scale_inv") or (fmt == "mxfp4" and name.endswith("_scales")):
            continue
        if fmt == "fp8" and tensor.dtype == torch.float8_e4m3fn:
            scale = tensors.get(f"{name}_scale_inv")
            if scale is None:
                raise InvalidRequest(f"{name}: an FP8 weight without its weight_scale_inv")
            out[name] = fp8_dequantize(tensor, scale, block).to(dtype)
        elif fmt == "mxfp4" and name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            scales = tensors.get(f"{base}_scales")
            if scales is None:
                raise InvalidRequest(f"{name}: MXFP4 blocks without their {base}_scales")
            out[base] = mxfp4_dequantize(tensor, scales).to(dtype)
        elif tensor.is_floating_point():
            out[name] = tensor.to(dtype)
        else:
            out[name] = tensor
    return out


# -- whole snapshots ---------------------------------------------------------------------


def convert_snapshot(folder: Path, fmt: str, *, fp8_block: int = FP8_BLOCK) -> int:
    """Rewrite the snapshot's weight files in place in ``fmt``; returns how many tensors were
    quantized. ``config.json`` gains the ``quantization_config`` the hub checkpoints carry."""
    from safetensors.torch import load_file, save_file

    if fmt not in FORMATS:
        raise InvalidRequest(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt == "bf16":
        return 0
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = index["weight_map"]
    converted = 0
    for fname in sorted(set(weight_map.values())):
        tensors = load_file(folder / fname)
        out = {}
        for name, tensor in tensors.items():
            if fmt == "fp8" and _FP8_WEIGHT.match(name) and tensor.dim() == 2:
                out[name], out[f"{name[: -len('weight')]}weight_scale_inv"] = fp8_quantize(
                    tensor, fp8_block
                )
                weight_map[f"{name[: -len('weight')]}weight_scale_inv"] = fname
                converted += 1
            elif fmt == "mxfp4" and _MXFP4_EXPERTS.match(name):
                del weight_map[name]
                out[f"{name}_blocks"], out[f"{name}_scales"] = mxfp4_quantize(tensor)
                weight_map[f"{name}_blocks"] = weight_map[f"{name}_scales"] = fname
                converted += 1
            else:
                out[name] = tensor
        save_file(out, folder / fname, metadata={"format": "pt"})
    if not converted:
        raise InvalidRequest(f"{folder}: no tensor of this model is stored as {fmt} by its hub")
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [fp8_block, fp8_block]}
        if fmt == "fp8"
        else {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    )  # fmt: skip
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return converted


def dequantized_copy(native: Path, dest: Path) -> Path:
    """A plain (float32) snapshot of a native-format one, dequantized by this module: the
    reference a node loading ``native`` must agree with."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    native, dest = Path(native), Path(dest)
    shutil.copytree(native, dest)
    index_path = dest / INDEX_FILE
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = index["weight_map"]
    for fname in sorted(set(weight_map.values())):
        tensors = load_file(dest / fname)
        out = {}
        for name, tensor in tensors.items():
            if name.endswith("weight_scale_inv") or name.endswith("_scales"):
                continue
            if tensor.dtype == torch.float8_e4m3fn:
                block = tuple(json.loads((native / "config.json").read_text())[
                    "quantization_config"]["weight_block_size"])  # fmt: skip
                out[name] = fp8_dequantize(tensor, tensors[f"{name}_scale_inv"], block)
                del weight_map[f"{name}_scale_inv"]
            elif name.endswith("_blocks"):
                base = name[: -len("_blocks")]
                out[base] = mxfp4_dequantize(tensor, tensors[f"{base}_scales"])
                del weight_map[name], weight_map[f"{base}_scales"]
                weight_map[base] = fname
            else:
                out[name] = tensor.float()
        save_file(out, dest / fname, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
    config = json.loads((dest / "config.json").read_text())
    config.pop("quantization_config", None)
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return dest

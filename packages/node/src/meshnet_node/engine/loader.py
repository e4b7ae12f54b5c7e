"""Load only a shard: build the model skeleton on meta, materialize just ``layers[start:end]``.

The head also materializes token (and learned position) embeddings, the tail the final
norm and ``lm_head`` — from the embedding tensor when embeddings are tied. Tensors are read
by name through the checkpoint index, so layers that straddle files are handled.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PreTrainedConfig

from meshnet_common.errors import InvalidRequest, ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.int4_formats import int4_format
from meshnet_common.models.native_formats import dequantize_tensors, native_format
from meshnet_common.precision import Precision
from meshnet_node.engine.bf16_upcast import widen_if_emulated
from meshnet_node.engine.families import (
    FamilyAdapter,
    SessionAttention,
    adapter_for,
    attention_module,
)
from meshnet_node.engine.huge_pages import hold_in_huge_pages
from meshnet_node.engine.quantization import quantize_linears
from meshnet_node.engine.row_attention import enable_together, widen_attention
from meshnet_node.kernels import bf16_dot
from meshnet_node.kernels import packed as packed_kernels
from meshnet_node.kernels.fused_linears import fuse_siblings
from meshnet_node.kernels.row_stable import route_alone, route_rows
from meshnet_node.lowbit.cuda_int4 import to_tinygemm
from meshnet_node.lowbit.gguf_blocks import GROUP as GGUF_GROUP
from meshnet_node.lowbit.gguf_blocks import GgufTensors, kept_lm_head
from meshnet_node.lowbit.gguf_embedding import gguf_embedding
from meshnet_node.lowbit.int4_checkpoints import Int4Linears
from meshnet_node.lowbit.loading import PACKED, ShardPacker
from meshnet_node.lowbit.modules import PackedLinear

logger = logging.getLogger(__name__)


class StageModules(nn.Module):
    """The real modules of one shard; absent roles are None."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = None
        self.position_embed: nn.Module | None = None
        self.layers = nn.ModuleList()
        self.norm: nn.Module | None = None
        self.lm_head: nn.Module | None = None
        self.rotary: nn.Module | None = None


@dataclass
class LoadedShard:
    """A materialized layer range plus everything needed to run it."""

    snapshot: Path
    config: PreTrainedConfig  # the full model's config
    stage_config: PreTrainedConfig  # config sliced to this stage's layers (for caches and masks)
    adapter: FamilyAdapter
    layers: LayerRange
    num_layers: int
    precision: Precision
    device: torch.device
    modules: StageModules
    layer_types: list[str]  # attention type per local layer
    dtype: torch.dtype = torch.bfloat16  # compute dtype: activations, norms, dense weights
    group_size: int | None = None  # int4's quantization group

    @property
    def is_head(self) -> bool:
        return self.layers.is_head()

    @property
    def is_tail(self) -> bool:
        return self.layers.is_tail(self.num_layers)

    @property
    def hidden_size(self) -> int:
        return int(getattr(self.config, "hidden_size", getattr(self.config, "n_embd", 0)))

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def dtype_name(self) -> str:
        """The compute dtype as ``--dtype`` names it (``bfloat16``, ``float32``)."""
        return str(self.dtype).removeprefix("torch.")

    def parameter_bytes(self) -> int:
        """Bytes of the weights held: parameters and packed weights (buffers of a packed
        module; RoPE's few inverse frequencies count too)."""
        tensors = [*self.modules.parameters(), *self.modules.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)


def _local_name(name: str, adapter: FamilyAdapter, index: CheckpointIndex, start: int) -> str:
    """Map a checkpoint tensor name to its key in ``StageModules``."""
    base = adapter.base_attr
    layer = index.layer_of(name)
    if layer is not None:
        rest = name[len(index.naming.layer_prefix) :].split(".", 1)[1]
        return f"layers.{layer - start}.{rest}"
    for prefix, local in (
        (f"{base}.{adapter.embed_attr}.", "embed."),
        (f"{base}.{adapter.position_embed_attr}.", "position_embed."),
        (f"{base}.{adapter.norm_attr}.", "norm."),
        ("lm_head.", "lm_head."),
    ):
        if name.startswith(prefix):
            return local + name[len(prefix) :]
    raise ModelError(f"{index.root}: tensor {name!r} has no place in a stage")


def stage_config_for(config: PreTrainedConfig, layers: LayerRange) -> PreTrainedConfig:
    """The config a per-stage KV cache and mask need: only this stage's layers."""
    stage = copy.deepcopy(config)
    stage.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        stage.layer_types = list(config.layer_types[layers.start : layers.end])
    if hasattr(stage, "max_window_layers"):
        # Qwen2 derives layer_types from this on re-init; keep the slice authoritative.
        stage.max_window_layers = max(0, config.max_window_layers - layers.start)
    return stage


def _read_tensors(
    index: CheckpointIndex, names: list[str], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The named tensors, cast to ``dtype`` (None: as stored, for packed or scaled weights
    that transformers' dequantization reads in their own types)."""
    if index.gguf is not None:  # one tensor at a time from the file's mapping
        reader = GgufTensors(index)
        return {name: reader.dense(name, dtype or torch.float32) for name in names}
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_file[index.tensors[name].file].append(name)
    out: dict[str, torch.Tensor] = {}
    for fname, file_names in by_file.items():
        with safe_open(str(index.root / fname), framework="pt", device="cpu") as fh:
            for name in file_names:
                tensor = fh.get_tensor(name)
                # A copy detaches from the mmap'd file (it may be replaced) and casts.
                out[name] = tensor.to(dtype=dtype or tensor.dtype, copy=True)
    return out


def _load_converted(
    model: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype, root: Path
) -> None:
    """Load checkpoint tensors (hub names: per-expert ``experts.E.w1``, ``block_sparse_moe``,
    fused ``qkv_proj`` ...) into the meta ``model`` through transformers' own checkpoint
    conversion mapping, as ``from_pretrained`` does: experts are stacked into the fused 3D
    parameters the modules hold. Modules whose tensors are not given stay on meta."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(model), dtype=dtype)
    info = convert_and_load_state_dict_in_model(model, tensors, config)[0]
    unexpected = sorted(getattr(info, "unexpected_keys", ()) or ())
    if unexpected:
        raise ModelError(f"{root}: checkpoint tensors with no module: {unexpected[:5]}")
    errors = getattr(info, "conversion_errors", None) or getattr(info, "error_msgs", None)
    if errors:
        raise ModelError(f"{root}: cannot convert checkpoint tensors: {str(errors)[:300]}")


def _finish_converted(
    modules: StageModules, base: nn.Module, adapter: FamilyAdapter, is_tail: bool
) -> None:
    """What loading leaves undone: a tied ``lm_head`` and non-persistent buffers that a
    checkpoint never holds (Gemma's embedding scale)."""
    if is_tail and modules.lm_head.weight.is_meta:
        embed = getattr(base, adapter.embed_attr).weight
        if embed.is_meta:
            raise ModelError("no lm_head weight and no tied embedding in the checkpoint")
        modules.lm_head.weight = embed
    if modules.embed is not None and hasattr(modules.embed, "scalar_embed_scale"):
        scale = torch.tensor(float(modules.embed.scalar_embed_scale))
        modules.embed.register_buffer("embed_scale", scale, persistent=False)


def release_freed_memory() -> None:
    """Hand memory freed while loading back to the OS (glibc's ``malloc_trim``).

    Loading holds each tensor twice for a moment (read, then stacked into fused experts or
    dequantized); glibc keeps such freed blocks in its heap, so without this a freshly loaded
    MoE shard kept ~2x its weights resident and the memory declared to the tracker was not
    what the process held. No-op where glibc is absent."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _still_meta(module: nn.Module) -> list[str]:
    names = [n for n, p in module.named_parameters() if p.is_meta]
    names += [n for n, b in module.named_buffers() if b.is_meta]
    return names


def load_shard(
    snapshot: Path | str,
    layers: LayerRange,
    precision: Precision = Precision.BFLOAT16,
    device: str = "cpu",
    *,
    dtype: torch.dtype | None = None,
    group_size: int = 64,
    widen_bf16: bool = False,
    bf16_kernel: bool = True,
    fuse: bool = True,
    threads: int | None = None,
) -> LoadedShard:
    """Materialize ``layers`` of the snapshot (plus head/tail extras) and nothing more.

    ``precision`` is the weights' (resolved: never auto); ``dtype`` the compute dtype
    (default: the precision's, bfloat16 unless float32). Packed precisions (int8, int4 in
    groups of ``group_size``, fp8, mxfp4) are packed tensor by tensor as they are read
    (``meshnet_node.lowbit``, ADR-0031).

    ``widen_bf16``: multiply many-row calls in float32 where bf16 arithmetic is emulated
    (``bf16_upcast``); off, every product is torch's own, as in the unsplit model.
    ``bf16_kernel``: where torch multiplies bf16 one row at a time, do its sums several rows
    at a time (``meshnet_node.kernels.bf16_dot``: the same numbers, ADR-0030).
    ``fuse``: sibling projections (q/k/v, gate/up) as one product each where that gives the
    same numbers with ``threads`` (the node's torch threads; None: this thread's count) as
    separate products (``meshnet_node.kernels.fused_linears``, ADR-0037)."""
    index = CheckpointIndex.load(snapshot)
    layers.check_within(index.num_layers)
    if index.gguf is not None:  # the config is the GGUF's metadata (``gguf_index``)
        fields = {k: v for k, v in index.config.items() if k != "quantization_config"}
        config = AutoConfig.for_model(**fields)
    else:
        config = AutoConfig.from_pretrained(index.root)
    adapter = adapter_for(config)
    dtype = dtype or precision.compute_dtype
    if index.gguf is not None and precision is Precision.INT4:
        group_size = GGUF_GROUP  # its 4-bit blocks are int4 in groups of 32 as they are
    try:
        native = native_format(index.config)
        int4 = int4_format(index.config)  # GPTQ / AWQ / compressed-tensors w4a16
    except InvalidRequest as exc:
        raise ModelError(f"{index.root}: {exc}") from exc
    if int4 is not None and precision is Precision.INT4:
        group_size = int4.group  # its codes are int4 in its own groups as they are
    with torch.device("meta"):  # in the compute dtype, as from_pretrained(dtype=...) builds it
        full = adapter.model_class._from_config(config, dtype=dtype)
    config = full.config  # carries the resolved attention implementation
    base = getattr(full, adapter.base_attr)
    modules = StageModules()
    modules.layers = nn.ModuleList(
        list(getattr(base, adapter.layers_attr))[layers.start : layers.end]
    )
    for local_idx, layer in enumerate(modules.layers):
        # The stage's KV cache has one slot per local layer: remap indices from global.
        for sub in layer.modules():
            if hasattr(sub, "layer_idx"):
                sub.layer_idx = local_idx
    is_head, is_tail = layers.is_head(), layers.is_tail(index.num_layers)
    if is_head:
        modules.embed = getattr(base, adapter.embed_attr)
        if adapter.position_embed_attr:
            modules.position_embed = getattr(base, adapter.position_embed_attr)
    embed_name = f"{adapter.base_attr}.{adapter.embed_attr}.weight"
    held = None  # a GGUF head's embedding in its blocks, on a CPU (docs/adr/0050)
    if is_head and torch.device(device).type == "cpu":
        held = gguf_embedding(index, embed_name, modules.embed, dtype)
        if held is not None:
            modules.embed = held
    if is_tail:
        modules.norm = getattr(base, adapter.norm_attr)
        modules.lm_head = full.lm_head
    rotary_cls = type(base.rotary_emb) if adapter.rotary else None

    names = index.tensors_for(layers)
    if held is not None and not (is_tail and "lm_head.weight" not in index.tensors):
        names = [n for n in names if n != embed_name]  # (a tied LM head still reads it)
    packer = plan = None
    # imported (or built in the background) meanwhile: packed products, and decode
    # programs' C++ layer steps at every precision (docs/adr/0043)
    packed_kernels.start(device)
    if precision in PACKED:  # packed Linears first, each read alone (never the range at 16 bit)
        packer = ShardPacker(index, precision, dtype, group_size, native, int4)
        plan = packer.plan(names, full)
        packer.pack_linears(full, plan, after_layer=release_freed_memory)
        names = [n for n in names if n not in plan.taken]
    as_stored = native is not None or int4 is not None
    tensors = _read_tensors(index, names, None if as_stored else dtype)
    if native is not None:  # FP8 / MXFP4 checkpoints: dequantized here, the range only
        tensors = dequantize_tensors(tensors, native, dtype)
    if int4 is not None:  # int4 codes a packed precision left (it was not asked): dequantized
        tensors = Int4Linears(int4, tensors.__getitem__).dequantized(tensors, dtype)
    if adapter.split_attention:
        _load_converted(full, tensors, dtype, index.root)
        _finish_converted(modules, base, adapter, is_tail)
        tensors = {}  # loaded: the state below is empty
    state = {_local_name(n, adapter, index, layers.start): t for n, t in tensors.items()}
    del full, base
    if is_tail and "lm_head.weight" not in state and not adapter.split_attention:
        tied = index.naming.tied_embedding
        if tied not in tensors:
            raise ModelError(f"{index.root}: no lm_head.weight and no tied embedding {tied}")
        state["lm_head.weight"] = tensors[tied]
    expected = (
        {k for k, v in modules.state_dict().items() if v.is_meta}
        if not adapter.split_attention
        else set()
    )
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    for key in unexpected:
        state.pop(key)
        if not key.startswith("embed.") and not key.startswith("position_embed."):
            raise ModelError(f"{index.root}: checkpoint tensor {key!r} has no module in the stage")
    modules.load_state_dict(state, strict=False, assign=True)
    del state, tensors
    if rotary_cls is not None:
        # Built outside the meta context so inv_freq is real (and stays float32).
        modules.rotary = rotary_cls(config=config)
    if missing:
        raise ModelError(f"{index.root}: checkpoint lacks tensors for {missing[:5]}")
    if is_tail and precision in (Precision.INT8, Precision.INT4) and torch.device(device).type == "cpu":  # fmt: skip
        shipped = kept_lm_head(index)  # a GGUF's kept output, in its values (ADR-0043, 0049)
        if shipped is not None:
            modules.lm_head = PackedLinear(shipped, None)
    if packer is not None:
        try:
            for layer, layer_names in plan.experts.items():  # expert by expert
                packer.pack_experts(
                    modules.layers[layer - layers.start], layer_names, release_freed_memory
                )
        finally:
            packer.close()
    quantize_linears(modules.layers, precision, device)
    if adapter.split_attention:
        for layer in modules.layers:  # batched decode steps split attention by session
            layer.self_attn = SessionAttention(layer.self_attn)
    for layer in modules.layers:  # a batched step runs each attention module once (ADR-0028)
        enable_together(attention_module(layer))
    modules.to(device)
    if precision is Precision.INT4 and torch.device(device).type == "cuda":
        to_tinygemm(modules, torch.device(device))  # torch's int4 kernel reads the codes (ADR-0055)
    if fuse:  # q/k/v and gate/up as one product each, where that is bit for bit (ADR-0037)
        fuse_siblings(modules.layers, threads)
    if bf16_kernel:
        bf16_dot.start(device)
    # every product in row groups that give each row its one-row product (ADR-0038); the
    # checks' probe weights go back to the OS
    route_rows(modules, threads, kernel=bf16_kernel)
    route_alone(modules)  # MoE blocks and Conv1D: a token at a time outside prompts
    release_freed_memory()
    if widen_bf16 and widen_if_emulated(modules, device):
        for layer in modules.layers:  # and their many-row attention calls (ADR-0027)
            widen_attention(attention_module(layer))
    meta_left = _still_meta(modules)
    if meta_left:
        # Refuse to serve a half-materialized model (e.g. a checkpoint missing tensors).
        raise ModelError(f"{index.root}: still on the meta device after loading: {meta_left[:5]}")
    modules.eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        hold_in_huge_pages(modules, release_freed_memory)  # in 2 MiB pages (ADR-0048)
    if precision in (Precision.INT8, Precision.INT4):
        # One int8/int4 kernel for the node's life (meshnet's, or torch's where it is not
        # built): a session's products never change implementation between its steps or
        # its replay. Built by ``make install``; else this waits for the build (~1 min).
        packed_kernels.wait()
    release_freed_memory()
    logger.info(
        "loaded %s layers %s (%s, %.1f MiB of weights)", index.root.name, layers,
        precision.value, sum(t.numel() * t.element_size()
                             for t in [*modules.parameters(), *modules.buffers()]) / 2**20,
    )  # fmt: skip
    return LoadedShard(
        snapshot=index.root,
        config=config,
        stage_config=stage_config_for(config, layers),
        adapter=adapter,
        layers=layers,
        num_layers=index.num_layers,
        precision=precision,
        device=torch.device(device),
        modules=modules,
        layer_types=adapter.layer_types(config)[layers.start : layers.end],
        dtype=dtype,
        group_size=group_size if precision is Precision.INT4 else None,
    )

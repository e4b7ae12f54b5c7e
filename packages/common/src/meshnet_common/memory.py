"""What a layer range costs in memory, from the checkpoint: shared by node preflight and placement.

Which tensors a precision quantizes is ``meshnet_common.precision.quantized_tensor`` (the
loader asks the same): weights inside decoder layers; embeddings, norms, biases and routers
stay at the compute dtype. A range is priced at a precision, a compute dtype and (int4) a
group size, in O(1) from per-layer prefix sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from meshnet_common.errors import InvalidRequest
from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.gguf_index import GGUF_INT4_BLOCKS, KEPT_BLOCKS, KEPT_ZEROS
from meshnet_common.models.int4_formats import int4_format
from meshnet_common.precision import (
    DEFAULT_GROUP_SIZE,
    GROUP_SIZES,
    Precision,
    compute_dtype_name,
    dtype_bytes,
    int4_group,
    linear_widths,
    native_format_name,
    quantized_tensor,
)

# Loading briefly holds one extra tensor, plus allocator slack: keep a margin.
OVERHEAD_FRACTION = 0.10
OVERHEAD_MIN_BYTES = 64 * 1024**2


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


# Counted with their weights: scales of FP8 / MXFP4 weights, and the companions of an int4
# checkpoint's packed codes (GPTQ / AWQ / compressed-tensors).
_SCALES = (
    "weight_scale_inv", "_scales", ".qzeros", ".scales", ".g_idx", ".weight_scale",
    ".weight_zero_point", ".weight_shape",
)  # fmt: skip
NF4_BYTES_PER_PARAM = 0.5 + 4.0 / 64  # 4 bit + one fp32 absmax per 64-weight block
FP8_SCALE_BYTES = 4  # weight_scale_inv is float32, one per block
KEPT_SCALE_BYTES = 4  # a kept GGUF block's scale (and zero), float32
_GGUF_FLOATS = ("F32", "F16", "BF16")


def _logical(
    name: str, shape: tuple[int, ...], int4_method: str | None = None
) -> tuple[str, tuple[int, ...]]:
    """A tensor's name and shape as a plain checkpoint holds it: MXFP4 ``X_blocks``
    [experts, out, groups, 16] is ``X`` [experts, in, out] (two values a byte); an int4
    checkpoint's eight codes a word, GPTQ / AWQ ``X.qweight`` ``[in / 8, out]`` /
    ``[in, out / 8]`` and compressed-tensors ``X.weight_packed`` ``[out, in / 8]``, are
    ``X.weight`` ``[out, in]``."""
    if name.endswith("_blocks") and len(shape) >= 3:
        *lead, out, groups, block = shape
        return name[: -len("_blocks")], (*lead, groups * block * 2, out)
    if name.endswith(".qweight") and len(shape) == 2:
        rows, cols = shape  # GPTQ packs along the inputs, AWQ along the outputs
        out_in = (cols * 8, rows) if int4_method == "awq" else (cols, rows * 8)
        return name[: -len(".qweight")] + ".weight", out_in
    if name.endswith(".weight_packed") and len(shape) == 2:
        return name[: -len(".weight_packed")] + ".weight", (shape[0], shape[1] * 8)
    return name, shape


def kv_elements_per_token_layer(config: dict) -> int:
    """K and V elements one token adds to one layer's cache, as the cache holds them.

    Multi-head latent attention (DeepSeek-V3, Kimi K2) caches one compressed latent per token
    and layer, shared by all heads: ``kv_lora_rank`` + the ``qk_rope_head_dim`` rotary key
    (576 elements for DeepSeek-V3, against 2 x 128 x 192 expanded)."""
    hidden = config.get("hidden_size", config.get("n_embd"))
    heads = config.get("num_attention_heads", config.get("n_head"))
    if config.get("kv_lora_rank"):
        return config["kv_lora_rank"] + config.get("qk_rope_head_dim", 0)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return 2 * kv_heads * head_dim


def _checked_group(group_size: int) -> int:
    if group_size not in GROUP_SIZES:
        raise InvalidRequest(
            f"int4 group size {group_size}: expected one of {', '.join(map(str, GROUP_SIZES))}"
        )
    return group_size


@dataclass(frozen=True)
class ModelCosts:
    """Per-layer parameter counts of one model, enough to price any layer range at any
    precision, compute dtype and int4 group size.

    Counts are of values (an MXFP4 byte holds two). ``layer_quantizable`` + ``layer_other``
    is every value of a layer; the optional per-precision buckets say how many of them a
    precision quantizes (None, for costs built by hand: every quantizable weight, no scale
    overhead for int8, nothing stored packed)."""

    num_layers: int
    layer_quantizable: tuple[int, ...]  # 2-D weights inside the layer (nf4 quantizes these)
    layer_other: tuple[int, ...]  # everything else, per layer
    head_numel: int  # embeddings (and learned positions)
    tail_numel: int  # final norm + lm_head (or the tied embedding)
    tied_numel: int  # numel shared by head and tail when embeddings are tied
    kv_elements: int  # per token per layer
    moe: bool = False  # has expert weights (fused 3D tensors once loaded)
    native: str | None = None  # the packed format the checkpoint ships: fp8, mxfp4 or None
    gguf: bool = False  # a GGUF: --dtype auto computes it in float32
    layer_int8: tuple[int, ...] | None = None  # values int8 quantizes
    layer_int8_rows: tuple[int, ...] | None = None  # their output rows (one scale each)
    layer_int4: tuple[tuple[int, ...], ...] | None = None  # per GROUP_SIZES: values int4 takes
    # per GROUP_SIZES asked: the groups those values form (a narrower group where the asked
    # one does not divide a weight's width: ``int4_group``), one scale and zero each
    layer_int4_groups: tuple[tuple[int, ...], ...] | None = None
    layer_packed: tuple[int, ...] | None = None  # values stored packed (fp8 / mxfp4)
    layer_packed_bytes: tuple[int, ...] | None = None  # their bytes, scales included
    # a GGUF's kept blocks (Q5_*, Q6_K, Q8_0), in their values at int8 and int4 (docs/adr/0049)
    layer_kept: tuple[int, ...] | None = None
    layer_kept_bytes: tuple[int, ...] | None = None  # int8 codes, float32 block scales (zeros)
    layer_blocks4: tuple[int, ...] | None = None  # a GGUF's 4-bit blocks: int4 at int8 too
    head_blocks_numel: int = 0  # a GGUF's block embedding, held in its blocks by a head
    head_blocks_bytes: int = 0  # (docs/adr/0050): its bytes in the file
    tail_kept_numel: int = 0  # a GGUF's kept-type LM head, held in its values by an int8 /
    tail_kept_bytes: int = 0  # int4 tail (docs/adr/0049): codes, scales (and zeros)

    def refusal(self, precision: Precision) -> str | None:
        """Why this model cannot be served at ``precision`` (None: it can)."""
        if self.moe and precision is Precision.NF4:
            return (
                "nf4 is not supported for Mixture-of-Experts models: bitsandbytes quantizes "
                "nn.Linear layers only, and most of an MoE's weights are experts (fused 3D "
                "tensors), so the memory would not be saved; serve it in int8 or int4"
            )
        if precision.is_native and self.native != precision.value:
            shipped = f"ships {self.native}" if self.native else "ships plain weights"
            return f"{precision.value} needs a checkpoint that ships it and this one {shipped}"
        return None

    @classmethod
    def from_index(cls, index: CheckpointIndex) -> ModelCosts:
        n = index.num_layers
        gpt2 = index.architecture == "GPT2LMHeadModel"
        names = index.tensors.keys()
        quantizable, other = [0] * n, [0] * n
        int8, int8_rows, packed, packed_bytes = [0] * n, [0] * n, [0] * n, [0] * n
        kept_values, kept_bytes, blocks4 = [0] * n, [0] * n, [0] * n
        int4 = [[0] * n for _ in GROUP_SIZES]
        int4_groups = [[0] * n for _ in GROUP_SIZES]
        try:
            shipped4 = int4_format(index.config)
        except InvalidRequest:
            shipped4 = None  # a format nodes cannot read: the loader says so
        int4_method = None if shipped4 is None else shipped4.method
        for name, info in index.tensors.items():
            layer = index.layer_of(name)
            if layer is None or layer >= n or name.endswith(_SCALES):
                continue  # scales of FP8 / MXFP4 weights are counted with their weights
            logical, shape = _logical(name, info.shape, int4_method)
            numel = _numel(shape)
            if quantized_tensor(logical, shape, Precision.NF4, gpt2=gpt2):
                quantizable[layer] += numel
            else:
                other[layer] += numel
            kept = KEPT_BLOCKS.get(info.dtype) if index.gguf is not None else None
            if kept is not None and quantized_tensor(logical, shape, Precision.INT8, gpt2=gpt2):
                # int8 codes and a float32 scale per block, at int8 and int4 alike
                kept_values[layer] += numel
                per_block = KEPT_SCALE_BYTES * (2 if info.dtype in KEPT_ZEROS else 1)
                kept_bytes[layer] += numel + per_block * numel // kept
                continue
            four = index.gguf is not None and info.dtype in GGUF_INT4_BLOCKS
            if four and quantized_tensor(logical, shape, Precision.INT4, gpt2=gpt2, group_size=32):
                blocks4[layer] += numel  # int4 as they are at int8 too (docs/adr/0049)
            elif quantized_tensor(logical, shape, Precision.INT8, gpt2=gpt2):
                int8[layer] += numel
                _out, width = linear_widths(logical, shape, gpt2=gpt2)
                int8_rows[layer] += numel // width  # one scale per output row
            for i, group in enumerate(GROUP_SIZES):
                if quantized_tensor(logical, shape, Precision.INT4, gpt2=gpt2, group_size=group):
                    int4[i][layer] += numel
                    _out, width = linear_widths(logical, shape, gpt2=gpt2)
                    int4_groups[i][layer] += numel // int4_group(width, group)
            if quantized_tensor(name, info.shape, Precision.FP8, gpt2=gpt2, names=names):
                scale = index.tensors[f"{name}_scale_inv"]
                packed[layer] += numel
                packed_bytes[layer] += _numel(info.shape) + FP8_SCALE_BYTES * _numel(scale.shape)
            elif quantized_tensor(name, info.shape, Precision.MXFP4, gpt2=gpt2):
                scales = index.tensors.get(f"{logical}_scales")
                packed[layer] += numel
                packed_bytes[layer] += info.nbytes + (scales.nbytes if scales else 0)
        head = index.tensors_for(LayerRange(0, 1))
        tail = index.tensors_for(LayerRange(n - 1, n))
        extras = lambda names: sum(  # noqa: E731 - tiny local helper
            _numel(index.tensors[t].shape) for t in names if index.layer_of(t) is None
        )
        shared = set(head) & set(tail)
        # a GGUF head holds its block embedding in its blocks (docs/adr/0050)
        blocks = [
            t for t in head
            if index.gguf is not None and index.layer_of(t) is None
            and index.tensors[t].dtype not in _GGUF_FLOATS and len(index.tensors[t].shape) == 2
        ]  # fmt: skip
        # a GGUF tail at int8 / int4 keeps a kept-type LM head in its values (docs/adr/0049)
        head_name = "lm_head.weight" if "lm_head.weight" in index.tensors else None
        head_name = head_name or (index.naming.tied_embedding if index.tied_embeddings else None)
        out_info = index.tensors.get(head_name) if index.gguf is not None and head_name else None
        out_block = KEPT_BLOCKS.get(out_info.dtype) if out_info is not None else None
        out_numel = _numel(out_info.shape) if out_block else 0
        out_scales = KEPT_SCALE_BYTES * (2 if out_block and out_info.dtype in KEPT_ZEROS else 1)
        try:
            native = native_format_name(index.config)
        except InvalidRequest:
            native = None  # a format nodes cannot read: the loader says so
        return cls(
            num_layers=n,
            layer_quantizable=tuple(quantizable),
            layer_other=tuple(other),
            head_numel=extras(head),
            tail_numel=extras(tail),
            tied_numel=sum(
                _numel(index.tensors[t].shape) for t in shared if index.layer_of(t) is None
            ),
            head_blocks_numel=sum(_numel(index.tensors[t].shape) for t in blocks),
            head_blocks_bytes=sum(index.tensors[t].nbytes for t in blocks),
            tail_kept_numel=out_numel,
            tail_kept_bytes=out_numel + out_scales * out_numel // out_block if out_block else 0,
            kv_elements=kv_elements_per_token_layer(index.config),
            moe=any(".experts." in name for name in index.tensors),
            native=native,
            gguf=index.gguf is not None,
            layer_int8=tuple(int8),
            layer_int8_rows=tuple(int8_rows),
            layer_int4=tuple(tuple(g) for g in int4),
            layer_int4_groups=tuple(tuple(g) for g in int4_groups),
            layer_packed=tuple(packed),
            layer_packed_bytes=tuple(packed_bytes),
            layer_kept=tuple(kept_values),
            layer_kept_bytes=tuple(kept_bytes),
            layer_blocks4=tuple(blocks4),
        )

    @cached_property
    def _prefix(self) -> dict[str, list[int]]:
        """Prefix sums of each per-layer bucket: a range is priced in O(1) (placement is hot)."""
        zeros = (0,) * self.num_layers
        buckets = {
            "total": tuple(
                q + o for q, o in zip(self.layer_quantizable, self.layer_other, strict=True)
            ),
            "nf4": self.layer_quantizable,
            "int8": self.layer_int8 if self.layer_int8 is not None else self.layer_quantizable,
            "int8_rows": self.layer_int8_rows or zeros,
            "packed": self.layer_packed or zeros,
            "packed_bytes": self.layer_packed_bytes or zeros,
            "kept": self.layer_kept or zeros,
            "kept_bytes": self.layer_kept_bytes or zeros,
            "blocks4": self.layer_blocks4 or zeros,
        }
        for i, group in enumerate(GROUP_SIZES):
            values = self.layer_int4[i] if self.layer_int4 is not None else self.layer_quantizable
            buckets[f"int4_{group}"] = values
            buckets[f"int4_groups_{group}"] = (
                self.layer_int4_groups[i]
                if self.layer_int4_groups is not None
                else tuple(v / group for v in values)
            )
        prefix = {}
        for key, values in buckets.items():
            sums = [0]
            for value in values:
                sums.append(sums[-1] + value)
            prefix[key] = sums
        return prefix

    def weight_bytes(
        self,
        layers: LayerRange,
        precision: Precision,
        *,
        dtype: str | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
    ) -> int:
        """Resident bytes of the range's tensors at ``precision``, computing in ``dtype``
        (default: the precision's own), int4 in groups of ``group_size``."""
        act = dtype_bytes(compute_dtype_name(precision, dtype, gguf=self.gguf))
        prefix = self._prefix

        def span(key: str) -> int:
            return prefix[key][layers.end] - prefix[key][layers.start]

        values, blocks = span("total"), 0
        if layers.is_head():  # a GGUF's block embedding at its file bytes (docs/adr/0050)
            values += self.head_numel - self.head_blocks_numel
            blocks = self.head_blocks_bytes
        if layers.is_tail(self.num_layers):
            values += self.tail_numel
            if layers.is_head() and not self.head_blocks_numel:
                values -= self.tied_numel  # one tensor serves both roles
            if precision in (Precision.INT8, Precision.INT4) and self.tail_kept_numel:
                values -= self.tail_kept_numel  # a GGUF's kept LM head, as held
                blocks += self.tail_kept_bytes
        quantized, packed = 0, 0.0
        if precision is Precision.INT8:  # int8 + one scale per output row
            quantized = span("int8")
            packed = quantized + act * span("int8_rows")
            four = span("blocks4")  # a GGUF's 4-bit blocks: int4, a scale and zero per 32
            quantized += four
            packed += four / 2 + 2 * act * four / 32
        elif precision is Precision.INT4:  # 4 bit + a scale and a zero per group
            group = _checked_group(group_size)
            quantized = span(f"int4_{group}")
            packed = quantized / 2 + 2 * act * span(f"int4_groups_{group}")
        elif precision is Precision.NF4:
            quantized = span("nf4")
            packed = quantized * NF4_BYTES_PER_PARAM
        elif precision.is_native:
            quantized = span("packed")
            packed = span("packed_bytes")
        if precision in (Precision.INT8, Precision.INT4):  # a GGUF's Q6_K / Q8_0 as held
            quantized += span("kept")
            packed += span("kept_bytes")
        return int(packed + blocks + (values - quantized) * act)

    def kv_bytes(
        self, num_layers: int, tokens: int, precision: Precision, *, dtype: str | None = None
    ) -> int:
        """The KV cache of ``tokens`` over ``num_layers`` layers, held at the compute dtype."""
        act = dtype_bytes(compute_dtype_name(precision, dtype, gguf=self.gguf))
        return num_layers * tokens * self.kv_elements * act

    def shard_bytes(
        self,
        layers: LayerRange,
        precision: Precision,
        kv_tokens: int,
        *,
        dtype: str | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
    ) -> int:
        """Everything a node needs for ``layers``: weights, KV budget and a load margin."""
        weights = self.weight_bytes(layers, precision, dtype=dtype, group_size=group_size)
        overhead = max(OVERHEAD_MIN_BYTES, int(OVERHEAD_FRACTION * weights))
        return weights + self.kv_bytes(len(layers), kv_tokens, precision, dtype=dtype) + overhead

    def max_layers_from(
        self,
        start: int,
        limit: int,
        memory_bytes: int,
        precision: Precision,
        kv_tokens: int,
        *,
        dtype: str | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
    ) -> int:
        """Largest k <= limit such that ``[start, start + k)`` fits in ``memory_bytes`` (0 if none)."""
        if self.refusal(precision) is not None:
            return 0
        lo, hi = 0, min(limit, self.num_layers - start)
        while lo < hi:  # shard_bytes grows with k: binary search
            mid = (lo + hi + 1) // 2
            need = self.shard_bytes(
                LayerRange(start, start + mid), precision, kv_tokens,
                dtype=dtype, group_size=group_size,
            )  # fmt: skip
            if need <= memory_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo

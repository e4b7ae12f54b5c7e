"""Crafted model files (a few hundred bytes each) are refused in one ModelError line naming
the file: no hang, no traceback, no list or loop sized by what the file claims (issue 52)."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import pytest
from crafted_models import (
    ARRAY,
    GOOD_SAFETENSORS,
    LLAMA_METADATA,
    MOE_METADATA,
    UINT32,
    Raw,
    gguf_file,
    llama_config,
    safetensors_snapshot,
    string_array,
)

from meshnet_common.errors import InvalidRequest, ModelError
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.models_dir import scan_models_dir

BIG = 1 << 40
MAX_EXPERTS = 1 << 12  # meshnet_common.models.MAX_EXPERTS: a file may state up to these
F32, F16 = 0, 1
EMBEDDING = ("token_embd.weight", (32, 2), F32, 0)


def _refused(path: Path) -> str:
    """The one-line ModelError ``CheckpointIndex.load`` raises for ``path``; a hang guard only
    as a safety net (a thread that would loop for ever leaves the test failing, not stuck)."""
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            CheckpointIndex.load(path)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever came out
            outcome.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert outcome, f"{path}: still parsing after 120 s"
    error = outcome[0]
    assert isinstance(error, ModelError), repr(error)
    message = str(error)
    assert str(path) in message and "\n" not in message
    return message


def _experts(dims: tuple[int, ...], kind: int = F32, **file) -> dict:
    return {"base": MOE_METADATA, "tensors": [("blk.0.ffn_gate_exps.weight", dims, kind, 0)],
            **file}  # fmt: skip


def test_the_crafted_files_are_valid_until_one_thing_changes(tmp_path):
    """The base files load: each refusal below is its one defect's."""
    gguf = CheckpointIndex.load(gguf_file(tmp_path / "ok.gguf"))
    assert gguf.num_layers == 1 and "model.embed_tokens.weight" in gguf.tensors
    experts = CheckpointIndex.load(gguf_file(tmp_path / "moe.gguf", **_experts((32, 2, 2))))
    assert "model.layers.0.mlp.experts.1.gate_proj.weight" in experts.tensors
    many = _experts((1, 1, MAX_EXPERTS), F16, data_bytes=2 * MAX_EXPERTS)
    assert CheckpointIndex.load(gguf_file(tmp_path / "many.gguf", **many)).tensors
    snapshot = safetensors_snapshot(tmp_path / "st", GOOD_SAFETENSORS, 128)
    assert CheckpointIndex.load(snapshot).tensors["model.embed_tokens.weight"].shape == (8, 4)


GGUF_CASES = {
    # the reported hang: an experts tensor of 2^40 experts and no bytes
    "experts_2_40_empty": _experts((0, 1, BIG)),
    "experts_2_40": _experts((32, 1, BIG)),
    "experts_too_many": _experts((1, 1, MAX_EXPERTS + 1), F16, data_bytes=2 * MAX_EXPERTS + 2),
    "experts_2d": _experts((32, 2)),
    # the reported MemoryError: a list of 2^40 layers
    "block_count_2_40": {"metadata": {"llama.block_count": BIG}},
    "moe_block_count_2_40": {
        "base": MOE_METADATA,
        "metadata": {"qwen3moe.block_count": BIG},
        "tensors": [EMBEDDING],
    },  # fmt: skip
    "alignment_0": {"metadata": {"general.alignment": 0}},
    "alignment_3": {"metadata": {"general.alignment": 3}},
    "head_count_0": {"metadata": {"llama.attention.head_count": 0}},
    "head_count_text": {"metadata": {"llama.attention.head_count": "two"}},
    "head_count_array": {"metadata": {"llama.attention.head_count": string_array(1, ["x"])}},
    "head_count_2_40": {"metadata": {"llama.attention.head_count": BIG, "llama.block_count": BIG}},
    "q_rows_not_heads": {"metadata": {"llama.attention.head_count": 3}},
    "offset_past_end": {"tensors": [("token_embd.weight", (32, 2), F32, 1 << 20)]},
    "offset_unaligned": {"tensors": [("token_embd.weight", (32, 2), F32, 4)]},
    "dims_overflow": {"tensors": [("token_embd.weight", (1 << 63, 1 << 63), F32, 0)]},
    "dims_zero": {"tensors": [("token_embd.weight", (0, 2), F32, 0)]},
    "dims_five": {"tensors": [("token_embd.weight", (1, 1, 1, 1, 1), F32, 0)]},
    "dims_none": {"tensors": [("token_embd.weight", (), F32, 0)]},
    "tensor_twice": {"tensors": [EMBEDDING, EMBEDDING]},
    "tensors_2_40": {"counts": (BIG, len(LLAMA_METADATA))},
    "entries_2_40": {"counts": (2, BIG)},
    "array_2_40": {"metadata": {"tokenizer.ggml.tokens": string_array(BIG)}},
    "array_past_end": {"metadata": {"tokenizer.ggml.tokens": string_array(1 << 20, ["a"])}},
    "scalars_past_end": {"metadata": {"x": Raw(ARRAY, struct.pack("<IQ", UINT32, 1 << 23))}},
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_a_crafted_gguf_is_refused_in_one_line(tmp_path, case):
    _refused(gguf_file(tmp_path / f"{case}.gguf", **GGUF_CASES[case]))


@pytest.mark.parametrize(
    ("case", "drop"),
    [("no_head_count", "llama.attention.head_count"), ("no_block_count", "llama.block_count"),
     ("no_embedding_length", "llama.embedding_length")],
)  # fmt: skip
def test_a_gguf_missing_a_shape_key_is_refused_naming_it(tmp_path, case, drop):
    """The reported KeyError: a Llama without ``head_count`` (its q/k rows are unpermuted
    by it, and the tracker prices the KV cache by it)."""
    message = _refused(gguf_file(tmp_path / f"{case}.gguf", drop=(drop,)))
    assert drop in message


def test_a_huge_key_length_is_refused(tmp_path):
    path = gguf_file(tmp_path / "key.gguf")
    raw = bytearray(path.read_bytes())
    raw[24:32] = (BIG).to_bytes(8, "little")  # the first key's length
    path.write_bytes(bytes(raw))
    _refused(path)


ENTRY = {"dtype": "F32", "shape": [8, 4], "data_offsets": [0, 128]}
SAFETENSORS_CASES = {
    "not_json": b"\xff{nope",
    "not_utf8_json": b'{"a": "\xff"}',
    "json_list": [1, 2],
    "json_number": 7,
    "nested_too_deep": b"[" * 100_000,
    "entry_a_list": {"a": [1]},
    # (of 2 bytes' size: what an unknown dtype was taken for, silently)
    "dtype_unknown": {"a": {**ENTRY, "dtype": "WAT", "data_offsets": [0, 64]}},
    "dtype_missing": {"a": {"shape": [8, 4], "data_offsets": [0, 128]}},
    "dtype_sub_byte": {"a": {**ENTRY, "dtype": "F4", "data_offsets": [0, 64]}},
    "shape_negative": {"a": {**ENTRY, "shape": [-8, -4]}},
    "shape_huge": {"a": {**ENTRY, "shape": [BIG, BIG], "data_offsets": [0, 4 * BIG * BIG]}},
    "shape_zero": {"a": {**ENTRY, "shape": [0, 4], "data_offsets": [0, 0]}},
    "shape_text": {"a": {**ENTRY, "shape": "84"}},
    "shape_floats": {"a": {**ENTRY, "shape": [8.0, 4.0]}},
    "offsets_reversed": {"a": {**ENTRY, "data_offsets": [128, 0]}},
    "offsets_missing": {"a": {"dtype": "F32", "shape": [8, 4]}},
    "offsets_text": {"a": {**ENTRY, "data_offsets": "ab"}},
    "offsets_three": {"a": {**ENTRY, "data_offsets": [0, 64, 128]}},
    "offsets_wrong_size": {"a": {**ENTRY, "data_offsets": [0, 64]}},
    "offsets_past_end": {"a": {**ENTRY, "data_offsets": [1 << 30, (1 << 30) + 128]}},
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_a_malformed_safetensors_header_is_refused_naming_the_file(tmp_path, case):
    snapshot = safetensors_snapshot(tmp_path / case, SAFETENSORS_CASES[case], 128)
    message = _refused(snapshot)
    assert "model.safetensors" in message


def test_a_header_length_past_the_end_is_refused(tmp_path):
    snapshot = safetensors_snapshot(tmp_path / "st", GOOD_SAFETENSORS, 128)
    path = snapshot / "model.safetensors"
    path.write_bytes((1 << 20).to_bytes(8, "little") + path.read_bytes()[8:])
    _refused(snapshot)


CONFIG_CASES = {
    "layers_2_40": {"num_hidden_layers": BIG},
    "layers_text": {"num_hidden_layers": "6"},
    "heads_0": {"num_attention_heads": 0},
    "heads_missing": {"num_attention_heads": None},
    "hidden_true": {"hidden_size": True},
    "experts_2_40": {"num_experts": BIG},
    "rope_theta_text": {"rope_theta": "fast"},
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_a_config_of_implausible_numbers_is_refused(tmp_path, case):
    _refused(safetensors_snapshot(tmp_path / case, GOOD_SAFETENSORS, 128, **CONFIG_CASES[case]))


@pytest.mark.parametrize(
    "weight_map",
    [{"a": ["model.safetensors"]}, {"a": 7}, {}, ["model.safetensors"], "x"],
)
def test_a_malformed_weight_map_is_refused(tmp_path, weight_map):
    snapshot = safetensors_snapshot(tmp_path / "st", GOOD_SAFETENSORS, 128)
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _refused(snapshot)


def test_a_models_dir_lists_the_good_model_and_one_problem_per_crafted_file(tmp_path):
    safetensors_snapshot(tmp_path / "acme" / "good", GOOD_SAFETENSORS, 128)
    gguf_file(tmp_path / "evil" / "hang" / "model.gguf", **GGUF_CASES["experts_2_40_empty"])
    gguf_file(tmp_path / "evil" / "nohead" / "model.gguf", drop=("llama.attention.head_count",))
    safetensors_snapshot(tmp_path / "evil" / "st", SAFETENSORS_CASES["json_list"], 128)
    gguf_file(tmp_path / "evil" / "two-lines" / "a\nb.gguf", {"llama.block_count": BIG})
    entries, problems = scan_models_dir(tmp_path)
    assert [e.model_id for e in entries] == ["acme/good"]
    assert [p.path.relative_to(tmp_path).as_posix() for p in problems] == [
        "evil/hang", "evil/nohead", "evil/st", "evil/two-lines",
    ]  # fmt: skip
    assert all("\n" not in p.message and "evil/" in p.message for p in problems)


def test_a_rescan_reads_only_snapshots_whose_files_changed(tmp_path, monkeypatch):
    """A tracker scans at each assignment: unchanged snapshots (good or crafted) are not
    parsed again, counted by the loads a scan makes."""
    from meshnet_common.models import models_dir

    good = safetensors_snapshot(tmp_path / "acme" / "good", GOOD_SAFETENSORS, 128)
    gguf_file(tmp_path / "evil" / "blocks" / "model.gguf", {"llama.block_count": BIG})
    loads: list[Path] = []
    real = models_dir.CheckpointIndex.load

    def counted(path):
        loads.append(Path(path))
        return real(path)

    monkeypatch.setattr(models_dir.CheckpointIndex, "load", counted)
    known: dict = {}
    first = scan_models_dir(tmp_path, known)
    assert len(loads) == 2
    assert scan_models_dir(tmp_path, known) == first and len(loads) == 2
    (good / "config.json").write_text((good / "config.json").read_text() + " ")
    again = scan_models_dir(tmp_path, known)
    assert loads[2:] == [good] and [e.model_id for e in again.entries] == ["acme/good"]


@pytest.mark.parametrize(
    "quantization",
    [{"quant_method": "fp8", "weight_block_size": "ab"},
     {"quant_method": "fp8", "weight_block_size": [0]},
     {"quant_method": "compressed-tensors", "config_groups": ["x"]},
     {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": [4]}}},
     {"quant_method": "gptq", "bits": [4], "group_size": {"a": 1}}],
)  # fmt: skip
def test_a_malformed_quantization_config_is_priced_or_refused_never_a_traceback(
    tmp_path, quantization
):
    """The tracker prices every model it finds: a crafted ``quantization_config`` is a
    format nodes cannot read (priced as unquantized; the loader refuses it), not a crash."""
    from meshnet_common.memory import ModelCosts
    from meshnet_common.precision import native_format_name

    snapshot = safetensors_snapshot(
        tmp_path / "st", GOOD_SAFETENSORS, 128, quantization_config=quantization
    )
    costs = ModelCosts.from_index(CheckpointIndex.load(snapshot))
    assert costs.num_layers == 1
    with pytest.raises(InvalidRequest):
        native_format_name(llama_config(quantization_config=quantization))


def test_a_quantization_config_that_is_not_an_object_is_refused(tmp_path):
    _refused(safetensors_snapshot(tmp_path / "st", GOOD_SAFETENSORS, 128, quantization_config="x"))

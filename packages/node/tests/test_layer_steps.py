"""C++ layer steps (docs/adr/0043): a pre-norm layer's decode step made from C++ gives the
module path's numbers bit for bit, in every precision and at SmolLM2's real shapes (from
its Q4_1 GGUF too, where the int4 kernel is called from C++); other layouts keep the Python
program, and so does a process whose kernel module is not settled yet."""

from __future__ import annotations

import pytest
import torch
from program_runs import batched_run, engines, same_run

from meshnet_common.models.gguf_import import smollm2_gguf_path
from meshnet_common.precision import Precision
from meshnet_node.kernels import packed
from meshnet_node.programs import decode

PRECISIONS = [Precision.BFLOAT16, Precision.FLOAT32, Precision.INT8, Precision.INT4]

PROMPT = [1, 504, 3575, 282, 4649, 314, 260, 1345, 282, 4649, 314]


def _steps(stages) -> list:
    return [p.native for s in stages for p in s.layers.programs]


def _kernels_ready() -> None:
    packed.start()
    if packed.wait() is None and packed.unavailable_reason():
        pytest.skip(f"the kernel module is not available here: {packed.unavailable_reason()}")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.value)
def test_pre_norm_layers_step_in_cpp_bit_for_bit(tiny_snapshot, family, precision):
    _kernels_ready()
    prompt = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    reference, programs = engines(tiny_snapshot(family), ((0, 3), (3, 6)), precision)
    same_run(reference, programs, prompt, 10)
    steps = _steps(programs)
    assert all(type(s).__name__ == "LayerStep" for s in steps), steps


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_other_layouts_keep_the_python_program(tiny_snapshot, family):
    _kernels_ready()
    prompt = torch.randint(3, 200, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    reference, programs = engines(tiny_snapshot(family), ((0, 3), (3, 6)), Precision.BFLOAT16)
    same_run(reference, programs, prompt, 4)
    assert all(s is None for s in _steps(programs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_smollm2_gguf_steps_in_cpp_split_as_the_module_path(dtype):
    """The real file and shapes: Q4_1 blocks as int4, three stages; the int4 kernel is
    called from C++ for every projection."""
    _kernels_ready()
    reference, programs = engines(
        smollm2_gguf_path(), ((0, 10), (10, 20), (20, 30)), Precision.INT4, dtype=dtype
    )
    same_run(reference, programs, PROMPT, 16)
    assert all(type(s).__name__ == "LayerStep" for s in _steps(programs))
    prompts = [PROMPT, PROMPT[:5], [1, 77, 88]]
    got, want = batched_run(programs, prompts, 6), batched_run(reference, prompts, 6)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_until_the_kernels_settle_the_python_program_runs(tiny_snapshot, monkeypatch):
    """A node whose kernel module is still building decodes through the Python program,
    then through C++ steps once it is checked: the same bits either way."""
    _kernels_ready()
    prompt = torch.randint(3, 200, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    reference, programs = engines(tiny_snapshot("llama"), ((0, 3), (3, 6)), Precision.INT4)
    monkeypatch.setattr(packed, "settled", lambda: False)
    same_run(reference, programs, prompt, 4)
    assert all(s is decode._PENDING for s in _steps(programs))
    monkeypatch.undo()
    same_run(reference, programs, prompt, 4)
    assert all(type(s).__name__ == "LayerStep" for s in _steps(programs))

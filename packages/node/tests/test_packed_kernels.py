"""FP8 / MXFP4 products on packed weights (meshnet_node.kernels.packed): the kernel and the
pure-torch fallback both equal the checkpoints' definition, within float32 rounding."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from meshnet_common.models import native_formats
from meshnet_node.kernels import packed

FP8_CASES = [(576, 320, (128, 128)), (100, 77, (128, 128)), (256, 512, (128, 128)), (70, 200, (32, 48))]  # fmt: skip
MXFP4_CASES = [(96, 64), (40, 2880), (33, 32)]
ROWS = [1, 2, 3, 4, 5, 7, 9, 13, 17, 33, 65]
# the fallback is slow and has one path: fewer row counts (each path of the dispatch)
IMPL_ROWS = [("kernel", rows) for rows in ROWS] + [("fallback", rows) for rows in (1, 13, 65)]


@pytest.fixture(scope="module")
def kernel(packed_kernel) -> types.ModuleType:
    assert packed.ready()
    return packed_kernel


def fp8_reference(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    return native_formats.fp8_dequantize(w.view(torch.float8_e4m3fn), s, block)


def mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # native_formats works on (experts, out, in/32, 16) and returns (experts, in, out)
    return native_formats.mxfp4_dequantize(blocks[None], scales[None])[0].T


def implementation(request, name: str):
    return request.getfixturevalue("kernel") if name == "kernel" else packed.Reference


@pytest.fixture(params=["kernel", "fallback"])
def impl(request):
    return implementation(request, request.param)


@pytest.mark.parametrize(("n", "k", "block"), FP8_CASES)
def test_fp8_dequantize_is_the_checkpoint_definition(impl, n, k, block):
    w, s = packed.fp8_probe(n, k, block, seed=n)
    ref = fp8_reference(w, s, block)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(n, k, dtype=dtype)
        assert torch.equal(packed.fp8_dequantize(w, s, block, out, _module=impl), ref.to(dtype))


@pytest.mark.parametrize(("n", "k"), MXFP4_CASES)
def test_mxfp4_dequantize_is_the_checkpoint_definition(impl, n, k):
    blocks, scales = packed.mxfp4_probe(n, k, seed=n)
    ref = mxfp4_reference(blocks, scales)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(n, k, dtype=dtype)
        got = packed.mxfp4_dequantize(blocks, scales, out, _module=impl)
        assert torch.equal(got, ref.to(dtype))


@pytest.mark.parametrize(("which", "rows"), IMPL_ROWS)
@pytest.mark.parametrize(("n", "k", "block"), FP8_CASES)
def test_fp8_linear_equals_the_float32_product(request, which, rows, n, k, block):
    impl = implementation(request, which)
    w, s = packed.fp8_probe(n, k, block, seed=rows)
    ref = fp8_reference(w, s, block)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(n, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        for b in (None, bias.to(dtype)):
            y = packed.fp8_linear(x, w, s, block, b, _module=impl)
            assert packed.close(y, x, ref, b)
    x = torch.randn(rows, k, generator=gen)  # float32 to within 1e-5 of the result's scale
    want = F.linear(x.double(), ref.double(), bias.double())
    got = packed.fp8_linear(x, w, s, block, bias, _module=impl)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize(("which", "rows"), IMPL_ROWS)
@pytest.mark.parametrize(("n", "k"), MXFP4_CASES)
def test_mxfp4_linear_equals_the_float32_product(request, which, rows, n, k):
    impl = implementation(request, which)
    blocks, scales = packed.mxfp4_probe(n, k, seed=rows)
    ref = mxfp4_reference(blocks, scales)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(n, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        for b in (None, bias.to(dtype)):
            y = packed.mxfp4_linear(x, blocks, scales, b, _module=impl)
            assert packed.close(y, x, ref, b)


def test_leading_dimensions_and_float8_tensors_are_taken(kernel):
    w, s = packed.fp8_probe(64, 256, (128, 128), seed=5)
    x = torch.randn(2, 3, 256).bfloat16()
    y = packed.fp8_linear(x, w.view(torch.float8_e4m3fn), s, (128, 128))
    assert y.shape == (2, 3, 64) and y.dtype is torch.bfloat16
    assert torch.equal(y, packed.fp8_linear(x.reshape(6, 256), w, s, (128, 128)).view(2, 3, 64))
    blocks, scales = packed.mxfp4_probe(64, 256, seed=5)
    assert packed.mxfp4_linear(x, blocks, scales).shape == (2, 3, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_alone_equal_rows_together_in_the_fused_path(kernel, dtype):
    """A decode step's row does not depend on which other rows share the call, nor on the
    thread count: bit for bit."""
    x = torch.randn(40, 576).to(dtype)
    w, s = packed.fp8_probe(300, 576, (128, 128), seed=1)
    blocks, scales = packed.mxfp4_probe(300, 576, seed=1)
    bias = torch.randn(300).to(dtype)
    for call in (
        lambda rows: packed.fp8_linear(rows, w, s, (128, 128), bias, fused=True),
        lambda rows: packed.mxfp4_linear(rows, blocks, scales, bias, fused=True),
    ):
        together = call(x)
        assert torch.equal(together, torch.cat([call(x[i : i + 1]) for i in range(len(x))]))
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(together, call(x))
        finally:
            torch.set_num_threads(threads)


def test_forcing_a_path(kernel):
    w, s = packed.fp8_probe(64, 256, (128, 128), seed=4)
    ref = fp8_reference(w, s, (128, 128))
    x = torch.randn(2, 256).bfloat16()
    for fused in (True, False, None):
        assert packed.close(packed.fp8_linear(x, w, s, (128, 128), fused=fused), x, ref, None)


def test_the_check_accepts_the_kernel(kernel):
    assert packed.agrees_with_reference(kernel) is None


def test_the_check_refuses_a_kernel_that_is_off(kernel):
    def off_fp8(x, w, s, bn, bk, b):
        y = kernel.fp8_linear(x, w, s, bn, bk, b)
        return y * (1 + 1e-3)

    wrong = types.SimpleNamespace(**{name: getattr(kernel, name) for name in dir(kernel) if not name.startswith("_")})  # fmt: skip
    wrong.fp8_linear = off_fp8
    assert "FP8 product differs" in packed.agrees_with_reference(wrong)

    def off_dequant(blocks, scales, out):  # one scale byte read from the wrong group
        kernel.mxfp4_dequantize(blocks, torch.roll(scales, 1, dims=1).contiguous(), out)

    wrong = types.SimpleNamespace(**{name: getattr(kernel, name) for name in dir(kernel) if not name.startswith("_")})  # fmt: skip
    wrong.mxfp4_dequantize = off_dequant
    assert "MXFP4 dequantization differs" in packed.agrees_with_reference(wrong)


def test_a_refused_kernel_leaves_the_fallback_serving(kernel, monkeypatch, tmp_path, caplog):
    """start() on a kernel that disagrees: not used, one warning, products still right."""
    monkeypatch.setattr(packed, "_state", {"module": None, "thread": None, "reason": None})
    monkeypatch.setattr(packed, "build_path", lambda: tmp_path / "built.so")
    monkeypatch.setattr(packed, "_build", lambda path: kernel)
    monkeypatch.setattr(packed, "agrees_with_reference", lambda module: "FP8 product differs")
    with caplog.at_level("WARNING", logger=packed.__name__):
        assert packed.start("cpu")
        assert packed.wait(60) is None
    assert not packed.ready()
    assert "FP8 product differs" in packed.unavailable_reason()
    assert len([r for r in caplog.records if r.name == packed.__name__]) == 1
    w, s = packed.fp8_probe(40, 128, (128, 128), seed=2)
    x = torch.randn(3, 128)
    ref = fp8_reference(w, s, (128, 128))
    assert packed.close(packed.fp8_linear(x, w, s, (128, 128)), x, ref, None)


def test_without_a_compiler_the_fallback_serves(monkeypatch, tmp_path):
    if not packed.applies("cpu"):
        pytest.skip("the kernel is written for x86-64")

    def no_compiler(path):
        raise RuntimeError("ninja: build stopped: subcommand failed.")

    monkeypatch.setattr(packed, "_state", {"module": None, "thread": None, "reason": None})
    monkeypatch.setattr(packed, "build_path", lambda: tmp_path / "built.so")
    monkeypatch.setattr(packed, "_build", no_compiler)
    packed.start("cpu")
    assert packed.wait(60) is None and "not built" in packed.unavailable_reason()
    blocks, scales = packed.mxfp4_probe(24, 64, seed=3)
    x = torch.randn(2, 64).bfloat16()
    ref = mxfp4_reference(blocks, scales)
    assert packed.close(packed.mxfp4_linear(x, blocks, scales), x, ref, None)


def test_no_kernel_off_x86_or_off_the_cpu(monkeypatch):
    assert not packed.applies("meta")
    monkeypatch.setattr(packed.platform, "machine", lambda: "aarch64")
    assert not packed.applies("cpu")
    assert not packed.start("cpu")


def test_a_build_left_half_done_by_a_killed_process_blocks_no_later_one(tmp_path, monkeypatch):
    """torch's builder locks its folder with a file a killed builder leaves behind: each
    build runs in a folder of its own, and the module moves into place whole."""
    from torch.utils import cpp_extension

    path = tmp_path / "meshnet_packed_x" / "meshnet_packed_x.so"
    path.parent.mkdir()
    (path.parent / "lock").touch()  # what a builder killed mid-build leaves
    seen = {}

    def load(name, sources, build_directory, **kwargs):
        seen["folder"] = Path(build_directory)
        assert seen["folder"].parent == path.parent and not (seen["folder"] / "lock").exists()
        (seen["folder"] / f"{name}.so").write_bytes(b"module")
        return "the module"

    monkeypatch.setattr(cpp_extension, "load", load)
    assert packed._build(path) == "the module"
    assert path.read_bytes() == b"module" and not seen["folder"].exists()

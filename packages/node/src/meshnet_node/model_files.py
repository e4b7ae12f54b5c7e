"""Where a node's model files are, for what is read beside the weights: the snapshot's
date (``/v1/models``), the draft model of speculation, and what transformers'
``from_pretrained`` takes for the tokenizer (a snapshot folder, or a GGUF's folder and
file)."""

from __future__ import annotations

from pathlib import Path

from meshnet_common.errors import InvalidRequest, ModelError
from meshnet_common.models.checkpoint import gguf_in
from meshnet_common.models.gguf_index import pretrained_args
from meshnet_common.models.hub.cache import split_model_ref
from meshnet_common.models.hub.download import hub_snapshot
from meshnet_common.models.models_dir import resolve_snapshot
from meshnet_node.settings import NodeSettings


def snapshot_created(snapshot: Path | None) -> int:
    """When the model's snapshot was written (its config.json, or its GGUF file), as
    /v1/models reports it."""
    try:
        path = Path(snapshot)
        config = path / "config.json"
        if path.is_dir() and not config.exists():
            config = gguf_in(path) or config
        return int((path if path.is_file() else config).stat().st_mtime)
    except (OSError, TypeError, ModelError):
        return 0


def draft_snapshot(settings: NodeSettings) -> Path:
    """``--draft-model``: a snapshot folder, or a model id ``ORG/NAME[@REV]`` in
    ``--models-dir``, else in the standard HF cache (downloaded there when missing, unless
    HF_HUB_OFFLINE is set)."""
    path = Path(settings.draft_model).expanduser()
    if path.is_dir():
        return path
    if settings.models_dir is not None:
        return resolve_snapshot(settings.models_dir, settings.draft_model)
    try:
        model_id, revision = split_model_ref(settings.draft_model)
    except InvalidRequest as exc:
        raise ModelError(f"--draft-model {settings.draft_model}: no such folder ({exc})") from exc
    return hub_snapshot(model_id, revision)


def tokenizer_source(model_path: Path | str) -> tuple[Path, dict]:
    """What ``from_pretrained`` takes for a node's model: a snapshot folder as it is; a GGUF
    (a file, or the one in a folder without config.json) as its folder and ``gguf_file``:
    transformers reads tokenizer and chat template from its metadata."""
    path = Path(model_path)
    if path.is_dir() and not (path / "config.json").exists():
        path = gguf_in(path) or path
    return pretrained_args(path)

"""The HF hub as the last source of a shard's weights: only the files holding the range
(``allow_patterns`` from the index), else a snapshot filtered to what a node loads.

Downloads use huggingface_hub's standard cache (``HF_HUB_CACHE`` / ``HF_HOME``), so a model
already fetched by ``hf download`` or vLLM is not downloaded again. Every file comes from
one commit (docs/adr/0032): ``--revision``, else the tracker's, else the one the index came
from; with a tracker, the range's tensors must hash as its manifest says.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from meshnet_common.errors import ModelError
from meshnet_common.layers import LayerRange
from meshnet_common.models.checkpoint import (
    INDEX_FILE,
    CheckpointIndex,
    TensorInfo,
    architecture_of,
    num_layers_of,
    read_config,
)
from meshnet_common.models.hub.cache import COMMIT
from meshnet_common.models.hub.download import (
    IGNORE_PATTERNS,
    SMALL_FILE_PATTERNS,
    SNAPSHOT_PATTERNS,
)
from meshnet_common.models.models_dir import validate_model_id
from meshnet_common.models.shardfiles import ShardSource
from meshnet_node.swarm import FetchError

logger = logging.getLogger(__name__)


def _hub_files_for(index_file: Path, config_file: Path, layers: LayerRange) -> list[str]:
    """Weight files holding ``layers``, read from the index's weight_map alone (the weight
    files are not downloaded yet, so their headers cannot be read)."""
    config = read_config(Path(config_file).parent)
    architecture = architecture_of(config, config_file)
    weight_map = json.loads(Path(index_file).read_text())["weight_map"]
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelError(f"{index_file}: empty or malformed weight_map")
    index = CheckpointIndex(
        root=Path(index_file).parent,
        config=config,
        architecture=architecture,
        num_layers=num_layers_of(config),
        tensors={name: TensorInfo(name, str(file), "", (), 0) for name, file in weight_map.items()},
    )
    return index.files_for(layers)


def hub_view(snapshot: Path, cache_dir: Path, model_id: str, layers: LayerRange) -> Path:
    """A loadable folder for a partial hub snapshot: links to the files it holds and an index
    naming only their tensors (the hub's index lists every weight file, and the HF cache's
    own files must not be rewritten)."""
    org, name = validate_model_id(model_id)
    label = f"hub-{snapshot.name}-layers-{layers.start}-{layers.end}"
    view = Path(cache_dir) / org / name / label
    staging = view.parent / f".partial-{label}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    index = json.loads((snapshot / INDEX_FILE).read_text())
    held = set()
    for path in sorted(snapshot.rglob("*")):
        rel = path.relative_to(snapshot)
        if path.is_dir() or rel.as_posix() == INDEX_FILE:
            continue
        held.add(rel.as_posix())
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).symlink_to(path.resolve())
    index["weight_map"] = {t: f for t, f in index["weight_map"].items() if f in held}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))
    if view.exists():
        shutil.rmtree(view)
    os.replace(staging, view)
    return view


def fetch_from_hub(
    model_id: str,
    layers: LayerRange,
    cache_dir: Path,
    *,
    revision: str | None = None,
    hub_cache: Path | None = None,
) -> Path:
    """HF hub: the index first, then only the files holding the range (``allow_patterns``),
    presented through ``hub_view`` under ``cache_dir``; without a readable index (e.g. a
    single ``model.safetensors``), a snapshot filtered to what a node loads. Downloads go to
    the standard HF cache unless ``hub_cache`` overrides it. Every file after the index comes
    from the commit the index came from (a branch may move in between)."""
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
    except ImportError as exc:  # pragma: no cover - a dependency
        raise FetchError("huggingface_hub is not installed") from exc
    where: dict = {"revision": revision}
    if hub_cache is not None:  # otherwise HF_HUB_CACHE / HF_HOME decide, as for `hf download`
        where["cache_dir"] = hub_cache
    try:
        index_file = hf_hub_download(model_id, "model.safetensors.index.json", **where)
        where["revision"] = pinned_revision(Path(index_file), revision)
        config_file = hf_hub_download(model_id, "config.json", **where)
        wanted = _hub_files_for(Path(index_file), Path(config_file), layers)
    except Exception as first:  # noqa: BLE001 - any hub failure means: try the next way
        logger.warning("hub subset for %s failed (%s); trying the full snapshot", model_id, first)
        try:
            return Path(
                snapshot_download(
                    model_id,
                    allow_patterns=list(SNAPSHOT_PATTERNS),
                    ignore_patterns=list(IGNORE_PATTERNS),
                    **where,
                )
            )
        except Exception as exc:  # noqa: BLE001
            raise FetchError(f"HF hub: {exc}") from exc
    ignore = list(IGNORE_PATTERNS)
    if any("/" in name for name in wanted):  # weights in a subfolder: keep that folder
        ignore.remove("*/*")
    logger.info("fetching %s layers %s from the HF hub: %s", model_id, layers, ", ".join(wanted))
    try:
        snapshot = snapshot_download(
            model_id, allow_patterns=[*wanted, *SMALL_FILE_PATTERNS], ignore_patterns=ignore,
            **where,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        raise FetchError(f"HF hub: {exc}") from exc
    try:
        return hub_view(Path(snapshot), cache_dir, model_id, layers)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FetchError(f"HF hub snapshot {snapshot}: {exc}") from exc


def pinned_revision(downloaded: Path, asked: str | None) -> str | None:
    """The commit a hub download came from (its snapshot folder's name), else ``asked``."""
    folder = downloaded.parent.name
    return folder if COMMIT.fullmatch(folder) else asked


def check_against(path: Path, model_id: str, layers: LayerRange, expected: dict) -> None:
    """FetchError unless the range's tensors (and config) in ``path`` hash as the trusted
    manifest says: the hub's files are the tracker's (docs/adr/0032)."""
    try:
        own = ShardSource(CheckpointIndex.load(path), model_id, layers, "hub").manifest()
    except (OSError, ValueError, KeyError, ModelError) as exc:
        raise FetchError(f"hub files of {model_id} unreadable: {exc}") from exc

    def digests(manifest: dict) -> dict:
        tensors = {t["name"]: t["sha256"] for t in manifest["tensors"]}
        config = [f["sha256"] for f in manifest["files"] if f["name"] == "config.json"]
        return {"tensors": tensors, "config": config}

    if digests(own) != digests(expected):
        raise FetchError(f"the hub's {model_id} layers {layers} differ from the tracker's")

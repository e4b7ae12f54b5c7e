"""The models directory: find, list and place model snapshots on disk.

Two layouts are understood, and a model id is always ``ORG/NAME``:

* ``hub``: the Hugging Face cache layout ``models--ORG--NAME/snapshots/REV/`` with
  ``refs/main`` naming ``REV`` (what ``huggingface_hub.snapshot_download(cache_dir=DIR)``
  leaves behind);
* ``plain``: a folder ``ORG/NAME/`` holding ``config.json`` and the weights, or one GGUF file.

A models dir serves the snapshot ``refs/main`` names; the standard HF cache itself, at any
revision, is ``meshnet_common.models.hub``'s.

Writers build a snapshot in a hidden staging folder inside the models directory and move
it into place with one rename (``staged_snapshot``), so a failed write leaves nothing
half-written for a scan to trip over.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from meshnet_common.errors import InvalidRequest, ModelError, NotFound
from meshnet_common.models.checkpoint import CheckpointIndex

logger = logging.getLogger(__name__)

Layout = Literal["hub", "plain"]
LAYOUTS: tuple[Layout, ...] = ("plain", "hub")

HUB_PREFIX = "models--"
HUB_SEPARATOR = "--"
HUB_REF = "main"
STAGING_PREFIX = ".staging-"

_ID_PART = re.compile(r"[A-Za-z0-9._-]+")
# A folder holding files like these without config.json is a broken model, not a stray folder.
_MODEL_FILE_SUFFIXES = (".safetensors", ".json", ".bin")


@dataclass(frozen=True)
class ModelEntry:
    """One model snapshot found in a models directory."""

    model_id: str
    path: Path
    layout: Layout
    revision: str | None
    num_layers: int
    architecture: str
    dtype: str
    size_bytes: int
    files: tuple[str, ...]

    def to_json(self) -> dict:
        """A JSON-ready dict (path as string, files as list)."""
        data = asdict(self)
        data["path"] = str(self.path)
        data["files"] = list(self.files)
        return data


class ScanProblem(NamedTuple):
    """A snapshot that could not be read, and why (one line: a file or folder name holding
    a line break is escaped)."""

    path: Path
    message: str

    @classmethod
    def of(cls, path: Path, message: str) -> ScanProblem:
        return cls(path, message.replace("\r", "\\r").replace("\n", "\\n"))


class ModelScan(NamedTuple):
    """Result of scanning a models directory: good entries and broken snapshots."""

    entries: list[ModelEntry]
    problems: list[ScanProblem]


def validate_model_id(model_id: str) -> tuple[str, str]:
    """Split ``ORG/NAME`` into its parts; raise InvalidRequest for anything else."""
    if not isinstance(model_id, str):
        raise InvalidRequest(f"model id must be a string, got {type(model_id).__name__}")
    parts = model_id.split("/")
    if len(parts) != 2 or not all(parts):
        raise InvalidRequest(f"invalid model id {model_id!r}: expected ORG/NAME", param="model")
    for part in parts:
        # ".." and "." would walk out of (or sit on) the models directory.
        if not _ID_PART.fullmatch(part) or part in (".", ".."):
            raise InvalidRequest(
                f"invalid model id {model_id!r}: parts may only use A-Z a-z 0-9 . _ - "
                "and may not be '.' or '..'",
                param="model",
            )
        if HUB_SEPARATOR in part:
            # "--" would make the hub folder name models--ORG--NAME ambiguous.
            raise InvalidRequest(f"invalid model id {model_id!r}: '--' is not allowed")
    return parts[0], parts[1]


def hub_folder_name(model_id: str) -> str:
    """``ORG/NAME`` -> ``models--ORG--NAME``."""
    org, name = validate_model_id(model_id)
    return f"{HUB_PREFIX}{org}{HUB_SEPARATOR}{name}"


def snapshot_path_for(
    models_dir: Path | str, model_id: str, layout: Layout, revision: str | None = None
) -> Path:
    """Where a snapshot of ``model_id`` lives (or would live) in ``layout``.

    The hub layout needs ``revision``; writers get it from ``staged_snapshot``.
    """
    org, name = validate_model_id(model_id)
    root = Path(models_dir)
    if layout == "plain":
        return root / org / name
    if layout == "hub":
        if not revision or not _ID_PART.fullmatch(revision) or revision in (".", ".."):
            raise InvalidRequest(f"hub layout needs a valid revision, got {revision!r}")
        return root / hub_folder_name(model_id) / "snapshots" / revision
    raise InvalidRequest(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def _check_dir(models_dir: Path) -> None:
    if not models_dir.exists():
        raise ModelError(f"{models_dir}: models directory does not exist")
    if not models_dir.is_dir():
        raise ModelError(f"{models_dir}: models directory is not a directory")


def _list_dir(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except OSError as exc:
        raise ModelError(f"{path}: unreadable directory ({exc.strerror or exc})") from exc


def _hub_snapshot(repo_dir: Path) -> tuple[Path, str]:
    """The snapshot ``refs/main`` points at in one ``models--ORG--NAME`` folder."""
    ref = repo_dir / "refs" / HUB_REF
    snapshots = repo_dir / "snapshots"
    if ref.is_file():
        try:
            revision = ref.read_text().strip()
        except OSError as exc:
            raise ModelError(f"{ref}: unreadable ref ({exc.strerror or exc})") from exc
        if not _ID_PART.fullmatch(revision) or revision in (".", ".."):
            raise ModelError(f"{ref}: malformed revision {revision!r}")
        path = snapshots / revision
        if not path.is_dir():
            raise ModelError(f"{ref}: points at missing snapshot {path}")
        return path, revision
    # Without refs/main a single snapshot is unambiguous; several are not.
    candidates = [p for p in _list_dir(snapshots) if p.is_dir()] if snapshots.is_dir() else []
    if len(candidates) == 1:
        return candidates[0], candidates[0].name
    raise ModelError(
        f"{repo_dir}: no refs/{HUB_REF} and {len(candidates)} snapshots; cannot pick a revision"
    )


class _Found(NamedTuple):
    model_id: str
    layout: Layout
    path: Path  # the snapshot, or the folder at fault when ``problem`` is set
    revision: str | None
    problem: str | None  # a message naming the path, or None when the snapshot was located


def _looks_like_model(folder: Path) -> bool:
    try:
        return any(p.suffix in _MODEL_FILE_SUFFIXES for p in folder.iterdir())
    except OSError:
        # An unreadable folder might be a model; report it rather than hide it.
        return True


def _discover_hub(repo_dir: Path) -> _Found:
    org, sep, name = repo_dir.name[len(HUB_PREFIX) :].partition(HUB_SEPARATOR)
    model_id = f"{org}/{name}"
    if not sep or not _is_valid_id(model_id):
        return _Found(model_id, "hub", repo_dir, None, f"{repo_dir}: not a models--ORG--NAME name")
    try:
        path, revision = _hub_snapshot(repo_dir)
    except ModelError as exc:
        return _Found(model_id, "hub", repo_dir, None, str(exc))
    return _Found(model_id, "hub", path, revision, None)


def _is_plain_model(folder: Path) -> bool:
    """A plain-layout model folder: a snapshot (config.json), or GGUF files (``FILE.gguf``,
    whose metadata is the config; ``CheckpointIndex.load`` says if they cannot be read)."""
    if (folder / "config.json").is_file():
        return True
    try:
        return folder.is_dir() and any(p.suffix == ".gguf" for p in folder.iterdir())
    except OSError:
        return False


def _discover_plain(org_dir: Path) -> list[_Found]:
    try:
        children = _list_dir(org_dir)
    except ModelError as exc:
        return [_Found(org_dir.name, "plain", org_dir, None, str(exc))]
    found = []
    for child in children:
        if child.name.startswith(".") or not child.is_dir():
            continue
        model_id = f"{org_dir.name}/{child.name}"
        if _is_plain_model(child):
            problem = None if _is_valid_id(model_id) else f"{child}: invalid model id {model_id!r}"
            found.append(_Found(model_id, "plain", child, None, problem))
        elif _looks_like_model(child):
            found.append(_Found(model_id, "plain", child, None, f"{child}: no config.json"))
    return found


def _discover(models_dir: Path) -> list[_Found]:
    """Every model id present, located but not yet indexed (cheap: no weight headers)."""
    _check_dir(models_dir)
    found: list[_Found] = []
    for top in _list_dir(models_dir):
        if top.name.startswith(".") or not top.is_dir():
            continue  # staging folders, locks, the hub's .locks, version files
        if top.name.startswith(HUB_PREFIX):
            found.append(_discover_hub(top))
        else:
            found.extend(_discover_plain(top))
    return found


def _is_valid_id(model_id: str) -> bool:
    try:
        validate_model_id(model_id)
    except InvalidRequest:
        return False
    return True


def scan_models_dir(models_dir: Path | str, known: dict[Path, tuple] | None = None) -> ModelScan:
    """Index every snapshot in ``models_dir``; broken ones become problems, not exceptions.

    ``known`` (updated in place; one scan at a time): snapshot -> (``snapshot_fingerprint``,
    its entry or its problem) from the last scan; a snapshot whose files did not change is
    not read again (a tracker scans at each assignment: neither big checkpoints nor a
    crafted file are parsed each time).
    Raises ModelError only when the directory itself is missing or unreadable.
    """
    entries: list[ModelEntry] = []
    problems: list[ScanProblem] = []
    seen: dict[str, Layout] = {}
    cache = {} if known is None else known
    located: set[Path] = set()
    # Plain first: resolve_snapshot prefers the plain copy when an id is in both layouts.
    for found in sorted(_discover(Path(models_dir)), key=lambda f: LAYOUTS.index(f.layout)):
        if found.problem is not None:
            problems.append(ScanProblem.of(found.path, found.problem))
        elif found.model_id in seen:
            message = (
                f"{found.path}: {found.model_id} is also present in the "
                f"{seen[found.model_id]} layout, which is the copy used"
            )
            problems.append(ScanProblem.of(found.path, message))
        else:
            located.add(found.path)
            result = _indexed(found, cache)
            if isinstance(result, ScanProblem):
                problems.append(result)
                continue
            entries.append(result)
            seen[found.model_id] = found.layout
    for gone in set(cache) - located:
        del cache[gone]
    entries.sort(key=lambda e: e.model_id)
    problems.sort(key=lambda p: str(p.path))
    return ModelScan(entries, problems)


def _indexed(found: _Found, cache: dict[Path, tuple]) -> ModelEntry | ScanProblem:
    """The entry of a located snapshot, or its problem: from ``cache`` while its files are
    unchanged, else read (and cached)."""
    fingerprint = (found.model_id, found.layout, found.revision, snapshot_fingerprint(found.path))
    cached = cache.get(found.path)
    if cached is not None and cached[0] == fingerprint:
        return cached[1]
    try:
        result = model_entry(found.model_id, found.layout, found.path, found.revision)
    except ModelError as exc:
        result = ScanProblem.of(found.path, _with_path(found.path, str(exc)))
    cache[found.path] = (fingerprint, result)
    return result


def snapshot_fingerprint(path: Path | str) -> tuple:
    """What changes when a snapshot's files change: (name, size, mtime) of each file in it
    (symlinks followed, as in the hub layout). Cheap: stats, no reads. A folder that
    cannot be listed (removed meanwhile) has no files."""
    items = []
    try:
        children = sorted(Path(path).iterdir())
    except OSError:
        return ()
    for child in children:
        try:
            st = child.stat()
        except OSError:
            continue
        if child.is_file():
            items.append((child.name, st.st_size, st.st_mtime_ns))
    return tuple(items)


def _with_path(path: Path, message: str) -> str:
    # checkpoint.py names the file at fault most of the time; add the snapshot when it doesn't.
    return message if str(path) in message else f"{path}: {message}"


def model_entry(model_id: str, layout: Layout, path: Path, revision: str | None) -> ModelEntry:
    """Index one located snapshot (its weight headers are read); ModelError if broken."""
    index = CheckpointIndex.load(path)
    return ModelEntry(
        model_id=model_id,
        path=path,
        layout=layout,
        revision=revision,
        num_layers=index.num_layers,
        architecture=index.architecture,
        dtype=index.dtype,
        size_bytes=index.total_bytes,
        files=tuple(sorted({t.file for t in index.tensors.values()})),
    )


def load_entry(models_dir: Path | str, model_id: str, layout: Layout | None = None) -> ModelEntry:
    """Locate and index one model (in ``layout``, or wherever resolve_snapshot finds it).

    Raises NotFound if absent, ModelError naming the path if broken.
    """
    if layout is None:
        path = resolve_snapshot(models_dir, model_id)
        plain = snapshot_path_for(models_dir, model_id, "plain")
        layout = "plain" if path == plain else "hub"
    else:
        found = find_snapshot(models_dir, model_id, layout)
        if found is None:
            raise NotFound(f"model {model_id!r} not found in {models_dir} ({layout} layout)")
        path = found
    revision = path.name if layout == "hub" else None
    try:
        return model_entry(model_id, layout, path, revision)
    except ModelError as exc:
        raise ModelError(_with_path(path, str(exc))) from exc


def find_snapshot(models_dir: Path | str, model_id: str, layout: Layout) -> Path | None:
    """The snapshot of ``model_id`` in one layout, or None when there is none."""
    root = Path(models_dir)
    if layout == "plain":
        path = snapshot_path_for(root, model_id, "plain")
        return path if _is_plain_model(path) else None
    repo_dir = root / hub_folder_name(model_id)
    if not repo_dir.is_dir():
        return None
    return _hub_snapshot(repo_dir)[0]


def resolve_snapshot(models_dir: Path | str, model_id: str) -> Path:
    """The snapshot folder of ``model_id`` (plain layout first, then hub).

    Raises NotFound listing the known ids, ModelError for an unusable directory or a
    dangling hub ref.
    """
    root = Path(models_dir)
    validate_model_id(model_id)
    _check_dir(root)
    for layout in LAYOUTS:
        path = find_snapshot(root, model_id, layout)
        if path is not None:
            return path
    known = sorted({f.model_id for f in _discover(root) if f.problem is None})
    raise NotFound(
        f"model {model_id!r} not found in {root}; known: {', '.join(known) or '(none)'}",
        param="model",
    )


def content_revision(folder: Path) -> str:
    """A 40-hex revision derived from the folder's file names and contents (deterministic)."""
    digest = hashlib.sha1(usedforsecurity=False)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with open(path, "rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


class StagedSnapshot:
    """A snapshot being written: ``folder`` to write into; ``path`` once published."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path: Path | None = None


@contextmanager
def staged_snapshot(
    models_dir: Path | str,
    model_id: str,
    layout: Layout,
    revision: str | None = None,
    *,
    replace: bool = False,
) -> Iterator[StagedSnapshot]:
    """Yield a staging folder to write a snapshot into; publish it atomically on success.

    On an exception the staging folder is deleted and nothing is published. For the hub
    layout the revision defaults to ``content_revision`` of what was written, and
    ``refs/main`` is updated after the snapshot folder is in place.
    """
    root = Path(models_dir)
    validate_model_id(model_id)
    if layout not in LAYOUTS:
        raise InvalidRequest(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        # Inside models_dir so the final rename stays on one filesystem.
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    except OSError as exc:
        raise ModelError(f"{root}: cannot create a staging folder ({exc.strerror or exc})") from exc
    staged = StagedSnapshot(staging)
    try:
        yield staged
        staged.path = _publish(root, model_id, layout, staging, revision, replace)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _publish(
    root: Path,
    model_id: str,
    layout: Layout,
    staging: Path,
    revision: str | None,
    replace: bool,
) -> Path:
    same_content_name = layout == "hub" and revision is None
    target = root / model_id  # refined below; names the snapshot in errors
    try:
        _make_readable(staging)
        if same_content_name:
            revision = content_revision(staging)
        target = snapshot_path_for(root, model_id, layout, revision)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() and same_content_name and not replace:
            pass  # named by content hash: the same files are already there; only the ref may lag
        elif target.exists():
            if not replace:
                raise ModelError(f"{target}: already exists (use --force to replace it)")
            # Move the old copy aside first so the new one appears with a single rename.
            old = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root)) / "old"
            target.rename(old)
            staging.rename(target)
            shutil.rmtree(old.parent, ignore_errors=True)
        else:
            staging.rename(target)
        if layout == "hub":
            _write_ref(root / hub_folder_name(model_id), revision)
    except OSError as exc:
        raise ModelError(f"{target}: cannot publish snapshot ({exc.strerror or exc})") from exc
    logger.info("published %s (%s layout) at %s", model_id, layout, target)
    return target


def _make_readable(folder: Path) -> None:
    # mkdtemp (and some writers) create owner-only modes; a snapshot is shared read-only data.
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _write_ref(repo_dir: Path, revision: str | None) -> None:
    ref = repo_dir / "refs" / HUB_REF
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{HUB_REF}.tmp")
    tmp.write_text(revision or "")
    tmp.replace(ref)  # atomic: readers see the old or the new revision, never half

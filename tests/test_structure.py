"""The layout's rules (docs/adr/0013), checked on the source: module and folder sizes, imports
flowing one way, and a tracker that runs without torch or the node package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "packages" / p / "src" for p in ("common", "node", "tracker")]
MAX_LINES = 500  # a module does one job; a folder holds one concept, however many modules


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every source module of the three packages."""
    found = {}
    for src in SOURCES:
        for path in src.rglob("*.py"):
            if "egg-info" in str(path):
                continue
            parts = path.relative_to(src).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(path: Path) -> set[str]:
    """Every module an import statement in ``path`` names, at any depth (lazy ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_module_over_500_lines():
    too_long = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long


def _importers(prefix: str) -> dict[str, set[str]]:
    return {name: imports_of(path) for name, path in modules().items() if name.startswith(prefix)}


def test_imports_flow_one_way():
    def offenders(prefix: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()):
        return {
            name: sorted(i for i in imported if i.startswith(forbidden))
            for name, imported in _importers(prefix).items()
            if name not in allowed and any(i.startswith(forbidden) for i in imported)
        }

    # common depends on neither service; the tracker only through its tracker-node module
    assert offenders("meshnet_common", ("meshnet_node", "meshnet_tracker")) == {}
    assert offenders("meshnet_tracker", ("meshnet_node",), ("meshnet_tracker.tracker_node",)) == {}
    # the engine is torch only: no web, no data plane, head or swarm
    web = ("fastapi", "starlette", "uvicorn", "httpx", "websockets", "meshnet_common.web")
    upper = ("meshnet_node.dataplane", "meshnet_node.head", "meshnet_node.swarm")
    assert offenders("meshnet_node.engine", (*web, *upper, "meshnet_node.runtime")) == {}
    # the data plane never reaches up into the head or the swarm
    assert offenders("meshnet_node.dataplane", ("meshnet_node.head", "meshnet_node.swarm")) == {}


def _runtime_imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports when it runs: every import
    statement at any depth (inside functions too), but none under ``if TYPE_CHECKING:``
    (annotations only). ``from package import module`` names the module itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    resolved = set()
    for module in found:
        while module and module not in known:  # a name inside a module: the module
            module = module.rpartition(".")[0]
        if module and module != name:
            resolved.add(module)
    return resolved


def import_cycles() -> list[list[str]]:
    """Every set of project modules that import each other, directly or around a longer
    loop (the strongly connected components of the import graph with more than one)."""
    known = modules()
    graph = {name: _runtime_imports(name, path, known) for name, path in known.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def connect(module: str) -> None:  # Tarjan's algorithm
        order[module] = low[module] = len(order)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in order:
                connect(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], order[imported])
        if low[module] == order[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            connect(module)
    return sorted(cycles)


# Cycles being removed right now (issue 37), allowed until they are gone: none left today.
KNOWN_CYCLES: list[list[str]] = []


def test_no_modules_import_each_other():
    """A module never imports one that imports it back, directly or through others: each
    pair of parts has one direction (a part that needs to call back gets a callable or
    an object at construction instead)."""
    assert [c for c in import_cycles() if c not in KNOWN_CYCLES] == []


def test_a_plain_tracker_imports_no_torch_and_no_node():
    code = (
        "import sys\n"
        "import meshnet_tracker.cli, meshnet_tracker.app, meshnet_tracker.api.public\n"
        "meshnet_tracker.cli.build_parser().format_help()\n"
        "heavy = ('torch', 'transformers', 'meshnet_node', 'bitsandbytes')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_tracker_node_without_the_node_package_is_one_clear_line(models_dir, tiny_snapshot):
    tiny_snapshot("llama")
    code = (
        "import sys\n"
        "sys.modules['meshnet_node'] = None  # as if meshnet-tracker[node] were not installed\n"
        "from meshnet_tracker.cli import main\n"
        f"main(['--models-dir', {str(models_dir)!r}, '--port', '0', '--model-id',"
        " 'meshnet-tiny/llama', '--shard-start', '0', '--shard-end', '6'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1, out.stderr
    assert len(lines) == 1 and "pip install 'meshnet-tracker[node]'" in lines[0], out.stderr


@pytest.mark.integration
def test_a_running_plain_tracker_maps_no_libtorch(swarm_factory, tiny_snapshot):
    tiny_snapshot("llama")
    tracker = swarm_factory().tracker().wait_healthy()
    assert httpx.get(f"{tracker.url}/v1/coverage").status_code == 200
    pid = tracker.popen.pid
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
    assert rss_kib < 150 * 1024, f"{rss_kib / 1024:.0f} MiB"


def _data_type(base: type) -> bool:
    """What a project class may extend: a data type (pydantic model or settings, dataclass,
    NamedTuple, Enum), a Protocol or an error."""
    import dataclasses
    import enum

    from pydantic import BaseModel

    return (
        getattr(base, "_is_protocol", False)
        or issubclass(base, (BaseException, BaseModel, tuple, enum.Enum))
        or dataclasses.is_dataclass(base)
    )


def test_no_class_extends_another_plain_project_class():
    """Jobs are composed, not glued by inheritance (issue #37): a project class extends
    library classes, Protocols, errors and data types only."""
    import importlib
    import inspect

    offenders = []
    for name in sorted(modules()):
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional extra missing here (e.g. the CUDA kernels)
            continue
        for cls_name, cls in vars(module).items():
            if not inspect.isclass(cls) or cls.__module__ != name:
                continue
            for base in cls.__bases__:
                if base.__module__.startswith("meshnet_") and not _data_type(base):
                    offenders.append(f"{name}.{cls_name}({base.__module__}.{base.__name__})")
    assert offenders == [], offenders

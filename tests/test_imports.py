"""The house has no import loops: every module of multiwrite and multiwrite.backends, in dependency order.

The graph is read from the source with `ast`, so an import inside a function (a lazy import, which only a
run through that function would trip over) counts like one at the top of the file; imports under
`if TYPE_CHECKING:` never run and are left out. `from package import name` is an edge to the submodule
`package.name` where that is a module, else to the package's `__init__`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where each package's source lives (backends/ is installed as multiwrite.backends, see pyproject.toml).
PACKAGES = {"multiwrite": ROOT / "multiwrite", "multiwrite.backends": ROOT / "backends"}


def _modules() -> dict[str, Path]:
    """Module name -> source file, for every .py file of multiwrite (subpackages included) and backends/."""
    out: dict[str, Path] = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if package == "multiwrite" and name.startswith("multiwrite.backends"):
                continue
            out[name] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _extensions() -> set[str]:
    """Compiled modules of ours (`multiwrite/_cstaging.c` -> `multiwrite._cstaging`): leaves of the graph."""
    return {f"{package}.{c.stem}" for package, root in PACKAGES.items() for c in root.glob("*.c")}


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere in its source)."""
    modules = _modules()
    extensions = _extensions()
    known = set(modules) | extensions
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skip = _type_checking_lines(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
                ]
            for target in targets:
                if any(target == e or target.startswith(e + ".") for e in extensions):
                    continue
                while target and target not in modules:  # `import multiwrite.x.y` where y is no module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def test_the_graph_sees_every_module_and_lazy_imports():
    graph = import_graph()
    assert {"multiwrite", "multiwrite.cli", "multiwrite.bench.command", "multiwrite.backends.triton_cuda"} <= set(graph)
    assert "multiwrite.bench.command" in graph["multiwrite.cli"]  # imported inside a function of cli.py
    assert "multiwrite.staging" in graph["multiwrite.backends.torch_cpu"]


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        return list(exc.args[1])
    return None


def test_find_cycle_reports_a_loop():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    cycle = _find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_module_imports_in_dependency_order():
    """Lowest first, each module imports on its own terms in a fresh interpreter (C helper and Triton
    modules included where they are built or installed; an ImportError of an optional one is allowed)."""
    graph = import_graph()
    order = [m for m in TopologicalSorter(graph).static_order() if not m.endswith(".__main__")]  # runs the CLI
    code = (
        "import importlib, sys\n"
        f"for name in {order!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        print('optional', name, exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]

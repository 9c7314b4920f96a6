"""The package's imports: no loops, every module imports on its own, the layers import only downwards, and the light
entry points stay light (`import multiwrite` loads no heavy dependency; the command line's modules import only the
standard library and `multiwrite.cli.args` at their top).

The graph is read from the source with `ast`, so an import inside a function (a lazy import, which only a run through
that function would trip over) counts like one at the top of the file; imports under `if TYPE_CHECKING:` never run and
are left out. `from package import name` is an edge to the submodule `package.name` where that is a module, else to the
package's `__init__`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Where each package's source lives (backends/ is installed as multiwrite.backends, see pyproject.toml).
PACKAGES = {"multiwrite": REPO / "multiwrite", "multiwrite.backends": REPO / "backends"}
#: What `import multiwrite` must not load: the dependencies that take seconds to import.
HEAVY = ("torch", "numpy", "triton", "matplotlib", "pytest", "hypothesis")


@dataclass
class ModuleImports:
    """What one module imports: `ours` anywhere (lazy imports included), `ours_top` at its top level (what importing
    it runs), `external_top` the top-level package names of everything else it imports at its top level."""

    ours: set[str] = field(default_factory=set)
    ours_top: set[str] = field(default_factory=set)
    external_top: set[str] = field(default_factory=set)


def _modules() -> dict[str, Path]:
    """Module name -> source file, for every .py file of multiwrite (subpackages included) and backends/."""
    out: dict[str, Path] = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _extensions() -> set[str]:
    """Compiled modules of ours: each .c file that defines a module's init function (`multiwrite/staging/_cstaging.c`
    -> `multiwrite.staging._cstaging`; the files it is built with besides, `_cstaging_*.c`, define none): leaves."""
    return {
        ".".join([package, *c.relative_to(root).with_suffix("").parts])
        for package, root in PACKAGES.items()
        for c in root.rglob("*.c")
        if re.search(r"^PyMODINIT_FUNC\s+PyInit_", c.read_text(encoding="utf-8"), re.M)
    }


def _skipped_and_nested(tree: ast.AST) -> tuple[set[int], set[int]]:
    """(ids of nodes under `if TYPE_CHECKING:`, ids of nodes inside a function body)."""
    skipped: set[int] = set()
    nested: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            nested.update(id(n) for n in ast.walk(node) if n is not node)
    return skipped, nested


@cache
def import_graph() -> dict[str, ModuleImports]:
    """Module -> what it imports (see `ModuleImports`)."""
    modules = _modules()
    extensions = _extensions()
    known = set(modules) | extensions
    graph = {name: ModuleImports() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skipped, nested = _skipped_and_nested(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skipped or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            top = id(node) not in nested
            for target in targets:
                if target.split(".")[0] != "multiwrite":
                    if top:
                        graph[name].external_top.add(target.split(".")[0])
                    continue
                if target in extensions:
                    continue
                while target and target not in modules:  # `import multiwrite.x.y` where y is no module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].ours.add(target)
                    if top:
                        graph[name].ours_top.add(target)
    return graph


def _edges(graph: dict[str, ModuleImports]) -> dict[str, set[str]]:
    return {name: set(imports.ours) for name, imports in graph.items()}


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    try:
        list(TopologicalSorter(edges).static_order())
    except CycleError as exc:
        return list(exc.args[1])
    return None


def test_the_graph_sees_every_module_lazy_imports_and_the_compiled_helper():
    graph = import_graph()
    assert {"multiwrite", "multiwrite.cli", "multiwrite.cli.bench", "multiwrite.backends.triton.kernels.apply",
            "multiwrite.staging.block_ids", "multiwrite.testing.plugin"} <= set(graph)  # fmt: skip
    assert _extensions() == {"multiwrite.staging._cstaging"}
    # imported inside a function of multiwrite/cli/__init__.py, never at its top
    assert "multiwrite.cli.bench" in graph["multiwrite.cli"].ours
    assert "multiwrite.cli.bench" not in graph["multiwrite.cli"].ours_top
    # a relative-free absolute import of a subpackage's module, and a TYPE_CHECKING-only import left out
    assert "multiwrite.plugins.backend" in graph["multiwrite.backends.torch_cpu"].ours
    assert "multiwrite.tables.block_tables" not in graph["multiwrite"].ours  # only under TYPE_CHECKING there
    # the cycle finder itself finds a loop and accepts a DAG
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    cycle = _find_cycle(_edges(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _runs_clean(code: str) -> None:
    """Run `code` in a fresh interpreter in the repository: it must exit 0 (else the end of its stderr is shown)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_module_imports_on_its_own_in_dependency_order():
    """Lowest first, each module imports in a fresh interpreter (the C helper and the Triton modules included where
    they are built or installed; an ImportError of an optional one is allowed and printed)."""
    order = [m for m in TopologicalSorter(_edges(import_graph())).static_order() if not m.endswith(".__main__")]
    code = (
        "import importlib\n"
        f"for name in {order!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        print('optional', name, exc)\n"
    )
    _runs_clean(code)


def test_importing_multiwrite_loads_no_heavy_dependency_and_every_public_name_resolves():
    code = (
        "import sys\n"
        "import multiwrite\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "names = {n: getattr(multiwrite, n) for n in multiwrite.__all__}\n"
        "assert 'torch' in sys.modules and set(multiwrite.__all__) <= set(dir(multiwrite))\n"
        "from multiwrite.tables.block_tables import BlockTables\n"
        "assert names['BlockTables'] is BlockTables and multiwrite.BlockTables is BlockTables\n"
        "try:\n"
        "    multiwrite.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('multiwrite.no_such_name resolved')\n"
    )
    _runs_clean(code)


def _library() -> set[str]:
    """The library: everything but the command line, the bench and the conformance kit."""
    upper = ("multiwrite.cli", "multiwrite.bench", "multiwrite.testing", "multiwrite.__main__")
    return {m for m in import_graph() if not any(m == u or m.startswith(u + ".") for u in upper)}


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


#: The library's floors, lowest first: a module imports only modules of its own package and of lower floors. The
#: backends sit beside the writer and the tables: they build on the plugin contract only (the host finds them through
#: their entry points, never by import), and each built-in backend is a package or module of its own.
FLOORS = [
    ("multiwrite._deprecated",),
    ("multiwrite.errors", "multiwrite.env_switch"),  # (leaves: they import nothing of ours)
    ("multiwrite.capture",),
    ("multiwrite.staging",),
    ("multiwrite.stage",),
    ("multiwrite.plugins",),
    ("multiwrite.writer", "multiwrite.tables", "multiwrite.backends", "multiwrite.device_writes"),
]


def _own(module: str) -> str:
    """The package a module belongs to for the floors: `multiwrite.backends.<name>` for a backend."""
    parts = module.split(".")
    return ".".join(parts[:3]) if module.startswith("multiwrite.backends.") else ".".join(parts[:2])


@pytest.mark.parametrize("floor", range(len(FLOORS)), ids=[", ".join(f) for f in FLOORS])
def test_each_floor_of_the_library_imports_only_lower_floors(floor):
    graph = import_graph()
    lower = [p for f in FLOORS[:floor] for p in f]
    modules = [m for m in graph if _under(m, *FLOORS[floor])]
    assert modules
    bad = {m: sorted(t for t in graph[m].ours if not (_under(t, *lower) or _own(t) == _own(m))) for m in modules}
    assert not {m: t for m, t in bad.items() if t}


def test_the_reference_shares_no_code_with_what_it_checks():
    """The oracle (`multiwrite.reference`) imports nothing of the implementation it is compared with."""
    assert import_graph()["multiwrite.reference"].ours <= {"multiwrite.errors"}


def test_the_command_lines_shared_floor_imports_nothing_of_ours():
    assert import_graph()["multiwrite.cli.args"].ours == {"multiwrite.cli.exit_codes"}  # (constants, no imports)
    assert import_graph()["multiwrite.cli.exit_codes"].ours == set()


def test_the_library_never_imports_the_command_line_the_bench_or_the_kit():
    graph = import_graph()
    bad = {
        m: sorted(t for t in graph[m].ours if _under(t, "multiwrite.cli", "multiwrite.bench", "multiwrite.testing"))
        for m in _library()
    }
    assert not {m: t for m, t in bad.items() if t}


def test_the_command_lines_modules_import_only_the_standard_library_and_args_at_their_top():
    """`import multiwrite.cli` (and each subcommand's module) runs nothing heavy: torch, numpy and the library load
    when a subcommand runs (multiwrite/cli/__init__.py)."""
    graph = import_graph()
    cli = [m for m in graph if _under(m, "multiwrite.cli") and not m.endswith(".__main__")]
    assert {"multiwrite.cli", "multiwrite.cli.args", "multiwrite.cli.replay", "multiwrite.cli.bench"} <= set(cli)
    stdlib = sys.stdlib_module_names | {"__future__"}
    for m in cli:
        assert graph[m].ours_top <= {"multiwrite.cli.args", "multiwrite.cli.exit_codes"}, (m, graph[m].ours_top)
        assert graph[m].external_top <= stdlib, (m, graph[m].external_top - stdlib)

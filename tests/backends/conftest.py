"""The Triton components' tests (`test_triton_*.py`) run the kernels through Triton's interpreter on CPU tables, or
check host logic: where Triton is missing they are not collected; where the interpreter is off (a GPU machine) they
are skipped, but for the compile tests, which compile in a worker process of their own."""

from __future__ import annotations

from pathlib import Path

from tests.support.interpreter import skip_off_interpreter, triton_importable

_HERE = Path(__file__).resolve().parent
collect_ignore_glob = [] if triton_importable() else ["test_triton_*.py"]


def _interpreted(path: Path) -> bool:
    return path.parent == _HERE and path.name.startswith("test_triton_") and path.name != "test_triton_compile.py"


def pytest_collection_modifyitems(config, items) -> None:
    skip_off_interpreter(items, _interpreted, "these run the kernels on CPU tables")

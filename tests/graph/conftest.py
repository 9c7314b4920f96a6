"""The graph room drives graph mode on CPU tables: the Triton kernels through Triton's interpreter, captures simulated
(`multiwrite.capture.simulated_capture`). Where Triton is missing its tests are not collected; where the interpreter
is off (a GPU machine: real captures run in tests/gpu) they are skipped."""

from __future__ import annotations

from pathlib import Path

from tests.support.interpreter import skip_off_interpreter, triton_importable

_HERE = Path(__file__).resolve().parent
collect_ignore_glob = [] if triton_importable() else ["test_*.py"]


def pytest_collection_modifyitems(config, items) -> None:
    skip_off_interpreter(items, lambda path: _HERE in path.parents, "graph mode on a GPU is tests/gpu's")

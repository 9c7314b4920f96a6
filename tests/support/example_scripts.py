"""The example scripts of `examples/`, imported as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"


def load_example(name: str, module_name: str) -> ModuleType:
    """`examples/<name>.py` imported as the module `module_name` (registered in `sys.modules`, as dataclasses need)."""
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module

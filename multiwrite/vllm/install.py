"""Put `multiwrite.vllm.BlockTables` in place of vLLM's own in vLLM 0.33's v2 model runner.

vLLM's runner builds its tables with the `BlockTables` its module `vllm.v1.worker.gpu.model_runner` imported from
`vllm.v1.worker.gpu.block_table`. `install()` rebinds that name in `block_table` (so modules imported later get
multiwrite's class) and in every `vllm` module already imported that holds vLLM's class (the runner among them),
after checking that vLLM's class has the signature multiwrite's implements: the constructor's parameter names,
order, kinds and defaults and the parameter names of its public methods (not vLLM's version string: a later vLLM
with the same class is accepted, one that changed it is refused). Setting `MULTIWRITE_VLLM=1` makes vLLM call it at
start-up in each of its processes (the `vllm.general_plugins` entry point, `multiwrite.vllm.plugin`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from typing import Any

__all__ = ["UnsupportedVllmError", "install", "signature_differences", "uninstall"]

logger = logging.getLogger("multiwrite.vllm")

#: The module defining vLLM's class, and the one whose global the runner's constructor call resolves.
BLOCK_TABLE_MODULE = "vllm.v1.worker.gpu.block_table"
MODEL_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
OURS_MODULE = "multiwrite.vllm.block_tables"

_REQUIRED = inspect.Parameter.empty
_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD

#: vLLM 0.33's `BlockTables.__init__` after `self`: (name, default or `_REQUIRED`), all positional-or-keyword.
CONSTRUCTOR: tuple[tuple[str, Any], ...] = (
    ("block_sizes", _REQUIRED),
    ("max_num_reqs", _REQUIRED),
    ("max_num_batched_tokens", _REQUIRED),
    ("max_num_blocks_per_group", _REQUIRED),
    ("device", _REQUIRED),
    ("cp_size", 1),
    ("cp_rank", 0),
    ("cp_interleave", 1),
    ("slot_mapping_enabled", None),
    ("dcp_sharded", None),
    ("sliding_window_reach", None),
)

#: Its public methods and their parameter names after `self`.
METHODS: dict[str, tuple[str, ...]] = {
    "init_block_table_layout_tensors": (),
    "append_block_ids": ("req_index", "new_block_ids", "overwrite"),
    "apply_staged_writes": (),
    "gather_block_tables": ("idx_mapping", "num_reqs_padded", "out", "out_ptrs", "num_computed_tokens"),
    "get_dummy_block_tables": ("num_reqs",),
    "compute_slot_mappings": ("idx_mapping", "query_start_loc", "positions", "num_tokens_padded", "out"),
    "get_dummy_slot_mappings": ("num_tokens",),
}

_original: type | None = None  # vLLM's class, once `install()` replaced it


class UnsupportedVllmError(RuntimeError):
    """vLLM's `BlockTables` is missing or not the one multiwrite's class replaces; the message names each
    difference (parameter or method, expected and found). Nothing was replaced."""


def _default(value: Any) -> str:
    return "no default (required)" if value is _REQUIRED else f"default {value!r}"


def _params(func: Any) -> list[inspect.Parameter] | None:
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[1:]  # self


def signature_differences(cls: Any, extra_keyword_only: tuple[str, ...] = ()) -> list[str]:
    """How `cls` differs from vLLM 0.33's `BlockTables` (an empty list when it does not): each entry names the
    parameter or method, what 0.33 has and what `cls` has. Keyword-only parameters named in `extra_keyword_only`
    are allowed after 0.33's (multiwrite's own class has some)."""
    if not isinstance(cls, type):
        return [f"BlockTables is {cls!r}, not a class"]
    diffs: list[str] = []
    found = _params(cls.__init__)
    if found is None:
        return ["BlockTables.__init__ has no inspectable signature"]
    found = [p for p in found if not (p.kind is inspect.Parameter.KEYWORD_ONLY and p.name in extra_keyword_only)]
    expected_names = [name for name, _ in CONSTRUCTOR]
    found_names = [p.name for p in found]
    missing = [n for n in expected_names if n not in found_names]
    extra = [n for n in found_names if n not in expected_names]
    where = "BlockTables.__init__"
    if len(missing) == 1 and len(extra) == 1 and expected_names.index(missing[0]) == found_names.index(extra[0]):
        i = expected_names.index(missing[0])
        diffs.append(f"{where}: parameter {i + 1} is named {extra[0]!r}, expected {missing[0]!r}")
    else:
        diffs += [
            f"{where}: lacks parameter {n!r} (expected at position {expected_names.index(n) + 1})" for n in missing
        ]
        diffs += [f"{where}: unexpected parameter {n!r} at position {found_names.index(n) + 1}" for n in extra]
        common_expected = [n for n in expected_names if n in found_names]
        common_found = [n for n in found_names if n in expected_names]
        if common_expected != common_found:
            diffs.append(
                f"{where}: parameters in the order ({', '.join(common_found)}), expected ({', '.join(common_expected)})"
            )
    by_name = {p.name: p for p in found}
    for name, default in CONSTRUCTOR:
        p = by_name.get(name)
        if p is None:
            continue
        if p.kind is not _POSITIONAL:
            diffs.append(f"{where}: parameter {name!r} is {p.kind.description}, expected positional or keyword")
        if not (p.default is default or (type(p.default) is type(default) and p.default == default)):
            diffs.append(f"{where}: parameter {name!r} has {_default(p.default)}, expected {_default(default)}")
    for method, names in METHODS.items():
        func = inspect.getattr_static(cls, method, None)
        if func is None or not callable(getattr(cls, method, None)):
            diffs.append(f"BlockTables lacks method {method!r}({', '.join(names)})")
            continue
        params = _params(getattr(cls, method))
        got = None if params is None else tuple(p.name for p in params)
        if got != names:
            shown = "an uninspectable signature" if got is None else f"({', '.join(got)})"
            diffs.append(f"BlockTables.{method} takes {shown}, expected ({', '.join(names)})")
    return diffs


def _ours_if_loaded() -> type | None:
    module = sys.modules.get(OURS_MODULE)
    return getattr(module, "BlockTables", None)


def _vllm_modules() -> list[tuple[str, dict]]:
    """(name, namespace) of every loaded `vllm` module (entries of `sys.modules` without a `__dict__` skipped)."""
    return [(name, vars(m)) for name, m in list(sys.modules.items())
            if name.split(".")[0] == "vllm" and isinstance(getattr(m, "__dict__", None), dict)]  # fmt: skip


def _import_failure(e: ImportError) -> str:
    """Why `BLOCK_TABLE_MODULE` did not import: vLLM absent, vLLM without that module, or vLLM present but failing
    to import (one of its own dependencies missing, or broken), the missing module named."""
    import importlib.metadata

    missing = e.name if isinstance(e, ModuleNotFoundError) else None
    if missing == "vllm":
        return f"vLLM is not installed (cannot import {BLOCK_TABLE_MODULE}: {e})"
    try:
        version = f"vLLM {importlib.metadata.version('vllm')}"
    except importlib.metadata.PackageNotFoundError:
        version = "vLLM"
    parts = BLOCK_TABLE_MODULE.split(".")
    if missing in {".".join(parts[:i]) for i in range(2, len(parts) + 1)}:
        return (f"cannot import {BLOCK_TABLE_MODULE}: {version} is installed but has no module {missing} ({e}); "
                "multiwrite.vllm needs vLLM's v2 model runner, as in vLLM 0.33")  # fmt: skip
    cause = f"module {missing!r} is missing" if missing else f"{type(e).__name__}: {e}"
    return (f"cannot import {BLOCK_TABLE_MODULE}: {version} is installed but failed to import ({cause}: a dependency "
            f"of vLLM's not installed, or a broken install; importing {BLOCK_TABLE_MODULE} yourself shows the "
            "traceback)")  # fmt: skip


def install() -> list[str]:
    """Replace vLLM's `BlockTables` with `multiwrite.vllm.BlockTables` in `vllm.v1.worker.gpu.block_table` and in
    every `vllm` module already imported that holds vLLM's class (`vllm.v1.worker.gpu.model_runner` among them).

    Returns the names of the modules rebound (none when multiwrite's class is already in place: calling it again is
    harmless). Raises `UnsupportedVllmError`, replacing nothing, when vLLM's block-table module cannot be imported
    (the message tells vLLM absent from vLLM present but failing to import, naming the missing module) or its class
    differs from vLLM 0.33's (the message names each difference).
    """
    global _original
    try:
        module = importlib.import_module(BLOCK_TABLE_MODULE)
    except ImportError as e:
        raise UnsupportedVllmError(f"multiwrite.vllm.install(): {_import_failure(e)}") from e
    found = getattr(module, "BlockTables", None)
    ours = _ours_if_loaded()
    if ours is not None and isinstance(found, type) and issubclass(found, ours):
        return []
    diffs = signature_differences(found)
    if diffs:
        raise UnsupportedVllmError(
            f"multiwrite.vllm.install(): {BLOCK_TABLE_MODULE}.BlockTables is not the class multiwrite.vllm.BlockTables "
            f"replaces (vLLM 0.33's), nothing was replaced: " + "; ".join(diffs)
        )
    ours = importlib.import_module(OURS_MODULE).BlockTables
    holders = [(name, ns) for name, ns in _vllm_modules() if ns.get("BlockTables") is found]  # (all found first)
    if _original is None:  # (a second install after vLLM's class was replaced keeps the first original)
        _original = found
    for _, ns in holders:
        ns["BlockTables"] = ours
    rebound = [name for name, _ in holders]
    logger.info("multiwrite.vllm: BlockTables replaced in %s", ", ".join(rebound))
    return rebound


def uninstall() -> list[str]:
    """Put vLLM's class back wherever `install()` (or a module imported after it) bound multiwrite's; returns the
    names of the modules rebound (none if `install()` replaced nothing in this process)."""
    global _original
    ours = _ours_if_loaded()
    if _original is None or ours is None:
        return []
    rebound = []
    for name, ns in _vllm_modules():
        if ns.get("BlockTables") is ours:
            ns["BlockTables"] = _original
            rebound.append(name)
    _original = None
    return rebound

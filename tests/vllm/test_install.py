"""`multiwrite.vllm.install()` and the `vllm.general_plugins` entry point, against stand-in `vllm` module trees (no
vLLM needed): vLLM 0.33's class signature is accepted and rebound everywhere it is bound; classes that differ are
refused with the difference named and every module left as it was. With the oracle (`tox -e vllm`), vLLM's real
class passes the same check."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from multiwrite.vllm.plugin import register

install_mod = importlib.import_module("multiwrite.vllm.install")
install, uninstall = install_mod.install, install_mod.uninstall
UnsupportedVllmError = install_mod.UnsupportedVllmError
signature_differences = install_mod.signature_differences

INIT = (
    "block_sizes, max_num_reqs, max_num_batched_tokens, max_num_blocks_per_group, device, cp_size=1, cp_rank=0, "
    "cp_interleave=1, slot_mapping_enabled=None, dcp_sharded=None, sliding_window_reach=None"
)
METHODS = {
    "init_block_table_layout_tensors": "",
    "append_block_ids": "req_index, new_block_ids, overwrite",
    "apply_staged_writes": "",
    "gather_block_tables": "idx_mapping, num_reqs_padded, out=None, out_ptrs=None, num_computed_tokens=None",
    "get_dummy_block_tables": "num_reqs",
    "compute_slot_mappings": "idx_mapping, query_start_loc, positions, num_tokens_padded, out=None",
    "get_dummy_slot_mappings": "num_tokens",
}


def stand_in_class(init: str = INIT, methods: dict[str, str] | None = None) -> type:
    """A class shaped like vLLM's `BlockTables` with the given constructor and method parameters (`None`: absent)."""
    methods = {**METHODS, **(methods or {})}
    lines = ["class BlockTables:", "    redirect_writes_to_null_block = False", f"    def __init__(self, {init}): pass"]
    for name, params in methods.items():
        if params is not None:
            lines.append(f"    def {name}(self{', ' if params else ''}{params}): pass")
    ns: dict = {}
    exec("\n".join(lines), ns)
    return ns["BlockTables"]


@pytest.fixture
def vllm_tree(monkeypatch):
    """`tree(cls, runner=True)`: stand-in `vllm` packages in `sys.modules` whose `block_table` module defines `cls`,
    bound also by `model_runner` (when `runner`) and `cudagraph_utils`; `gpu.other` binds an unrelated name."""

    def tree(cls: type, runner: bool = True) -> dict[str, types.ModuleType]:
        names = ["vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu"]
        mods = {}
        for name in names:
            m = types.ModuleType(name)
            m.__path__ = []
            mods[name] = m
        for leaf, binds in (("block_table", True), ("model_runner", runner), ("cudagraph_utils", True), ("other", 0)):
            if leaf == "model_runner" and not runner:
                continue
            m = types.ModuleType(f"vllm.v1.worker.gpu.{leaf}")
            m.BlockTables = cls if binds else object
            mods[m.__name__] = m
        for name, m in mods.items():
            monkeypatch.setitem(sys.modules, name, m)
            parent, _, leaf = name.rpartition(".")
            if parent:
                setattr(mods[parent], leaf, m)
        return mods

    yield tree
    uninstall()


def ours() -> type:
    from multiwrite.vllm import BlockTables

    return BlockTables


def test_vllm_033_class_is_accepted_and_rebound_where_bound(vllm_tree):
    original = stand_in_class()
    mods = vllm_tree(original)
    rebound = install()
    assert sorted(rebound) == [
        "vllm.v1.worker.gpu.block_table",
        "vllm.v1.worker.gpu.cudagraph_utils",
        "vllm.v1.worker.gpu.model_runner",
    ]
    for name in rebound:
        assert mods[name].BlockTables is ours()
    assert mods["vllm.v1.worker.gpu.other"].BlockTables is object
    # idempotent: our own class is not replaced again
    assert install() == []
    assert mods["vllm.v1.worker.gpu.model_runner"].BlockTables is ours()
    assert sorted(uninstall()) == sorted(rebound)
    assert all(mods[name].BlockTables is original for name in rebound)
    assert uninstall() == []


def test_an_entry_of_sys_modules_without_a_namespace_is_passed_over_and_uninstall_restores_all(vllm_tree, monkeypatch):
    """Found by review: an object without `__dict__` under a `vllm.*` name made install() fail halfway, with modules
    rebound and nothing for uninstall() to restore."""

    class Slotted:
        __slots__ = ()

    original = stand_in_class()
    mods = vllm_tree(original)
    monkeypatch.setitem(sys.modules, "vllm.aaa_not_a_module", Slotted())
    assert "vllm.v1.worker.gpu.model_runner" in install()
    assert sorted(uninstall()) == [
        "vllm.v1.worker.gpu.block_table",
        "vllm.v1.worker.gpu.cudagraph_utils",
        "vllm.v1.worker.gpu.model_runner",
    ]
    assert mods["vllm.v1.worker.gpu.model_runner"].BlockTables is original


def test_a_runner_imported_after_install_gets_ours(vllm_tree):
    mods = vllm_tree(stand_in_class(), runner=False)
    assert install() == ["vllm.v1.worker.gpu.block_table", "vllm.v1.worker.gpu.cudagraph_utils"]
    runner = types.ModuleType("vllm.v1.worker.gpu.model_runner")
    exec("from vllm.v1.worker.gpu.block_table import BlockTables", runner.__dict__)  # what the runner's import does
    assert runner.BlockTables is ours()
    assert mods["vllm.v1.worker.gpu.block_table"].BlockTables is ours()


def test_multiwrite_class_has_the_033_signature_plus_keyword_only_extras():
    params = inspect.signature(ours().__init__).parameters.values()
    extras = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert {"backend": None, "cuda_graphs": False}.items() <= extras.items()
    assert inspect.Parameter.empty not in extras.values()  # vLLM's runner passes none of them
    assert signature_differences(ours(), extra_keyword_only=tuple(extras)) == []
    assert ours().redirect_writes_to_null_block is False


#: Classes that differ from vLLM 0.33's: the stand-in's `__init__` parameters, its changed methods, and what the
#: refusal must name.
# fmt: off
REFUSED = [
    pytest.param(INIT.replace("max_num_batched_tokens", "max_num_tokens"), {},
                 ["parameter 3 is named 'max_num_tokens', expected 'max_num_batched_tokens'"], id="renamed"),
    pytest.param(INIT.replace("cp_size=1, cp_rank=0", "cp_rank=0, cp_size=1"), {},
                 ["parameters in the order", "cp_rank, cp_size", "expected", "cp_size, cp_rank"], id="reordered"),
    pytest.param(INIT + ", kv_cache_dtype=None", {}, ["unexpected parameter 'kv_cache_dtype' at position 12"],
                 id="extra"),
    pytest.param(INIT + ", *, pin_memory=False", {}, ["unexpected parameter 'pin_memory' at position 12"],
                 id="extra-keyword-only"),
    pytest.param(INIT.replace(", sliding_window_reach=None", ""), {},
                 ["lacks parameter 'sliding_window_reach' (expected at position 11)"], id="missing"),
    pytest.param(INIT.replace("cp_interleave=1", "cp_interleave=2"), {},
                 ["parameter 'cp_interleave' has default 2, expected default 1"], id="changed-default"),
    pytest.param(INIT.replace("device,", "device=None,"), {},
                 ["parameter 'device' has default None, expected no default (required)"], id="new-default"),
    pytest.param(INIT.replace("cp_size=1", "cp_size=True"), {},
                 ["parameter 'cp_size' has default True, expected default 1"], id="default-of-another-type"),
    pytest.param(INIT.replace("None, sliding_window_reach", "None, *, sliding_window_reach"), {},
                 ["parameter 'sliding_window_reach' is keyword-only, expected positional or keyword"],
                 id="keyword-only"),
    pytest.param(INIT, {"get_dummy_slot_mappings": None},
                 ["BlockTables lacks method 'get_dummy_slot_mappings'(num_tokens)"], id="missing-method"),
    pytest.param(INIT, {"gather_block_tables": "idx_mapping, num_reqs_padded, out=None, out_ptrs=None"},
                 ["BlockTables.gather_block_tables takes (idx_mapping, num_reqs_padded, out, out_ptrs), expected "
                  "(idx_mapping, num_reqs_padded, out, out_ptrs, num_computed_tokens)"], id="method-parameter-missing"),
    pytest.param(INIT, {"append_block_ids": "req_index, block_ids, overwrite"},
                 ["BlockTables.append_block_ids takes (req_index, block_ids, overwrite)"],
                 id="method-parameter-renamed"),
]
# fmt: on


@pytest.mark.parametrize("init, methods, phrases", REFUSED)
def test_a_different_class_is_refused_naming_the_difference(vllm_tree, init, methods, phrases):
    cls = stand_in_class(init, methods)
    mods = vllm_tree(cls)
    before = {name: m.__dict__.get("BlockTables") for name, m in mods.items()}
    with pytest.raises(UnsupportedVllmError) as e:
        install()
    msg = str(e.value)
    assert "nothing was replaced" in msg
    for phrase in phrases:
        assert phrase in msg
    assert {name: m.__dict__.get("BlockTables") for name, m in mods.items()} == before
    assert len(signature_differences(cls)) == 1


def test_differences_are_all_listed():
    cls = stand_in_class(INIT.replace("cp_rank=0", "cp_rank=1") + ", extra=0", {"apply_staged_writes": None})
    assert signature_differences(cls) == [
        "BlockTables.__init__: unexpected parameter 'extra' at position 12",
        "BlockTables.__init__: parameter 'cp_rank' has default 1, expected default 0",
        "BlockTables lacks method 'apply_staged_writes'()",
    ]


def test_not_a_class_and_no_vllm_are_refused(vllm_tree, monkeypatch):
    mods = vllm_tree(stand_in_class())
    monkeypatch.setattr(mods["vllm.v1.worker.gpu.block_table"], "BlockTables", None)
    with pytest.raises(UnsupportedVllmError, match=r"BlockTables is None, not a class"):
        install()
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.block_table", None)  # import fails
    with pytest.raises(UnsupportedVllmError, match=r"cannot import vllm\.v1\.worker\.gpu\.block_table"):
        install()
    assert mods["vllm.v1.worker.gpu.model_runner"].BlockTables is not ours()


def test_no_vllm_is_told_from_a_vllm_that_fails_to_import(vllm_tree, monkeypatch, tmp_path):
    """Only `vllm` itself missing means "not installed"; vLLM present whose block-table module imports a missing
    module (one of vLLM's dependencies) or fails otherwise is named as such, the missing module named."""
    mods = vllm_tree(stand_in_class())
    gpu = mods["vllm.v1.worker.gpu"]
    monkeypatch.delitem(sys.modules, "vllm.v1.worker.gpu.block_table")
    monkeypatch.setattr(gpu, "__path__", [str(tmp_path)])  # block_table now imports from tmp_path
    (tmp_path / "block_table.py").write_text("import a_dependency_of_vllm_not_installed\n")
    with pytest.raises(UnsupportedVllmError) as info:
        install()
    message = str(info.value)
    assert "vLLM is installed but failed to import (module 'a_dependency_of_vllm_not_installed' is missing" in message
    assert "not installed (" not in message and "vLLM is not installed" not in message
    (tmp_path / "block_table.py").write_text("from os import no_such_name_in_os\n")
    importlib.invalidate_caches()
    with pytest.raises(UnsupportedVllmError, match=r"is installed but failed to import \(ImportError: cannot import "
                       r"name 'no_such_name_in_os' from 'os'"):  # fmt: skip
        install()
    for name in [n for n in sys.modules if n.split(".")[0] == "vllm"]:  # no vLLM at all
        monkeypatch.delitem(sys.modules, name)
    if importlib.util.find_spec("vllm") is None:  # (where vLLM is installed for real, this part cannot run)
        with pytest.raises(UnsupportedVllmError, match=r"^multiwrite\.vllm\.install\(\): vLLM is not installed \("):
            install()
    assert mods["vllm.v1.worker.gpu.model_runner"].BlockTables is not ours()


ON_VALUES = ["1", "true", "TRUE", "Yes", "on", " on "]
OFF_VALUES = [None, "", "0", "false", "False", "no", "OFF"]


@pytest.mark.parametrize(("value", "installed"), [(v, True) for v in ON_VALUES] + [(v, False) for v in OFF_VALUES])
def test_entry_point_honours_multiwrite_vllm(vllm_tree, monkeypatch, value, installed):
    mods = vllm_tree(stand_in_class())
    if value is None:
        monkeypatch.delenv("MULTIWRITE_VLLM", raising=False)
    else:
        monkeypatch.setenv("MULTIWRITE_VLLM", value)
    register()
    assert (mods["vllm.v1.worker.gpu.model_runner"].BlockTables is ours()) is installed


@pytest.mark.parametrize("value", ["2", "enable", "y", "true1", "-1"])
def test_entry_point_refuses_a_value_that_is_neither_on_nor_off_naming_it_and_the_words(vllm_tree, monkeypatch, value):
    mods = vllm_tree(stand_in_class())
    monkeypatch.setenv("MULTIWRITE_VLLM", value)
    with pytest.raises(ValueError) as info:
        register()
    assert str(info.value).startswith(f"MULTIWRITE_VLLM={value!r} is neither on (1, true, yes, on) nor off (0, false, "
                                      "no, off or empty), case-insensitive; ")  # fmt: skip
    assert all(m.BlockTables is not ours() for m in mods.values() if hasattr(m, "BlockTables"))


def test_entry_point_refuses_an_unsupported_vllm(vllm_tree, monkeypatch):
    vllm_tree(stand_in_class(INIT.replace("cp_size=1", "cp_size=2")))
    monkeypatch.setenv("MULTIWRITE_VLLM", "1")
    with pytest.raises(UnsupportedVllmError, match="'cp_size' has default 2"):
        register()


def test_entry_point_is_declared():
    """The `vllm.general_plugins` entry of pyproject.toml (read from the file: the checkout need not be installed)."""
    tomllib = pytest.importorskip("tomllib")

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"multiwrite": "multiwrite.vllm.plugin:register"}


def test_the_plugin_module_is_packaged():
    """A wheel holds `multiwrite.vllm` (setuptools lists packages explicitly), or vLLM's loading of the entry point
    fails wherever multiwrite is installed without the checkout."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    assert "multiwrite.vllm" in tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_refusal_and_plugin_import_no_torch():
    """Nothing heavy is imported by the entry point when it is off, nor by a refused install (a fresh interpreter)."""
    code = textwrap.dedent(
        """
        import os, sys, types
        for name in ["vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.block_table"]:
            m = types.ModuleType(name); m.__path__ = []; sys.modules[name] = m
        class BlockTables:
            def __init__(self, block_sizes): pass
        sys.modules["vllm.v1.worker.gpu.block_table"].BlockTables = BlockTables
        os.environ.pop("MULTIWRITE_VLLM", None)
        from multiwrite.vllm.plugin import register
        register()
        os.environ["MULTIWRITE_VLLM"] = "1"
        try:
            register()
        except RuntimeError as e:
            assert "lacks parameter 'max_num_reqs'" in str(e), e
        else:
            raise AssertionError("accepted")
        heavy = [m for m in ("torch", "triton", "numpy", "multiwrite.vllm.block_tables") if m in sys.modules]
        assert not heavy, heavy
        """
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={"PYTHONPATH": str(root)}, timeout=120)


def test_installed_distribution_declares_the_entry_point():
    """Where this checkout is installed (tox, or pip from it), vLLM finds the entry point through importlib.metadata."""
    root = Path(__file__).resolve().parents[2]
    try:
        origin = json.loads(importlib.metadata.distribution("multiwrite").read_text("direct_url.json") or "{}")
    except importlib.metadata.PackageNotFoundError:
        origin = {}
    if origin.get("url") != root.as_uri() and not os.environ.get("TOX_ENV_NAME"):  # tox installs the checkout
        pytest.skip(f"this checkout ({root}) is not the installed multiwrite (it runs from PYTHONPATH)")
    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "multiwrite"]
    assert len(eps) == 1, "multiwrite is installed without its vllm.general_plugins entry point (reinstall it)"
    assert eps[0].load() is register


def test_vllm_033_real_class_passes_the_check(oracle):
    assert signature_differences(oracle.BlockTables) == []


def test_install_on_vllm_033s_real_module(oracle, device):
    """On vLLM's own block_table module (the oracle's), with a runner module importing from it afterwards: the
    runner's keyword call (model_runner.py's initialize_kv_cache) builds multiwrite's class."""
    vllm_class = oracle.BlockTables
    with oracle.active():
        try:
            assert install() == ["vllm.v1.worker.gpu.block_table"]
            runner = types.ModuleType("vllm.v1.worker.gpu.model_runner")
            exec("from vllm.v1.worker.gpu.block_table import BlockTables", runner.__dict__)
            tables = runner.BlockTables(
                block_sizes=[16, 32],
                max_num_reqs=4,
                max_num_batched_tokens=64,
                max_num_blocks_per_group=[8, 4],
                device=device,
                slot_mapping_enabled=[True, True],
                dcp_sharded=[True, True],
                sliding_window_reach=[0, 31],
                cp_size=1,
                cp_rank=0,
                cp_interleave=1,
            )
            assert type(tables) is ours()
        finally:
            assert uninstall() == ["vllm.v1.worker.gpu.block_table"]
    assert oracle.BlockTables is vllm_class

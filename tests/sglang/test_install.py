"""`multiwrite.sglang.install()` and the `sglang.srt.plugins` entry point: on SGLang 0.5.23's own allocation module
(loaded from the wheel: `upstream`) it rebinds the extend writer and registers the decode function for cuda; on that
module's source changed (a statement, a parameter) and on stand-in modules it refuses, naming each difference, and
replaces nothing."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from multiwrite.sglang.install import UnsupportedSglangError, alloc_for_decode, install, uninstall
from multiwrite.sglang.plugin import register
from multiwrite.sglang.upstream import ALLOCATION, MEMBERS, load_upstream
from multiwrite.sglang.writes import write_cache_indices
from tests.sglang.oracle import decode_batch

install_mod = importlib.import_module("multiwrite.sglang.install")  # (the package's `install` is the function)


@pytest.fixture(autouse=True)
def _uninstalled():
    yield
    uninstall()


def test_sglang_0523s_module_passes_the_check(upstream):
    assert install_mod.signature_differences(upstream.allocation) == []


def test_install_on_sglang_0523s_module_rebinds_the_extend_writer_and_registers_cuda(upstream, auto_selection):
    """(On a CPU pool: the backend is the one dispatch picks for the CPU, whatever the forced matrix forces.)"""
    allocation = upstream.allocation
    theirs = allocation.write_cache_indices
    with upstream.active():
        assert install() == ["write_cache_indices", "ALLOC_FOR_DECODE_FUNCS['cuda']"]
        assert install() == []  # already in place
        assert allocation.write_cache_indices is write_cache_indices  # alloc_for_extend's global
        assert allocation.ALLOC_FOR_DECODE_FUNCS["cuda"] is alloc_for_decode
        assert allocation.ALLOC_FOR_DECODE_FUNCS["cpu"] is allocation.alloc_for_decode_default
        pool = upstream.pool(3, 8, "cpu")
        batch = decode_batch(pool, [2, 0], [3, 5], torch.tensor([41, 42]))
        batch.device = "cuda"  # SGLang's dispatch reads the type only: this batch takes the cuda entry
        assert allocation.alloc_for_decode(batch, 1).tolist() == [41, 42]
        assert pool.req_to_token[2, 3].item() == 41 and pool.req_to_token[0, 5].item() == 42
        assert uninstall() == ["write_cache_indices", "ALLOC_FOR_DECODE_FUNCS['cuda']"]
        assert allocation.write_cache_indices is theirs
        assert allocation.ALLOC_FOR_DECODE_FUNCS["cuda"] is allocation.alloc_for_decode_default


def _changed_source(tmp_path: Path, upstream, old: str, new: str) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in MEMBERS:
        (src / name).write_bytes((upstream.source / name).read_bytes())
    text = (src / "allocation.py").read_text()
    assert text.count(old) == 1, old
    (src / "allocation.py").write_text(text.replace(old, new))
    return src


@pytest.mark.parametrize(
    ("old", "new", "phrase"),
    [
        ("    batch.maybe_evict_swa()\n\n    seq_lens_gpu = batch.seq_lens\n",
         "    batch.maybe_evict_swa()\n    batch.touch()\n\n    seq_lens_gpu = batch.seq_lens\n",
         "alloc_for_decode_default: its statements differ from SGLang 0.5.23's"),
        ("    extend_lens_cpu: torch.Tensor,\n    prefix_tensors: list[torch.Tensor],\n    req_to_token_pool",
         "    extend_lens_cpu: torch.Tensor,\n    prefix_indices: list[torch.Tensor],\n    req_to_token_pool",
         "write_cache_indices takes (out_cache_loc, req_pool_indices_tensor, req_pool_indices_cpu, prefix_lens_tensor, "
         "prefix_lens_cpu, seq_lens_tensor, seq_lens_cpu, extend_lens_tensor, extend_lens_cpu, prefix_indices, "
         "req_to_token_pool), expected (out_cache_loc"),
        ("    token_per_req: int = 1,\n    req_pool_indices: Optional[torch.Tensor] = None,",
         "    token_per_req: int = 2,\n    req_pool_indices: Optional[torch.Tensor] = None,",
         "alloc_paged_token_slots_decode: parameter 'token_per_req' has default 2, expected default 1"),
        ("ALLOC_FOR_DECODE_FUNCS = defaultdict(lambda: alloc_for_decode_default)\n",
         "ALLOC_FOR_DECODE_FUNCS = defaultdict(lambda: alloc_for_decode_default)\n"
         "ALLOC_FOR_DECODE_FUNCS['cuda'] = alloc_token_slots\n",
         "ALLOC_FOR_DECODE_FUNCS['cuda'] is already <function alloc_token_slots"),
    ],
)
def test_a_changed_sglang_is_refused_naming_the_difference_and_nothing_replaced(tmp_path, upstream, old, new, phrase):
    changed = load_upstream(_changed_source(tmp_path, upstream, old, new))
    theirs = changed.allocation.write_cache_indices
    registered = dict(changed.allocation.ALLOC_FOR_DECODE_FUNCS)
    with changed.active(), pytest.raises(UnsupportedSglangError) as info:
        install()
    assert phrase in str(info.value)
    assert "nothing was replaced" in str(info.value)
    assert changed.allocation.write_cache_indices is theirs
    assert dict(changed.allocation.ALLOC_FOR_DECODE_FUNCS) == registered


def test_comments_and_formatting_do_not_count(tmp_path, upstream):
    old = "    batch.maybe_evict_swa()\n\n    seq_lens_gpu = batch.seq_lens\n"
    new = "    batch.maybe_evict_swa()  # a comment\n\n\n    seq_lens_gpu = (batch.seq_lens)\n"
    changed = load_upstream(_changed_source(tmp_path, upstream, old, new))
    assert install_mod.signature_differences(changed.allocation) == []


# -- without SGLang's files: stand-in modules ----------------------------------------------------------------------
@pytest.fixture
def sglang_tree(monkeypatch):
    """`tree(**functions)`: a stand-in `sglang.srt.mem_cache.allocation` in `sys.modules` holding `functions`."""

    def tree(**attrs) -> types.ModuleType:
        for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
            m = types.ModuleType(name)
            m.__path__ = []
            monkeypatch.setitem(sys.modules, name, m)
        module = types.ModuleType(ALLOCATION)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, ALLOCATION, module)
        return module

    return tree


def test_a_module_lacking_what_multiwrite_needs_is_refused_naming_each(sglang_tree):
    def write_cache_indices(out_cache_loc, req_pool_indices_tensor):
        pass

    module = sglang_tree(write_cache_indices=write_cache_indices)
    with pytest.raises(UnsupportedSglangError) as info:
        install()
    message = str(info.value)
    assert "write_cache_indices takes (out_cache_loc, req_pool_indices_tensor), expected (out_cache_loc, " in message
    for name in ("alloc_for_decode_default", "alloc_for_decode", "alloc_token_slots", "_alloc_page_size"):
        assert f"lacks function {name!r}" in message
    assert "has no ALLOC_FOR_DECODE_FUNCS registry" in message
    assert module.write_cache_indices is write_cache_indices


def test_no_sglang_is_refused_saying_so(monkeypatch):
    if importlib.util.find_spec("sglang") is not None and "sglang" not in sys.modules:
        pytest.skip("SGLang is installed here")
    for name in [n for n in sys.modules if n.split(".")[0] == "sglang"]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(UnsupportedSglangError, match="SGLang is not installed"):
        install()


def test_sglangs_default_in_the_registry_is_not_another_plugins(upstream):
    """A decode before `install()` makes SGLang's defaultdict hold its default under `cuda`: still accepted, and put
    back by `uninstall()`."""
    funcs = upstream.allocation.ALLOC_FOR_DECODE_FUNCS
    funcs["cuda"]  # noqa: B018 (the lookup inserts the default)
    with upstream.active():
        install()
        assert funcs["cuda"] is alloc_for_decode
        uninstall()
    assert funcs["cuda"] is upstream.allocation.alloc_for_decode_default


@pytest.mark.parametrize(("value", "on"), [("1", True), (" Yes ", True), ("on", True), (None, False), ("", False),
                                           ("0", False), ("off", False)])  # fmt: skip
def test_entry_point_honours_multiwrite_sglang(upstream, monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("MULTIWRITE_SGLANG", raising=False)
    else:
        monkeypatch.setenv("MULTIWRITE_SGLANG", value)
    with upstream.active():
        register()
    assert (upstream.allocation.write_cache_indices is write_cache_indices) is on


@pytest.mark.parametrize("value", ["2", "enable"])
def test_entry_point_refuses_a_value_that_is_neither_on_nor_off(monkeypatch, value):
    monkeypatch.setenv("MULTIWRITE_SGLANG", value)
    with pytest.raises(ValueError, match=f"MULTIWRITE_SGLANG={value!r} is neither on"):
        register()


def test_entry_point_is_declared_and_packaged():
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"]["sglang.srt.plugins"]
    assert declared == {"multiwrite": "multiwrite.sglang.plugin:register"}
    assert "multiwrite.sglang" in pyproject["tool"]["setuptools"]["packages"]

"""`multiwrite info` reads as one report (found by a new user, 2026-11-30): a name-collision warning used
to be printed by the warnings machinery in the middle of the backend listing; it is now a line of its own
after the listing. And the TRITON_INTERPRET hint is given only where Triton imports."""

from __future__ import annotations

import warnings

import multiwrite
from multiwrite import Backend, hookimpl
from multiwrite.info import cmd_info


class _Impostor(Backend):
    NAME = "torch-cpu"  # a built-in's name: the built-in keeps it, the plugin is listed as taken
    PRIORITY = 5
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def apply(self, batches):
        raise AssertionError("never selected")


class _Plugin:
    @hookimpl
    def multiwrite_backends(self):
        return [_Impostor()]


def test_collision_warning_is_a_line_after_the_listing(capsys):
    pm = multiwrite.get_plugin_manager()
    pm.register(_Plugin(), name="impostor-plugin-for-info")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning escaping into the listing fails the test
            assert cmd_info(type("Args", (), {"verbose": False})()) == 0
    finally:
        pm.unregister(name="impostor-plugin-for-info")
    out = capsys.readouterr().out.splitlines()
    assert "warnings:" in out
    tail = out[out.index("warnings:") + 1 :]
    assert any("'torch-cpu' is provided by" in line for line in tail)
    assert all(not line.startswith("backends for") for line in tail)  # the listing is over


def test_interpreter_hint_only_where_triton_imports(monkeypatch):
    from multiwrite.backends import triton_cuda

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_cuda, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(triton_cuda, "_triton_checked", ["triton is not importable (ModuleNotFoundError)"])
    reasons = triton_cuda.TritonCudaBackend().not_supported_reasons(__import__("torch").device("cpu"))
    assert reasons == ["device type cpu (supported: cuda)"]
    monkeypatch.setattr(triton_cuda, "_triton_checked", [])
    reasons = triton_cuda.TritonCudaBackend().not_supported_reasons(__import__("torch").device("cpu"))
    assert "TRITON_INTERPRET=1 runs this backend" in reasons[0]

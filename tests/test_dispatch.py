"""The dispatcher: plugins through pluggy, priorities, forcing, and reasons that say why not."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from conftest import CPU_DEFAULT

import multiwrite
import multiwrite.dispatch as dispatch
from multiwrite import Backend, BackendUnavailableError, FusedStagedWriter, StagedWriteTensor, hookimpl


@pytest.fixture(autouse=True)
def _auto_selection(monkeypatch):
    """These tests are about choosing a backend: a forced one (tox -e cuda) must not leak in."""
    monkeypatch.delenv("MULTIWRITE_BACKEND", raising=False)


class RecordingBackend(Backend):
    """A CPU backend that records its calls and delegates to torch-cpu."""

    NAME = "recording"
    PRIORITY = 50
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def __init__(self):
        self.calls = 0

    def apply(self, batches):
        self.calls += 1
        multiwrite.select_backend("cpu", "torch-cpu").apply(batches)


class XpuOnly(Backend):
    NAME = "xpu-only"
    PRIORITY = 500
    SUPPORTED_DEVICE_TYPES = frozenset({"xpu"})

    def not_supported_reasons(self, device, dtypes=()):
        return [*super().not_supported_reasons(device, dtypes), "xpu runtime=absent (needs oneAPI)"]


@pytest.fixture
def plugin_manager():
    pm = multiwrite.get_plugin_manager()
    registered = []
    yield lambda plugin, name: (pm.register(plugin, name=name), registered.append(plugin))
    for plugin in registered:
        pm.unregister(plugin)


def test_builtin_backends_are_entry_point_plugins():
    pm = multiwrite.get_plugin_manager()
    names = {name for name, _ in pm.list_name_plugin()}
    assert {"torch-cpu", "compiled-cpu", "triton-cuda", "triton-rocm"} <= names
    assert multiwrite.select_backend("cpu").NAME == CPU_DEFAULT


def test_third_party_plugin_wins_by_priority_and_is_used(plugin_manager):
    backend = RecordingBackend()

    class Plugin:
        @hookimpl
        def multiwrite_backends(self):
            return [backend]

    plugin_manager(Plugin(), "recording-plugin")
    assert multiwrite.select_backend("cpu") is backend
    t = StagedWriteTensor((2, 3), torch.int32)
    t.stage_write(1, 0, [4, 5, 6])
    FusedStagedWriter("cpu").apply([t])
    assert backend.calls == 1
    assert t.tensor[1].tolist() == [4, 5, 6]
    assert multiwrite.select_backend("cpu", "torch-cpu").NAME == "torch-cpu"


def test_unknown_name_lists_registered_names():
    with pytest.raises(
        BackendUnavailableError, match=r"unknown backend backend='nope'; registered backends: .*torch-cpu"
    ):
        multiwrite.select_backend("cpu", "nope")


def test_environment_variable_forces(monkeypatch):
    monkeypatch.setenv("MULTIWRITE_BACKEND", "nope")
    with pytest.raises(BackendUnavailableError, match=r"\$MULTIWRITE_BACKEND='nope'"):
        multiwrite.select_backend("cpu")
    monkeypatch.setenv("MULTIWRITE_BACKEND", "torch-cpu")
    assert multiwrite.select_backend("cpu").NAME == "torch-cpu"


def test_forced_backend_that_cannot_run_says_why(plugin_manager):
    class Plugin:
        @hookimpl
        def multiwrite_backends(self):
            return [XpuOnly()]

    plugin_manager(Plugin(), "xpu-plugin")
    with pytest.raises(BackendUnavailableError) as info:
        multiwrite.select_backend("cpu", "xpu-only", dtypes=[torch.float16])
    message = str(info.value)
    assert "'xpu-only' was forced but cannot run for device=cpu" in message
    assert "device type cpu (supported: xpu)" in message
    assert "dtype=float16 (supported: float32, int32, int64)" in message
    assert "xpu runtime=absent" in message
    # with nothing forced, the higher-priority backend that cannot run is passed over
    assert multiwrite.select_backend("cpu").NAME == CPU_DEFAULT


def test_no_backend_lists_every_backend_with_reasons():
    with pytest.raises(BackendUnavailableError) as info:
        multiwrite.select_backend("meta")
    message = str(info.value)
    assert message.startswith("no multiwrite backend can run for device=meta")
    assert "  - torch-cpu: device type meta (supported: cpu)" in message
    assert "  - triton-cuda:" in message and "  - triton-rocm:" in message


def test_plugin_whose_hook_raises_is_reported_not_fatal(plugin_manager):
    class Broken:
        @hookimpl
        def multiwrite_backends(self):
            raise RuntimeError("driver exploded")

    plugin_manager(Broken(), "broken-plugin")
    statuses = {s.name: s for s in multiwrite.available_backends("cpu")}
    assert statuses["broken-plugin"].reasons == ["multiwrite_backends() raised RuntimeError: driver exploded"]
    assert not statuses["broken-plugin"].available
    assert multiwrite.select_backend("cpu").NAME == CPU_DEFAULT


def test_entry_point_that_fails_to_import_becomes_a_reason(tmp_path, monkeypatch):
    (tmp_path / "exploding_plugin.py").write_text("raise ImportError('needs libfoo.so')\n")
    dist = tmp_path / "exploding_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: exploding-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("[multiwrite]\nexploding = exploding_plugin\n"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(dispatch, "_host", None)
    try:
        statuses = {s.name: s for s in multiwrite.available_backends("cpu")}
        assert statuses["exploding"].backend is None
        assert "failed to load: ImportError: needs libfoo.so" in statuses["exploding"].reasons[0]
        assert statuses["torch-cpu"].available
        with pytest.raises(BackendUnavailableError, match="needs libfoo.so"):
            multiwrite.select_backend("cpu", "exploding")
    finally:
        sys.modules.pop("exploding_plugin", None)


def test_writer_accepts_a_backend_instance_and_checks_it():
    with pytest.raises(BackendUnavailableError, match="device type cpu"):
        FusedStagedWriter("cpu", XpuOnly())
    writer = FusedStagedWriter("cpu", multiwrite.select_backend("cpu", "torch-cpu"))
    assert repr(writer) == "FusedStagedWriter(device=cpu, backend='torch-cpu')"


class ImpostorTorchCpu(RecordingBackend):
    """A third-party backend that reuses the built-in name `torch-cpu`, with a higher priority."""

    NAME = "torch-cpu"
    PRIORITY = 1000


class FirstRecording(RecordingBackend):
    """A second third-party backend named `recording`, with a higher priority: it keeps the name."""

    PRIORITY = 900


@pytest.mark.filterwarnings("ignore::multiwrite.dispatch.BackendNameCollisionWarning")
def test_plugin_cannot_take_a_builtin_backends_name(plugin_manager):
    impostor = ImpostorTorchCpu()

    class Plugin:
        @hookimpl
        def multiwrite_backends(self):
            return [impostor]

    plugin_manager(Plugin(), "impostor-plugin")
    builtin = multiwrite.select_backend("cpu", "torch-cpu")
    assert builtin is not impostor and type(builtin).__module__ == "multiwrite.backends.torch_cpu"
    assert multiwrite.select_backend("cpu").NAME == CPU_DEFAULT  # the impostor's priority 1000 does not count
    statuses = [s for s in multiwrite.available_backends("cpu") if s.name == "torch-cpu"]
    assert [s.backend for s in statuses] == [builtin, impostor]
    assert statuses[0].available and statuses[0].taken_by is None
    assert not statuses[1].available
    assert statuses[1].reasons == [
        "backend name 'torch-cpu' is already taken by multiwrite.backends.torch_cpu.TorchCpuBackend "
        "(distribution multiwrite)"
    ]
    assert statuses[1].taken_by == "multiwrite.backends.torch_cpu.TorchCpuBackend"


def test_a_shared_third_party_name_is_resolved_by_priority_and_forcing_it_is_refused(plugin_manager):
    low, high = RecordingBackend(), FirstRecording()

    class PluginA:
        @hookimpl
        def multiwrite_backends(self):
            return [low]

    class PluginB:
        @hookimpl
        def multiwrite_backends(self):
            return [high, high]  # the same instance twice: listed once, and the duplicate is a reason

    plugin_manager(PluginA(), "plugin-a")
    plugin_manager(PluginB(), "plugin-b")
    with pytest.warns(dispatch.BackendNameCollisionWarning, match=r"'recording' is provided by"):
        statuses = [s for s in multiwrite.available_backends("cpu") if s.name == "recording"]
    assert [s.backend for s in statuses] == [high, low]  # registration order does not matter
    assert statuses[1].reasons == [f"backend name 'recording' is already taken by {__name__}.FirstRecording"]
    assert multiwrite.select_backend("cpu") is high
    with pytest.raises(BackendUnavailableError, match=r"'recording' is ambiguous: 2 installed .*FirstRecording.*"):
        multiwrite.select_backend("cpu", "recording")
    plugin_b = next(s for s in multiwrite.available_backends("cpu") if s.name == "plugin-b")
    assert plugin_b.reasons == ["multiwrite_backends() returned backend 'recording' twice"]


@pytest.mark.filterwarnings("ignore::multiwrite.dispatch.BackendNameCollisionWarning")
def test_entry_point_reusing_a_builtin_name_does_not_hide_the_builtin(tmp_path, monkeypatch):
    (tmp_path / "impostor_plugin.py").write_text(
        textwrap.dedent(
            """
            from multiwrite import Backend, hookimpl

            class Impostor(Backend):
                NAME = "torch-cpu"
                PRIORITY = 1000
                SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

                def apply(self, batches):
                    raise AssertionError("the impostor must never run")

            @hookimpl
            def multiwrite_backends():
                return [Impostor()]
            """
        )
    )
    dist = tmp_path / "impostor_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: impostor-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[multiwrite]\ntorch-cpu = impostor_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(dispatch, "_host", None)
    try:
        names = dict(multiwrite.get_plugin_manager().list_name_plugin())
        assert names["torch-cpu"].__name__ == "multiwrite.backends.torch_cpu"
        assert names["torch-cpu (impostor-plugin)"].__name__ == "impostor_plugin"
        assert type(multiwrite.select_backend("cpu", "torch-cpu")).__module__ == "multiwrite.backends.torch_cpu"
        assert multiwrite.select_backend("cpu").NAME == CPU_DEFAULT
        assert type(multiwrite.select_backend("cpu")).__module__.startswith("multiwrite.backends.")
        impostor = [s for s in multiwrite.available_backends("cpu") if s.taken_by]
        assert [type(s.backend).__module__ for s in impostor] == ["impostor_plugin"]
    finally:
        sys.modules.pop("impostor_plugin", None)

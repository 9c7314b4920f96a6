"""Backend selection (`select_backend`, `available_backends`) with plugins registered in this process through the
public plugin manager: priorities and ties, forcing by name or `$MULTIWRITE_BACKEND`, unknown names, forced backends
that cannot run, a plugin reusing a built-in's name, and backend instances passed by hand."""

from __future__ import annotations

import pytest
import torch

from multiwrite import (
    Backend,
    BackendUnavailableError,
    BlockTables,
    FusedStagedWriter,
    StagedWriteTensor,
    available_backends,
    get_plugin_manager,
    hookimpl,
    select_backend,
)
from multiwrite.plugins.dispatch import BACKEND_ENV, BackendNameCollisionWarning
from tests.conftest import CPU_DEFAULT

#: These tests are about choosing a backend: a forced one (tox -e cuda) must not leak in.
pytestmark = pytest.mark.usefixtures("auto_selection")


class Forwarding(Backend):
    """A CPU backend that counts its calls and applies through torch-cpu."""

    NAME = "forwarding"
    PRIORITY = 50
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def __init__(self):
        self.calls = 0

    def apply(self, batches):
        self.calls += 1
        select_backend("cpu", "torch-cpu").apply(batches)


class XpuOnly(Backend):
    NAME = "xpu-only"
    PRIORITY = 500
    SUPPORTED_DEVICE_TYPES = frozenset({"xpu"})

    def not_supported_reasons(self, device, dtypes=()):
        return [*super().not_supported_reasons(device, dtypes), "xpu runtime=absent (needs oneAPI)"]

    def apply(self, batches):
        raise AssertionError("never applied here")


def _plugin(*backends: Backend) -> object:
    class Plugin:
        @hookimpl
        def multiwrite_backends(self):
            return list(backends)

    return Plugin()


@pytest.fixture
def register():
    """`register(name, *backends)`: a plugin providing `backends`, unregistered after the test."""
    pm = get_plugin_manager()
    registered = []

    def add(name: str, *backends: Backend) -> None:
        plugin = _plugin(*backends)
        pm.register(plugin, name=name)
        registered.append(plugin)

    yield add
    for plugin in registered:
        pm.unregister(plugin)


def test_the_builtins_are_entry_point_plugins_and_cpu_selects_the_compiled_backend_where_built():
    plugins = dict(get_plugin_manager().list_name_plugin())
    assert {"torch-cpu", "compiled-cpu", "triton", "torch-generic"} <= set(plugins)
    assert plugins["triton"].__name__ == "multiwrite.backends.triton.backend"  # one module, both Triton backends
    names = {s.name: s.distribution for s in available_backends("cpu")}
    assert {n: names[n] for n in ("torch-cpu", "compiled-cpu", "triton-cuda", "triton-rocm", "torch-generic")} == (
        dict.fromkeys(("torch-cpu", "compiled-cpu", "triton-cuda", "triton-rocm", "torch-generic"), "multiwrite")
    )
    assert select_backend("cpu").NAME == select_backend().NAME == CPU_DEFAULT


def test_a_third_party_backend_of_higher_priority_is_selected_and_used(register):
    backend = Forwarding()
    register("forwarding-plugin", backend)
    assert select_backend("cpu") is backend
    t = StagedWriteTensor((2, 3), torch.int32)
    t.stage_write(1, 0, [4, 5, 6])
    FusedStagedWriter("cpu").apply([t])
    assert backend.calls == 1 and t.tensor.tolist() == [[0, 0, 0], [4, 5, 6]]
    bt = BlockTables([16], 2, [4], "cpu")
    assert bt.backend is backend
    assert select_backend("cpu", "torch-cpu").NAME == "torch-cpu"  # forcing a built-in still works


@pytest.mark.parametrize("order", ["b-first", "a-first"])
def test_equal_priorities_are_broken_by_name_whatever_the_registration_order(register, order):
    a, b = Forwarding(), Forwarding()
    a.NAME, b.NAME = "tie-a", "tie-b"  # instance attributes: one class, two names
    pairs = [("plugin-b", b), ("plugin-a", a)] if order == "b-first" else [("plugin-a", a), ("plugin-b", b)]
    for name, backend in pairs:
        register(name, backend)
    assert select_backend("cpu") is a
    ranked = [s.name for s in available_backends("cpu") if s.name.startswith("tie-")]
    assert ranked == ["tie-a", "tie-b"]


@pytest.mark.parametrize("source", ["argument", "environment"])
def test_a_backend_is_forced_by_name_or_by_the_environment(monkeypatch, source):
    lowest = "torch-generic"  # priority -100: never auto-selected where another backend runs
    if source == "argument":
        assert select_backend("cpu", lowest).NAME == lowest
    else:
        monkeypatch.setenv(BACKEND_ENV, lowest)
        assert select_backend("cpu").NAME == lowest
        assert BlockTables([16], 2, [4], "cpu").backend.NAME == lowest
        assert select_backend("cpu", "torch-cpu").NAME == "torch-cpu"  # the argument wins over the environment


@pytest.mark.parametrize("source", ["argument", "environment"])
def test_an_unknown_name_is_refused_listing_the_registered_names(monkeypatch, source):
    if source == "environment":
        monkeypatch.setenv(BACKEND_ENV, "nope")
    with pytest.raises(BackendUnavailableError) as info:
        select_backend("cpu", "nope" if source == "argument" else None)
    where = "backend=" if source == "argument" else "$MULTIWRITE_BACKEND="
    message = str(info.value)
    assert message.startswith(f"unknown backend {where}'nope'; registered backends: ")
    listed = message.split("registered backends: ")[1].split(", ")
    assert listed == sorted(listed) and {"compiled-cpu", "torch-cpu", "torch-generic", "triton-cuda"} <= set(listed)


def test_a_forced_backend_that_cannot_run_says_why_and_unforced_it_is_passed_over(register):
    register("xpu-plugin", XpuOnly())
    with pytest.raises(BackendUnavailableError) as info:
        select_backend("cpu", "xpu-only", dtypes=[torch.float16, torch.int32])
    assert str(info.value) == (
        "backend 'xpu-only' was forced but cannot run for device=cpu, dtypes=['float16', 'int32']: device type cpu "
        "(supported: xpu); dtype=float16 (supported: float32, int32, int64); xpu runtime=absent (needs oneAPI)"
    )
    with pytest.raises(BackendUnavailableError, match="'xpu-only' was forced but cannot run"):
        BlockTables([16], 2, [4], "cpu", backend="xpu-only")
    assert select_backend("cpu").NAME == CPU_DEFAULT  # priority 500, but it cannot run here


def test_no_backend_for_a_device_lists_every_backend_with_its_reasons():
    with pytest.raises(BackendUnavailableError) as info:
        select_backend("meta")
    lines = str(info.value).splitlines()
    assert lines[0] == "no multiwrite backend can run for device=meta:"
    assert "  - torch-cpu: device type meta (supported: cpu)" in lines
    assert "  - torch-generic: device type meta holds no data (supported: every other torch device type)" in lines
    assert {line.split(":")[0] for line in lines[1:]} >= {f"  - {n}" for n in ("triton-cuda", "triton-rocm",
                                                                                 "compiled-cpu")}  # fmt: skip


def test_a_plugin_cannot_take_a_builtin_name_whatever_its_priority(register):
    class Impostor(Forwarding):
        NAME = "torch-cpu"
        PRIORITY = 1000

    impostor = Impostor()
    register("impostor-plugin", impostor)
    with pytest.warns(BackendNameCollisionWarning, match=r"'torch-cpu' is provided by multiwrite .* and by plugin "
                                                         r"'impostor-plugin'"):  # fmt: skip
        builtin = select_backend("cpu", "torch-cpu")
    assert builtin is not impostor and type(builtin).__module__ == "multiwrite.backends.torch_cpu"
    assert select_backend("cpu").NAME == CPU_DEFAULT
    statuses = [s for s in available_backends("cpu") if s.name == "torch-cpu"]
    assert [s.backend for s in statuses] == [builtin, impostor]
    assert statuses[0].available and statuses[0].taken_by is None
    assert statuses[1].reasons == [
        "backend name 'torch-cpu' is already taken by multiwrite.backends.torch_cpu.TorchCpuBackend (distribution "
        "multiwrite)"
    ]
    assert statuses[1].taken_by == "multiwrite.backends.torch_cpu.TorchCpuBackend" and not statuses[1].available


def test_a_backend_instance_is_used_as_given_and_checked_for_the_device():
    with pytest.raises(BackendUnavailableError, match=r"backend 'xpu-only' cannot run on cpu: device type cpu "
                                                      r"\(supported: xpu\); xpu runtime=absent"):  # fmt: skip
        FusedStagedWriter("cpu", XpuOnly())
    with pytest.raises(BackendUnavailableError, match="'xpu-only' cannot run on cpu"):
        BlockTables([16], 2, [4], "cpu", backend=XpuOnly())
    own = Forwarding()  # never registered: an instance needs no plugin
    writer = FusedStagedWriter("cpu", own)
    assert repr(writer) == "FusedStagedWriter(device=cpu, backend='forwarding')"
    bt = BlockTables([16], 2, [4], "cpu", backend=own)
    bt.append_block_ids(1, ([7],), overwrite=True)
    bt.apply_staged_writes()
    assert own.calls == 1 and bt[0].tensor[1, 0] == 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize(
    ("make", "device"),
    [
        (lambda: BlockTables([16, 32, 8], 256, [1025, 513, 2049], "cuda", [16, 16, 8]), "cuda"),
        (lambda: BlockTables([16], 2, [4], "cuda:3"), "cuda:3"),
        (lambda: StagedWriteTensor((4, 8), torch.int32, "cuda"), "cuda"),
        (lambda: FusedStagedWriter("cuda"), "cuda"),
    ],
    ids=["BlockTables", "BlockTables-index", "StagedWriteTensor", "FusedStagedWriter"],
)
def test_cuda_on_a_cpu_only_torch_is_a_clean_error(make, device):
    with pytest.raises(BackendUnavailableError) as info:
        make()
    message = str(info.value)
    assert device in message and ("no cuda device" in message or "CUDA unavailable" in message), message

"""The shared backend matrix: every test that takes `backend` runs once per built-in backend, and every test that
takes `staging` once per staging path of `BlockTables` (compiled, Python twin).

Without a GPU, the Triton backends run their kernels through Triton's interpreter on CPU tensors
(`TRITON_INTERPRET=1`, set here before anything imports Triton). A backend that cannot run is skipped with its
reasons (`pytest -rs` prints them), unless `MULTIWRITE_BACKEND` forces it: then it fails. Third-party backends
installed in the environment are unregistered (they would win auto-selection and change what these tests check)
unless `MULTIWRITE_BACKEND` names one or `MULTIWRITE_TEST_ALL_PLUGINS=1`. The conformance kit's fixtures
(`multiwrite_*`) point the kit at each case. `provide_backends` registers a test's own backends as a plugin.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from multiwrite import available_backends, get_plugin_manager, hookimpl  # noqa: E402
from multiwrite.plugins.dispatch import BACKEND_ENV, builtin_only  # noqa: E402
from multiwrite.staging.fields import COMPILED  # noqa: E402

FORCED = os.environ.get(BACKEND_ENV) or None
BUILTIN = ("torch-cpu", "compiled-cpu", "triton-cuda", "triton-rocm", "torch-generic")
#: The backend auto-selection picks for CPU tables: the compiled one where the helper was built.
CPU_DEFAULT = "compiled-cpu" if COMPILED else "torch-cpu"

if os.environ.get("MULTIWRITE_TEST_ALL_PLUGINS") != "1" and (FORCED is None or FORCED in BUILTIN):
    builtin_only()


@dataclass(frozen=True)
class BackendCase:
    """A backend under test and the device its tables live on."""

    name: str
    device: torch.device

    @property
    def interpreted(self) -> bool:
        """The Triton kernels run through Triton's interpreter (slow: tests take fewer cases)."""
        return self.device.type == "cpu" and self.name.startswith("triton")

    def __str__(self) -> str:
        return f"{self.name}@{self.device.type}"


def _candidate_devices() -> list[torch.device]:
    devices = []
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    devices.append(torch.device("cpu"))
    return devices


def _backend_cases() -> list[object]:
    statuses = {s.name: s for s in available_backends("cpu")}
    names = sorted(statuses) if FORCED is None else [FORCED]
    params = []
    for name in names:
        reasons: list[str] = []
        case = None
        for device in _candidate_devices():
            for s in available_backends(device):
                if s.name == name:
                    if s.available:
                        case = BackendCase(name, device)
                    else:
                        reasons.extend(f"{device}: {r}" for r in s.reasons)
            if case:
                break
        why = "; ".join(reasons) or "not registered"
        if case is not None:
            params.append(pytest.param(case, id=str(case)))
        elif FORCED is not None:
            params.append(pytest.param(None, id=name, marks=pytest.mark.forced_unavailable(why)))
        else:
            params.append(pytest.param(None, id=name, marks=pytest.mark.skip(reason=f"{name} unavailable: {why}")))
    return params


BACKEND_CASES = _backend_cases()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "forced_unavailable(why): the forced backend cannot run")


@pytest.fixture(params=BACKEND_CASES)
def backend(request: pytest.FixtureRequest) -> BackendCase:
    """Each registered backend with a device it can run on."""
    marker = request.node.get_closest_marker("forced_unavailable")
    if marker is not None:
        pytest.fail(f"{BACKEND_ENV}={FORCED} was forced but cannot run: {marker.args[0]}")
    return request.param


@pytest.fixture(params=["c", "python"])
def staging(request: pytest.FixtureRequest) -> str:
    """`BlockTables` staging through the compiled helper (where built) and through its Python twin: build tables with
    `multiwrite.testing.staging.block_tables_class(staging)`."""
    if request.param == "c" and not COMPILED:
        pytest.skip("multiwrite.staging._cstaging is not built (no C compiler at install time)")
    return request.param


# -- the conformance kit's fixtures, pointed at the matrix ----------------------------------------------------
@pytest.fixture
def multiwrite_backend_name(backend: BackendCase) -> str:
    return backend.name


@pytest.fixture
def multiwrite_device(backend: BackendCase) -> torch.device:
    return backend.device


@pytest.fixture
def multiwrite_staging(staging: str) -> str:
    return staging


@pytest.fixture
def multiwrite_examples(backend: BackendCase) -> int:
    """Triton's interpreter runs a launch in tens of milliseconds: fewer examples there."""
    return 25 if backend.interpreted else 120


# -- a test's own backends, registered as a plugin ------------------------------------------------------------
@pytest.fixture
def provide_backends():
    """`provide_backends(name, *classes)`: register a plugin named `name` whose `multiwrite_backends` hook returns a
    new backend of each class at each call; every plugin registered so is unregistered after the test."""
    manager = get_plugin_manager()
    registered: list[object] = []

    def provide(name: str, *classes: type) -> None:
        class Plugin:
            @hookimpl
            def multiwrite_backends(self):
                return [cls() for cls in classes]

        plugin = Plugin()
        manager.register(plugin, name=name)
        registered.append(plugin)

    yield provide
    for plugin in registered:
        manager.unregister(plugin)


@pytest.fixture
def auto_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """No `MULTIWRITE_BACKEND` for this test: it checks what dispatch selects by itself (the forced matrix of
    `tox -e cuda` sets it)."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)

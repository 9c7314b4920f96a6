"""The shared backend matrix: every test that takes `backend` runs once per built-in backend.

Without a GPU, Triton backends run their kernels through Triton's interpreter on CPU tensors
(`TRITON_INTERPRET=1`, set here before anything imports Triton). A backend that cannot run is skipped
with its reasons (`pytest -rs` prints them), unless `MULTIWRITE_BACKEND` forces it: then it fails.

The conformance kit (`multiwrite.testing`) is this matrix's suite: `test_matrix.py` and
`test_properties.py` import it, and the `multiwrite_*` fixtures below point it at each `backend` case
(and both `staging` paths). Third-party backends installed in the environment are ignored (they would
otherwise win auto-selection and change what these tests check) unless `MULTIWRITE_BACKEND` names one
or `MULTIWRITE_TEST_ALL_PLUGINS=1`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import multiwrite.dispatch as dispatch  # noqa: E402
from multiwrite import available_backends  # noqa: E402
from multiwrite.dispatch import BACKEND_ENV  # noqa: E402

FORCED = os.environ.get(BACKEND_ENV) or None
BUILTIN = ("torch-cpu", "compiled-cpu", "triton-cuda", "triton-rocm", "torch-generic")


def _only_builtin_plugins() -> None:
    """Unregister every plugin not under `multiwrite.backends`, and forget third-party load failures."""
    host = dispatch._get_host()
    for _, plugin in list(host.pm.list_name_plugin()):
        module = getattr(plugin, "__name__", None) or type(plugin).__module__
        if not dispatch._is_builtin_module(module):
            host.pm.unregister(plugin)
    host.failures = {n: f for n, f in host.failures.items() if f.distribution == "multiwrite"}


if os.environ.get("MULTIWRITE_TEST_ALL_PLUGINS") != "1" and (FORCED is None or FORCED in BUILTIN):
    _only_builtin_plugins()

try:  # the backend auto-selection picks for CPU tables: the compiled one where it was built
    import multiwrite._cstaging  # noqa: F401

    CPU_DEFAULT = "compiled-cpu"
except ImportError:
    CPU_DEFAULT = "torch-cpu"


@dataclass(frozen=True)
class BackendCase:
    """A backend under test and the device its tables live on."""

    name: str
    device: torch.device

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
        if case is not None:
            params.append(pytest.param(case, id=str(case)))
        elif FORCED is not None:
            why = "; ".join(reasons) or "not registered"
            params.append(pytest.param(None, id=name, marks=pytest.mark.forced_unavailable(why)))
        else:
            why = "; ".join(reasons) or "not registered"
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


@pytest.fixture(params=["compiled", "python"])
def staging(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """BlockTables staging through the compiled paths (when built: `append_block_ids`, the lent ring's rotation,
    graph mode's commit) and through the pure-Python ones (tables built after the fixture)."""
    import multiwrite.block_tables as block_tables
    import multiwrite.staging as staging_module

    if request.param == "compiled":
        if block_tables._stage_block_ids is None:
            pytest.skip("multiwrite._cstaging is not built (no C compiler at install time)")
    else:
        monkeypatch.setattr(block_tables, "_stage_block_ids", None)
        monkeypatch.setattr(block_tables, "_commit_graph", None)
        monkeypatch.setattr(staging_module, "_rotate_lent", None)
    return request.param


# -- the conformance kit's fixtures, pointed at the matrix -------------------------------------------
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
    return 120 if backend.device.type != "cpu" or backend.name in ("torch-cpu", "compiled-cpu") else 25

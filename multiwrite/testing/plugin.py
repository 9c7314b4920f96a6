"""The pytest plugin of the conformance kit (entry point `pytest11: multiwrite`).

Inert unless asked: it only adds options and fixtures (all named `multiwrite_*`) and imports nothing
heavy. `pytest --multiwrite-backend NAME [--multiwrite-device DEV] [--multiwrite-examples N]` adds the
kit's suite (`multiwrite.testing.suite`, `multiwrite.testing.properties`) to the collected tests and runs
it against that backend on that device. A plugin package may instead import the suite into a test file
of its own and override `multiwrite_backend_name` (and any other fixture below) in its `conftest.py`.

Fixtures an author overrides for a device this kit has never seen:
    multiwrite_backend_name: the backend's `NAME` (default: `--multiwrite-backend`).
    multiwrite_device: the `torch.device` its tables live on (default: `--multiwrite-device`, else the
        first of the current CUDA device, XPU, MPS and CPU where the backend reports no reasons).
    multiwrite_tensor_factory: `(shape, dtype) -> zero-filled tensor on the device`.
    multiwrite_to_host: `tensor -> numpy array` (waits for the device).
    multiwrite_examples: hypothesis examples per property test (default `--multiwrite-examples`, 50).
    multiwrite_staging: how the kit's `BlockTables` stage block ids: "default" (multiwrite's choice: the
        compiled helper where it is built), "c" or "python" (`multiwrite.testing.staging.block_tables_class`;
        multiwrite's own tests run both). The kit's tests that build `BlockTables` take it, and build them with
        `Kit.block_tables(..., staging=multiwrite_staging)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

#: The modules of the kit's suite, collected when `--multiwrite-backend` is given.
SUITE_MODULES = ("multiwrite.testing.suite", "multiwrite.testing.properties")
DEFAULT_EXAMPLES = 50


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the kit's options: `--multiwrite-backend NAME` (turns the kit on), `--multiwrite-device DEV`
    and `--multiwrite-examples N` (hypothesis examples per property)."""
    group = parser.getgroup("multiwrite", "multiwrite backend conformance kit")
    group.addoption(
        "--multiwrite-backend",
        default=None,
        metavar="NAME",
        help="run multiwrite's conformance suite against the backend NAME",
    )
    group.addoption(
        "--multiwrite-device",
        default=None,
        metavar="DEV",
        help="device of the tables (default: the first of cuda, xpu, mps, cpu where the backend can run)",
    )
    group.addoption(
        "--multiwrite-examples",
        type=int,
        default=None,
        metavar="N",
        help=f"hypothesis examples per property test (default {DEFAULT_EXAMPLES})",
    )


def _suite_paths() -> list[str]:
    import importlib.util

    paths = []
    for module in SUITE_MODULES:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None
        paths.append(spec.origin)
    return paths


def pytest_configure(config: pytest.Config) -> None:
    """With `--multiwrite-backend`, prepare the run for it (Triton's interpreter for CPU tables, chosen
    before anything imports Triton); without it, do nothing: the plugin is inert."""
    if config.getoption("--multiwrite-backend", default=None):
        # Triton backends run on CPU tensors only through Triton's interpreter, which must be chosen
        # before anything imports Triton.
        device = config.getoption("--multiwrite-device") or ""
        if device.startswith("cpu"):
            os.environ.setdefault("TRITON_INTERPRET", "1")
        for path in _suite_paths():
            if path not in config.args:
                config.args.append(path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """When a test file of the author's imports the suite and `--multiwrite-backend` also added it, keep
    one copy of each test (the author's, which sees the author's fixtures)."""
    if not config.getoption("--multiwrite-backend", default=None):
        return
    imported = {
        getattr(item, "originalname", item.name)
        for item in items
        if getattr(getattr(item, "function", None), "__module__", None) in SUITE_MODULES
        and getattr(getattr(item, "module", None), "__name__", None) not in SUITE_MODULES
    }
    if imported:
        items[:] = [
            item
            for item in items
            if getattr(getattr(item, "module", None), "__name__", None) not in SUITE_MODULES
            or getattr(item, "originalname", item.name) not in imported
        ]


@dataclass
class Kit:
    """What a kit test needs, bundled from the overridable fixtures.

    Attributes:
        backend: the backend's name; device: the tables' device; tensor(shape, dtype): a zero-filled
        tensor there; host(t): a numpy copy of `t`; examples: hypothesis examples per property test.
    """

    backend: str
    device: Any
    tensor: Any
    host: Any
    examples: int

    def writer(self) -> Any:
        """A `FusedStagedWriter` forced to the backend under test."""
        from multiwrite import FusedStagedWriter

        return FusedStagedWriter(self.device, self.backend)

    def table(self, shape: Any, dtype: Any, **kwargs: Any) -> Any:
        """A `StagedWriteTensor` whose tensor comes from the author's tensor factory."""
        from multiwrite import StagedWriteTensor

        t = StagedWriteTensor(shape, dtype, "cpu" if self.device.type != "cpu" else self.device, **kwargs)
        t.tensor = self.tensor(tuple(t.shape), dtype)
        return t

    def block_tables(
        self,
        block_sizes: Any,
        max_num_reqs: int,
        max_num_blocks_per_group: Any,
        kernel_block_sizes: Any = None,
        *,
        staging: str = "default",
        **kwargs: Any,
    ) -> Any:
        """A `BlockTables` on the device, forced to the backend under test, staging block ids through `staging`
        (the `multiwrite_staging` fixture: "default", "c" or "python"; see
        `multiwrite.testing.staging.block_tables_class`). `kwargs`: more `BlockTables` keywords."""
        from multiwrite.testing.staging import block_tables_class

        return block_tables_class(staging)(block_sizes, max_num_reqs, max_num_blocks_per_group, self.device,
                                           kernel_block_sizes, backend=self.backend, **kwargs)  # fmt: skip


@pytest.fixture
def multiwrite_backend_name(request: pytest.FixtureRequest) -> str:
    """The name of the backend under test (`--multiwrite-backend`)."""
    name = request.config.getoption("--multiwrite-backend")
    if not name:
        pytest.skip("no backend to check: pass --multiwrite-backend NAME or override multiwrite_backend_name")
    return str(name)


@pytest.fixture
def multiwrite_device(request: pytest.FixtureRequest, multiwrite_backend_name: str) -> Any:
    """The device of the tables: `--multiwrite-device`, else the first device the backend can run on.
    A backend that cannot run there fails the test with its reasons (never a skip)."""
    import torch

    from multiwrite import available_backends

    given = request.config.getoption("--multiwrite-device")
    candidates = [torch.device(given)] if given else candidate_devices()
    why = []
    for device in candidates:
        for s in available_backends(device):
            if s.name == multiwrite_backend_name and s.taken_by is None:
                if s.available:
                    return device
                why.append(f"{device}: " + "; ".join(s.reasons))
    pytest.fail(f"backend {multiwrite_backend_name!r} cannot run: " + (" | ".join(why) or "it is not registered"))


def candidate_devices() -> list[Any]:
    """The devices the kit tries when none is given, in order: the current CUDA device, XPU, MPS, CPU."""
    import torch

    devices = []
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        devices.append(torch.device("xpu", 0))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append(torch.device("mps"))
    devices.append(torch.device("cpu"))
    return devices


@pytest.fixture
def multiwrite_tensor_factory(multiwrite_device: Any) -> Any:
    """`(shape, dtype) -> zero-filled tensor on the device under test`."""
    import torch

    return lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=multiwrite_device)


@pytest.fixture
def multiwrite_to_host() -> Any:
    """`tensor -> numpy array on the host` (waits for the device)."""
    return lambda t: t.detach().cpu().numpy()


@pytest.fixture
def multiwrite_examples(request: pytest.FixtureRequest) -> int:
    """Hypothesis examples per property test (`--multiwrite-examples`, default 50)."""
    return int(request.config.getoption("--multiwrite-examples") or DEFAULT_EXAMPLES)


@pytest.fixture
def multiwrite_staging() -> str:
    """How the kit's `BlockTables` stage block ids ("default", "c" or "python"; `Kit.block_tables`); the
    default leaves multiwrite's choice alone."""
    return "default"


@pytest.fixture
def multiwrite_kit(
    multiwrite_backend_name: str,
    multiwrite_device: Any,
    multiwrite_tensor_factory: Any,
    multiwrite_to_host: Any,
    multiwrite_examples: int,
) -> Kit:
    """The backend under test with its device, tensor factory, host copy and example count."""
    return Kit(multiwrite_backend_name, multiwrite_device, multiwrite_tensor_factory, multiwrite_to_host,
               multiwrite_examples)  # fmt: skip

"""Fixtures of the SGLang room: the device its pools live on, and SGLang 0.5.23's own writers as an oracle.

`upstream` skips the test (saying how to run it) unless `MULTIWRITE_SGLANG_WHEEL` or `MULTIWRITE_SGLANG_SRC` locates
SGLang's files (`multiwrite.sglang.upstream`); set but wrong, it fails. `upstream.active()` puts SGLang's modules and
their stand-ins in `sys.modules` for the calls that need them (`install()` imports SGLang's allocation module).
"""

from __future__ import annotations

import pytest
import torch

from multiwrite.sglang import upstream as upstream_mod


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA where there is one (SGLang's kernel then compiles for it), else CPU (Triton's interpreter)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture
def backend(backend):
    """The matrix's backend case (tests/conftest.py), skipped with the reason where the backend reads no
    device-sourced writes of the kinds these writers give (flat values, per-row tensors)."""
    from multiwrite.plugins.checked import device_write_reasons
    from multiwrite.plugins.dispatch import available_backends

    for status in available_backends(backend.device):
        if status.name == backend.name and status.backend is not None:
            reasons = device_write_reasons(status.backend, ("values", "tensors"))
            if reasons:
                pytest.skip(f"{backend.name}: {'; '.join(reasons)}")
    return backend


@pytest.fixture(scope="session")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> upstream_mod.Upstream:
    """SGLang 0.5.23's kernels, `allocation.py` and `ReqToTokenPool`, loaded from its files."""
    if not upstream_mod.configured():
        pytest.skip(upstream_mod.SKIP_REASON)
    source = upstream_mod.locate_sources(tmp_path_factory.mktemp("sglang-oracle"))
    return upstream_mod.load_upstream(source)


@pytest.fixture
def sglang_backends(upstream):
    """`set(name)`: SGLang's attention backends for the test (`triton`: its Triton writer; `torch_native`: its
    per-request fallback); reset afterwards."""
    before = upstream.settings.attention_backends

    def set_backend(name: str) -> None:
        upstream.settings.attention_backends = (name, name)

    yield set_backend
    upstream.settings.attention_backends = before

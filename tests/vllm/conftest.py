"""Fixtures of the vLLM room: the device its tables live on, and vLLM 0.33's `BlockTables` as an oracle.

`oracle` skips the test (saying how to run it) unless `MULTIWRITE_VLLM_WHEEL` or `MULTIWRITE_VLLM_SRC` locates vLLM's
two files (tests/vllm/oracle.py); set but wrong, it fails. Only calls into vLLM's code see the stand-ins for its
imports and the bool masks for Triton's interpreter (`Oracle.running`).
"""

from __future__ import annotations

import pytest
import torch

from tests.vllm import oracle as oracle_mod


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA where there is one (vLLM's kernels then compile for it), else CPU (Triton's interpreter)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture(scope="session")
def oracle(tmp_path_factory: pytest.TempPathFactory, device: torch.device) -> oracle_mod.Oracle:
    """vLLM 0.33's modules, loaded: `oracle.make(...)` builds its `BlockTables` (calls run with its stand-ins)."""
    if not oracle_mod.configured():
        pytest.skip(oracle_mod.SKIP_REASON)
    source = oracle_mod.locate_sources(tmp_path_factory.mktemp("vllm-oracle"))
    return oracle_mod.load_oracle(source, device.type)

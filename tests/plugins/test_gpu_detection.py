"""Which Triton backend serves a GPU, on simulated NVIDIA and ROCm builds of torch, and what each says when it cannot.

No GPU is needed: `torch.version.hip`, CUDA availability and the device properties are patched. White-box by nature
(no public face can make a CPU-only torch look like a GPU build): the backend module's own probes are patched too,
through its module-level functions `interpreter_enabled` (the tests' `TRITON_INTERPRET=1` would otherwise make the
backends refuse GPU memory), `pinned_memory_reasons` (a CPU-only torch cannot pin memory) and `triton_reasons` (a
missing or old Triton).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from multiwrite import BackendUnavailableError, available_backends, select_backend
from tests.conftest import CPU_DEFAULT

triton_backend = pytest.importorskip("multiwrite.backends.triton.backend")

HIP_VERSION = "6.2.41133-dd7f95766"
_TRITON = triton_backend.triton_reasons()
needs_triton = pytest.mark.skipif(bool(_TRITON), reason="; ".join(_TRITON))


#: These tests are about choosing a backend: a forced one (tox -e cuda) must not leak in.
pytestmark = pytest.mark.usefixtures("auto_selection")


@pytest.fixture
def gpu_build(monkeypatch):
    """`make(hip, capability)`: torch looks like a build with one visible GPU (a ROCm build where `hip` is given)."""

    def make(hip: str | None, capability: tuple[int, int] = (9, 0)) -> None:
        monkeypatch.setattr(triton_backend, "interpreter_enabled", lambda: False)
        monkeypatch.setattr(triton_backend, "pinned_memory_reasons", lambda: [])
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.version, "cuda", None if hip else "12.8")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Simulated GPU")
        props = SimpleNamespace(name="Simulated GPU", major=capability[0], minor=capability[1], warp_size=64)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)

    return make


def _statuses(device="cuda:0"):
    return {s.name: s for s in available_backends(device)}


@needs_triton
def test_a_hip_build_selects_triton_rocm_and_triton_cuda_says_why_not(gpu_build):
    gpu_build(HIP_VERSION)
    s = _statuses()
    assert s["triton-rocm"].available, s["triton-rocm"].reasons
    assert s["triton-cuda"].reasons == [
        f"HIP build of torch (torch.version.hip={HIP_VERSION}); triton-rocm serves AMD GPUs"
    ]
    assert select_backend("cuda:0").NAME == select_backend("cuda").NAME == "triton-rocm"  # bare cuda: the current one
    with pytest.raises(BackendUnavailableError, match=r"'triton-cuda' was forced but cannot run .*HIP build of torch"):
        select_backend("cuda:0", "triton-cuda")


@needs_triton
def test_an_nvidia_build_selects_triton_cuda_and_triton_rocm_says_it_is_no_hip_build(gpu_build):
    gpu_build(None)
    s = _statuses()
    assert s["triton-cuda"].available, s["triton-cuda"].reasons
    assert s["triton-rocm"].reasons == ["not a HIP build of torch (torch.version.hip=None)"]
    assert select_backend("cuda:0").NAME == "triton-cuda"
    with pytest.raises(BackendUnavailableError, match=r"'triton-rocm' was forced .*not a HIP build of torch"):
        select_backend("cuda:0", "triton-rocm")


@needs_triton
def test_an_old_nvidia_gpu_is_named_and_the_generic_fallback_serves_it(gpu_build):
    gpu_build(None, capability=(6, 1))
    assert _statuses()["triton-cuda"].reasons == ["compute capability 6.1 (Simulated GPU) is below 7.0"]
    assert select_backend("cuda:0").NAME == "torch-generic"


def test_a_device_index_past_the_visible_gpus_is_named(gpu_build):
    gpu_build(None)
    assert "device cuda:3 does not exist (1 visible)" in _statuses("cuda:3")["triton-cuda"].reasons


MISSING = "triton is not importable (ModuleNotFoundError: No module named 'triton')"


@pytest.mark.parametrize("hip", [None, HIP_VERSION], ids=["nvidia", "rocm"])
@pytest.mark.parametrize("problem", ["triton 3.1.0 is older than 3.2", MISSING])
def test_a_missing_or_old_triton_is_a_reason_of_both(gpu_build, monkeypatch, hip, problem):
    gpu_build(hip)
    monkeypatch.setattr(triton_backend, "triton_reasons", lambda: [problem])
    s = _statuses()
    for name in ("triton-cuda", "triton-rocm"):
        assert problem in s[name].reasons and not s[name].available
    assert select_backend("cuda:0").NAME == "torch-generic"


@pytest.mark.parametrize("triton_imports", [True, False])
def test_a_cpu_only_build_names_why_and_hints_at_the_interpreter_only_where_triton_imports(monkeypatch, triton_imports):
    monkeypatch.setattr(triton_backend, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(triton_backend, "triton_reasons", lambda: [] if triton_imports else [MISSING])
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu = _statuses("cuda:0")
    assert "not a HIP build of torch (torch.version.hip=None)" in gpu["triton-rocm"].reasons
    assert any(r.startswith("CUDA unavailable (torch.cuda.is_available()=False") for r in gpu["triton-cuda"].reasons)
    cpu = _statuses("cpu")
    hint = " (TRITON_INTERPRET=1 runs this backend on CPU through Triton's interpreter)"
    for name in ("triton-cuda", "triton-rocm"):
        assert cpu[name].reasons == ["device type cpu (supported: cuda)" + (hint if triton_imports else "")]


@needs_triton
def test_with_the_interpreter_on_cpu_is_accepted_below_the_native_backends(monkeypatch):
    monkeypatch.setattr(triton_backend, "interpreter_enabled", lambda: True)
    s = _statuses("cpu")
    for name in ("triton-cuda", "triton-rocm"):
        assert s[name].available, s[name].reasons
        assert s[name].priority < s["torch-cpu"].priority < s["compiled-cpu"].priority
    assert select_backend("cpu").NAME == CPU_DEFAULT
    # but never on GPU memory: the interpreter cannot write it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(triton_backend, "pinned_memory_reasons", lambda: [])
    monkeypatch.setattr(torch.version, "hip", None)
    reasons = _statuses("cuda:0")["triton-cuda"].reasons
    assert reasons == ["TRITON_INTERPRET=1 is set: the interpreter cannot write GPU memory"]

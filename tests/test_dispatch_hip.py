"""Dispatch between `triton-cuda` and `triton-rocm` on simulated NVIDIA and ROCm builds of torch.

No GPU is needed: `torch.version.hip`, CUDA availability and the device properties are patched, and the
pinned-memory probe is stubbed (a CPU-only torch cannot pin memory). Triton must be importable: on a
machine without it both backends report that reason instead, which a separate test checks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import CPU_DEFAULT
from multiwrite.backends import triton_cuda

import multiwrite

HIP_VERSION = "6.2.41133-dd7f95766"


@pytest.fixture
def gpu_build(monkeypatch):
    """Returns `make(hip)`: patches torch to look like a build with one visible GPU (HIP if `hip`)."""

    def make(hip: str | None, capability: tuple[int, int] = (9, 4), warp_size: int = 64):
        monkeypatch.delenv("MULTIWRITE_BACKEND", raising=False)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setattr(triton_cuda, "interpreter_enabled", lambda: False)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.version, "cuda", None if hip else "12.8")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Simulated GPU")
        props = SimpleNamespace(
            name="Simulated GPU", major=capability[0], minor=capability[1], warp_size=warp_size,
            gcnArchName="gfx942:sramecc+:xnack-" if hip else "", multi_processor_count=132,
        )  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(triton_cuda, "pinned_memory_reasons", lambda: [])
        monkeypatch.setattr("multiwrite.backends.triton_rocm.pinned_memory_reasons", lambda: [])

    return make


def _statuses(device="cuda:0"):
    return {s.name: s for s in multiwrite.available_backends(device)}


needs_triton = pytest.mark.skipif(bool(triton_cuda.triton_reasons()), reason="; ".join(triton_cuda.triton_reasons()))


@needs_triton
def test_hip_build_selects_triton_rocm_and_triton_cuda_says_why_not(gpu_build):
    gpu_build(HIP_VERSION)
    s = _statuses()
    assert s["triton-rocm"].available, s["triton-rocm"].reasons
    assert not s["triton-cuda"].available
    assert s["triton-cuda"].reasons == [
        f"HIP build of torch (torch.version.hip={HIP_VERSION}); triton-rocm serves AMD GPUs"
    ]
    assert multiwrite.select_backend("cuda:0").NAME == "triton-rocm"
    assert multiwrite.select_backend("cuda").NAME == "triton-rocm"  # index resolved to the current device
    with pytest.raises(multiwrite.BackendUnavailableError, match=r"triton-cuda.*HIP build of torch"):
        multiwrite.select_backend("cuda:0", "triton-cuda")


@needs_triton
def test_nvidia_build_selects_triton_cuda_and_triton_rocm_says_not_hip(gpu_build):
    gpu_build(None)
    s = _statuses()
    assert s["triton-cuda"].available, s["triton-cuda"].reasons
    assert s["triton-rocm"].reasons == ["not a HIP build of torch (torch.version.hip=None)"]
    assert multiwrite.select_backend("cuda:0").NAME == "triton-cuda"
    with pytest.raises(multiwrite.BackendUnavailableError, match=r"not a HIP build of torch"):
        multiwrite.select_backend("cuda:0", "triton-rocm")


@needs_triton
def test_old_nvidia_gpu_is_named(gpu_build):
    gpu_build(None, capability=(6, 1))
    reasons = _statuses()["triton-cuda"].reasons
    assert reasons == ["compute capability 6.1 (Simulated GPU) is below 7.0"]
    with pytest.raises(multiwrite.BackendUnavailableError, match=r"compute capability 6\.1"):
        multiwrite.select_backend("cuda:0", "triton-cuda")
    assert multiwrite.select_backend("cuda:0").NAME == "torch-generic"  # the fallback for every device type


def test_cpu_only_build_reasons(monkeypatch):
    monkeypatch.setattr(triton_cuda, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    s = _statuses("cuda:0")
    assert "not a HIP build of torch (torch.version.hip=None)" in s["triton-rocm"].reasons
    assert any(r.startswith("CUDA unavailable (torch.cuda.is_available()=False") for r in s["triton-cuda"].reasons)
    cpu = _statuses("cpu")
    for name in ("triton-cuda", "triton-rocm"):
        assert cpu[name].reasons[0].startswith("device type cpu (supported: cuda)")
        assert "TRITON_INTERPRET=1" in cpu[name].reasons[0]


def test_interpreter_accepts_cpu_below_torch_cpu(monkeypatch):
    monkeypatch.delenv("MULTIWRITE_BACKEND", raising=False)
    monkeypatch.setattr(triton_cuda, "interpreter_enabled", lambda: True)
    s = _statuses("cpu")
    for name in ("triton-cuda", "triton-rocm"):
        assert s[name].priority < s["torch-cpu"].priority < s["compiled-cpu"].priority
        assert s[name].available == (not triton_cuda.triton_reasons()), s[name].reasons
    assert multiwrite.select_backend("cpu").NAME == CPU_DEFAULT


def test_missing_or_old_triton_is_a_reason(monkeypatch, gpu_build):
    gpu_build(HIP_VERSION)
    monkeypatch.setattr(triton_cuda, "_triton_checked", ["triton 3.1.0 is older than 3.2"])
    s = _statuses()
    assert "triton 3.1.0 is older than 3.2" in s["triton-rocm"].reasons
    assert not s["triton-rocm"].available
    missing = "triton is not importable (ModuleNotFoundError: No module named 'triton')"
    monkeypatch.setattr(triton_cuda, "_triton_checked", [missing])
    assert any("triton is not importable" in r for r in _statuses()["triton-cuda"].reasons)


@needs_triton
def test_rocm_launch_parameters_follow_the_wavefront(gpu_build):
    from multiwrite.backends.triton_rocm import TritonRocmBackend

    for ws in (64, 32):
        gpu_build(HIP_VERSION, warp_size=ws)
        params = TritonRocmBackend()._launch_params(torch.device("cuda", 0))
        assert params.warp_size == ws and params.num_warps * ws <= 1024

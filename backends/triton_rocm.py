"""`triton-rocm`: the `triton-cuda` kernel on AMD GPUs through a ROCm (HIP) build of torch.

Same kernel, pinned ring (torch's pinned memory is HIP host memory on ROCm builds) and slot guard as
`triton-cuda`; only the launch parameters differ: 256 lanes per program whatever the wavefront size
(4 wavefronts of 64 lanes on CDNA, 8 of 32 on RDNA), so `num_warps * warp_size` never exceeds 1024, and
256-cell column chunks (whole 64-lane runs per row). Selected automatically on a HIP build of torch,
where the device type is still `cuda`.

What is verified: the kernel with these launch parameters compiles to AMD machine code for gfx90a
(MI200), gfx942 (MI300) and gfx1100 (RDNA3) and runs through Triton's interpreter in CI, against the
reference. It has never run on AMD hardware: the UVA reads of pinned host memory, the completion
token written to host memory and the launch path are only verified on NVIDIA.
"""

from __future__ import annotations

import torch
from multiwrite.backends.triton_cuda import _cuda_device_reasons, _TritonBackend, pinned_memory_reasons

from multiwrite import Backend, hookimpl


class TritonRocmBackend(_TritonBackend):
    """One Triton launch per apply and dtype on AMD GPUs (ROCm build of torch).

    Compiled and interpreted in CI only; see the module docstring for what was and was not verified.
    """

    NAME = "triton-rocm"

    def _gpu_reasons(self, device: torch.device) -> list[str]:
        hip = getattr(torch.version, "hip", None)
        if not hip:
            return [f"not a HIP build of torch (torch.version.hip={hip})"]
        return _cuda_device_reasons(device) + pinned_memory_reasons()

    def _launch_params(self, device: torch.device):
        from multiwrite.backends.triton_kernel import rocm_launch_params

        if device.type == "cpu":  # interpreter: use the CDNA parameters
            return rocm_launch_params(64)
        props = torch.cuda.get_device_properties(device)
        return rocm_launch_params(int(getattr(props, "warp_size", 64)))


_BACKEND = TritonRocmBackend()


@hookimpl
def multiwrite_backends() -> list[Backend]:
    """The `triton-rocm` backend (a module-level singleton)."""
    return [_BACKEND]

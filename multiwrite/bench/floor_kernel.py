"""The empty Triton kernel whose launch is the GPU floor of `multiwrite bench` (imports Triton)."""

import triton


@triton.jit
def empty_kernel(ptr):
    """Does nothing: launching it costs only the launch."""
    pass

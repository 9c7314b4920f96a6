"""`bind_fast_launcher`, shared by the apply writer and the fused stage launcher: which candidate it binds,
what it passes to Triton's launchers, and that a candidate failing its validation launch is never used.
Driven with stand-ins for a compiled kernel (no GPU is needed to check the binding logic)."""

from __future__ import annotations

import pytest
import torch

triton_kernel = pytest.importorskip("multiwrite.backends.triton_kernel")
CUDA = torch.device("cuda", 0)


class _Run:
    """A stand-in for `CompiledKernel.run` with the Triton 3.6 C-launcher attributes."""

    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self):
        self.calls = []

    def __call__(self, *a):
        self.calls.append(("run", a))

    def launch(self, *a):
        self.calls.append(("launch", a))


class _Kernel:
    def __init__(self):
        self.run, self.function, self.packed_metadata = _Run(), "fn", "meta"


def test_the_c_launcher_is_bound_first_and_gets_grid_stream_and_arguments():
    k = _Kernel()
    fire, path = triton_kernel.bind_fast_launcher(k, ("C",), CUDA, "auto", lambda f: None)
    assert path.startswith("c-launcher (triton ")
    fire(3, 2, 77, (10, 11))
    kind, args = k.run.calls[-1]
    assert kind == "launch" and args[:5] == (3, 2, 1, 77, "fn") and args[-3:] == (10, 11, "C")


def test_a_candidate_failing_validation_is_skipped_with_its_reason():
    k = _Kernel()

    def validate(f):
        f(1, 1, 0, ())
        if k.run.calls[-1][0] == "launch":
            raise RuntimeError("token never arrived")

    fire, path = triton_kernel.bind_fast_launcher(k, (), CUDA, "auto", validate)
    assert path.startswith("compiled-kernel-run") and "c-launcher: RuntimeError: token never arrived" in path
    fire(4, 1, 9, (5,))
    assert k.run.calls[-1] == ("run", (4, 1, 1, 9, "fn", "meta", None, None, None, 5))


def test_no_c_launcher_unless_auto_and_none_at_all_when_every_candidate_fails():
    k = _Kernel()
    fire, path = triton_kernel.bind_fast_launcher(k, (), CUDA, "run", lambda f: None)
    assert path.startswith("compiled-kernel-run")

    def refuse(f):
        raise RuntimeError("no")

    fire, path = triton_kernel.bind_fast_launcher(_Kernel(), (), CUDA, "auto", refuse)
    assert fire is None and path.startswith("jit (no fast launcher:")

"""How the Triton backends launch (`backends/triton/launcher.py`, white-box: no public face but `launch_paths()`):
how many launches each job costs (`Launcher.launches`: prepare_inputs is ONE launch), which fast launcher is bound
to a compiled kernel (driven with stand-ins for a compiled kernel: no GPU needed) and what it passes to Triton's
launchers, and the launch paths `multiwrite info` reports."""

from __future__ import annotations

import pytest
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite.backends.triton import launcher as launcher_module
from multiwrite.backends.triton.backend import TritonCudaBackend
from multiwrite.backends.triton.kernels import stage as stage_kernel
from multiwrite.backends.triton.launcher import bind_fast_launcher
from multiwrite.capture import simulated_capture

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


class Counts:
    """Launches of each of a device's launchers since the last `delta()`."""

    def __init__(self, backend: TritonCudaBackend):
        self.state = backend.device_state(CPU)
        self.last = self.now()

    def now(self) -> tuple[int, int, int]:
        s = self.state
        return s.apply_launcher.launches, s.stage_launcher.launches, s.consume_launcher.launches

    def delta(self) -> tuple[int, int, int]:
        now = self.now()
        out, self.last = tuple(a - b for a, b in zip(now, self.last)), now
        return out


def test_each_job_costs_the_launches_it_promises():
    """(apply, stage, consume) launches: an apply is one apply launch (none with nothing staged); prepare_inputs is
    ONE stage launch with the writes, or the apply first when a row has more overlap rounds than the stage kernel
    lays over; gather and slot mappings are one stage launch each; a writer's apply is one launch per dtype."""
    backend = TritonCudaBackend()
    count = Counts(backend)
    bt = BlockTables([16, 32], 4, [16, 8], CPU, [16, 16], backend=backend, max_num_batched_tokens=8)
    idx, qsl, pos = torch.tensor([1, 0]), torch.tensor([0, 1, 2]), torch.tensor([0, 0])
    bt.apply_staged_writes()
    assert count.delta() == (0, 0, 0)
    for r in range(2):
        bt.append_block_ids(r, ([r + 1], [r + 2]), True)
    bt.apply_staged_writes()
    assert count.delta() == (1, 0, 0)
    bt.append_block_ids(1, ([5], [6]), False)
    bt.prepare_inputs(idx, qsl, pos, 2, 2)
    assert count.delta() == (0, 1, 0)
    bt.prepare_inputs(idx, qsl, pos, 2, 2)  # nothing staged: the stage alone
    assert count.delta() == (0, 1, 0)
    for i in range(int(stage_kernel.MAX_ROUNDS) + 1):
        bt.append_block_ids(0, ([i + 1], [7] if i == 0 else []), i == 0)
    bt.prepare_inputs(idx, qsl, pos, 2, 2)
    assert count.delta() == (1, 1, 0)
    bt.gather_block_tables(idx, 2)
    bt.compute_slot_mappings(idx, qsl, pos, 2)
    assert count.delta() == (0, 2, 0)
    tables = [StagedWriteTensor((2, 3), dtype, CPU) for dtype in (torch.int32, torch.int64, torch.float32)]
    for t in tables:
        t.stage_write(1, 0, [1, 2])
    FusedStagedWriter(CPU, backend=backend).apply(tables)
    assert count.delta() == (3, 0, 0)


def test_graph_mode_jobs_cost_the_launches_they_promise():
    backend = TritonCudaBackend()
    bt = BlockTables([16], 4, [8], CPU, backend=backend, cuda_graphs=True, max_num_batched_tokens=8)
    count = Counts(backend)
    idx, qsl, pos = torch.tensor([1]), torch.tensor([0, 0]), torch.tensor([0])  # (no token: nothing to check)
    with simulated_capture() as graph:
        bt.prepare_inputs(idx, qsl, pos, 1, 1)  # recorded: the consume launch, then the stage launch
    assert count.delta() == (0, 1, 1) and len(graph.launches) == 2
    bt.append_block_ids(1, ([3],), True)
    bt.commit_staged_writes()  # host work only
    assert count.delta() == (0, 0, 0)
    graph.replay()
    bt.append_block_ids(1, ([4],), False)
    bt.apply_staged_writes()  # eager: one consume launch applies every published batch
    assert count.delta() == (0, 0, 1)
    bt.apply_staged_writes()  # nothing staged, nothing new published: no launch
    assert count.delta() == (0, 0, 0)


def test_the_launch_paths_under_the_interpreter():
    backend = TritonCudaBackend()
    assert backend.launch_paths() == ""  # nothing launched yet
    t = StagedWriteTensor((2, 3), torch.int32, CPU)
    t.stage_write(0, 0, [1])
    FusedStagedWriter(CPU, backend=backend).apply([t])
    assert backend.launch_paths() == "cpu: apply interpreter, stage interpreter"


class _Run:
    """A stand-in for `CompiledKernel.run` with the C-launcher attributes of Triton 3.6 (`annotations`: of 3.9)."""

    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self, annotations: bool = False):
        self.calls: list[tuple[str, tuple]] = []
        if annotations:
            self.arg_annotations, self.kernel_signature = "ann", "sig"

    def __call__(self, *a):
        self.calls.append(("run", a))

    def launch(self, *a):
        self.calls.append(("launch", a))


class _Kernel:
    def __init__(self, annotations: bool = False):
        self.run, self.function, self.packed_metadata = _Run(annotations), "fn", "meta"


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python-twin"])
def test_the_c_launcher_is_bound_first_with_each_triton_calling_convention(compiled, monkeypatch):
    if compiled and launcher_module._cstaging is None:
        pytest.skip("the compiled staging helper is not built")
    if not compiled:
        monkeypatch.setattr(launcher_module, "_cstaging", None)
    k36 = _Kernel()
    fire, path = bind_fast_launcher(k36, ("C",), CUDA, "auto", lambda f: None)
    assert path.startswith("c-launcher (triton ")
    fire(3, 2, 77, (10, 11))
    kind, args = k36.run.calls[-1]
    assert kind == "launch" and args[:5] == (3, 2, 1, 77, "fn") and args[-3:] == (10, 11, "C")
    k39 = _Kernel(annotations=True)
    fire, _ = bind_fast_launcher(k39, ("C",), CUDA, "auto", lambda f: None)
    fire(3, 2, 77, (10, 11))
    kind, args = k39.run.calls[-1]
    assert kind == "launch" and args[:5] == (3, 2, 1, 77, "fn") and args[-3:] == ("ann", "sig", (10, 11, "C"))
    assert len(args) == 16 and args[5:8] == (False, False, "meta")  # cooperative, pdl, the metadata, hooks...
    assert (type(fire).__name__ == "FastLaunch") is compiled


def test_the_compiled_launch_refuses_a_call_it_cannot_pass_on():
    if launcher_module._cstaging is None:
        pytest.skip("the compiled staging helper is not built")
    fire = launcher_module.c_launcher(_Run().launch, ("fn",), (), False)
    with pytest.raises(TypeError, match="four positional arguments"):
        fire(1, 1, 0)
    with pytest.raises(TypeError, match="args a tuple"):
        fire(1, 1, 0, [5])
    with pytest.raises(TypeError, match="not initialized"):
        type(fire).__new__(type(fire))(1, 1, 0, ())
    # a long argument list (past the C stack's 64) and an error of the launcher pass through unchanged
    run = _Run()
    fire = launcher_module.c_launcher(run.launch, tuple(range(40)), tuple(range(30)), False)
    fire(1, 2, 3, tuple(range(10)))
    assert run.calls[-1] == ("launch", (1, 2, 1, 3, *range(40), *range(10), *range(30)))

    def failing(*a):
        raise ValueError("launch failed")

    with pytest.raises(ValueError, match="launch failed"):
        launcher_module.c_launcher(failing, (), (), True)(1, 1, 0, ())


def test_a_candidate_failing_its_validation_launch_is_skipped_with_its_reason():
    k = _Kernel()

    def validate(fire):
        fire(1, 1, 0, ())
        if k.run.calls[-1][0] == "launch":
            raise RuntimeError("token never arrived")

    fire, path = bind_fast_launcher(k, (), CUDA, "auto", validate)
    assert path.startswith("compiled-kernel-run") and "c-launcher: RuntimeError: token never arrived" in path
    fire(4, 1, 9, (5,))
    assert k.run.calls[-1] == ("run", (4, 1, 1, 9, "fn", "meta", None, None, None, 5))


@pytest.mark.parametrize("mode", ["run", "auto"])
def test_no_c_launcher_unless_auto_and_the_jit_when_every_candidate_fails(mode):
    fire, path = bind_fast_launcher(_Kernel(), (), CUDA, mode, lambda f: None)
    assert path.startswith("c-launcher" if mode == "auto" else "compiled-kernel-run")

    def refuse(fire):
        raise RuntimeError("no")

    fire, path = bind_fast_launcher(_Kernel(), (), CUDA, mode, refuse)
    assert fire is None and path.startswith("jit (no fast launcher:")


def test_a_variant_key_names_one_set_of_constexprs_across_every_table_on_a_device(monkeypatch):
    """A device's launchers are shared by every table on it, and a fast launcher is bound per variant key: so the
    key must determine every compile-time constant. Tables with and without context parallelism, with and without
    staged writes, through every launcher: no key is ever launched with two different sets of constexprs (a key
    without CP_SIZE once ran a cp_size=4 table's stage with the cp_size=1 kernel on an H200)."""
    from multiwrite.backends.triton.launcher import Launcher

    seen: dict[tuple, dict] = {}
    original = Launcher.launch

    def recording(self, variant, consts, *args, **kwargs):
        assert seen.setdefault((id(self), variant), dict(consts)) == consts, (variant, seen[(id(self), variant)])
        return original(self, variant, consts, *args, **kwargs)

    monkeypatch.setattr(Launcher, "launch", recording)
    backend = TritonCudaBackend()
    i32 = torch.int32
    for cp_size, cp_interleave in ((1, 1), (4, 2), (2, 4)):
        bt = BlockTables([16], 2, [4], CPU, backend=backend, max_num_batched_tokens=8, cp_size=cp_size,
                         cp_rank=cp_size - 1, cp_interleave=cp_interleave)  # fmt: skip
        for staged in (True, False):  # with the staged writes, then without
            if staged:
                bt.append_block_ids(0, [[3]], True)
            bt.prepare_inputs(torch.zeros(1, dtype=i32), torch.tensor([0, 4], dtype=i32), torch.arange(4), 1, 8)
    assert len({v for _, v in seen}) >= 6, seen.keys()  # (every table compiled variants of its own)

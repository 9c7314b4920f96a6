"""On a real GPU: the bench's vLLM 0.33 anchor on vLLM's CUDA path. `multiwrite.vllm.upstream.cuda_view_of_pinned`
(the stand-in for vLLM's compiled `get_cuda_view_from_cpu_tensor`) gives a CUDA tensor that reads what the host
wrote into the pinned memory and whose device writes land there; vLLM's own `BlockTables` built by the bench takes
its UVA buffers, and its outputs equal `multiwrite.vllm.BlockTables`' step after step, on 3 and 20 groups.
vLLM's files are needed for the second test (`MULTIWRITE_VLLM_WHEEL` or `MULTIWRITE_VLLM_SRC`, as tests/vllm)."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
import torch

from multiwrite.vllm import upstream


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_the_cuda_view_reads_and_writes_the_pinned_memory(device, dtype):
    host = torch.zeros(6, 5, dtype=dtype, pin_memory=True)
    view = upstream.cuda_view_of_pinned(host)
    assert view.device.type == "cuda" and view.dtype == dtype and view.shape == (6, 5)
    assert view.data_ptr() == host.data_ptr()  # the same memory: pinned memory's device address under UVA
    want = torch.arange(30).reshape(6, 5).to(dtype)
    host.copy_(want)
    assert torch.equal(view[2:4].cpu(), want[2:4])  # a device copy of a slice reads what the host wrote
    view[1:3, 1:].add_(100)  # a kernel writes through the view
    torch.cuda.synchronize(device)
    want[1:3, 1:] += 100
    assert torch.equal(host, want)
    strided = host.t()
    assert torch.equal(upstream.cuda_view_of_pinned(strided).cpu(), strided)


def test_the_view_keeps_the_memory_alive_and_the_uva_path_is_found(device):
    view = upstream.cuda_view_of_pinned(torch.full((8,), 7, dtype=torch.int32, pin_memory=True))
    gc.collect()
    torch.empty(8, dtype=torch.int32, pin_memory=True).fill_(-1)  # would reuse freed pinned memory
    assert view.clone().cpu().tolist() == [7] * 8
    assert upstream.uva_path("cuda") == (True, "")


@pytest.fixture
def vllm_modules_restored():
    """The anchor leaves its stand-ins in `sys.modules`: taken out again after the test."""
    before = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "vllm"}
    yield
    for k in [k for k in sys.modules if k.split(".")[0] == "vllm"]:
        del sys.modules[k]
    sys.modules.update(before)


@pytest.mark.parametrize("config", ["G3", "G20"])
def test_the_anchor_runs_vllms_uva_path_and_its_outputs_equal_ours(device, config, vllm_modules_restored):
    if not upstream.configured():
        pytest.skip(upstream.SKIP_REASON)
    from multiwrite.bench.groups import STAGE_CONFIGS
    from multiwrite.bench.stage_designs import StepBuffers, Vllm033, VllmThreeCalls
    from multiwrite.bench.variants import compare
    from multiwrite.workload import TOKEN_BUDGET, load_trace, replay_schedule
    from tests.support.processes import SMALL_TRACE

    c = 40
    anchor, ours = Vllm033(device, None, c, TOKEN_BUDGET, config), VllmThreeCalls(device, None, c, TOKEN_BUDGET, config)
    assert (anchor.path, anchor.why, anchor.label) == ("uva", "", "vllm-0.33-uva")
    assert anchor.vbt.num_blocks.pool._buffer_cls.__name__ == "UvaBuffer"  # vLLM's own choice of buffer (read only)
    assert anchor.vbt.num_blocks.gpu.device.type == "cuda"
    x = StepBuffers(device, c, TOKEN_BUDGET)
    steps = 0
    for step in replay_schedule(load_trace(SMALL_TRACE), STAGE_CONFIGS[config][0], c, 40):
        x.load(step)
        for design in (anchor, ours):
            design.stage(design.prepare(step.calls))
            design.run(x)
        torch.cuda.synchronize(device)
        (g_a, s_a), (g_o, s_o) = anchor.outputs(x), ours.outputs(x)
        assert torch.equal(s_a, s_o), steps
        counts = ours.bt.num_blocks[:, x.idx.cpu().numpy()]
        for g, (a, o) in enumerate(zip(g_a, g_o)):
            defined = torch.from_numpy(np.arange(a.shape[1])[None, :] < counts[g][:, None]).to(device)
            assert torch.equal(a[defined], o[defined]), (steps, g)
        steps += 1
    assert steps > 10
    mine = ours.snapshot()
    assert compare(anchor.snapshot(), mine) is None

"""The `vllm-0.33` anchor of `bench --stage` and `bench --model` (vLLM 0.33's own `BlockTables`, loaded by
`multiwrite.vllm.upstream`): which of vLLM's two buffer paths it is built on (UVA on CUDA, vLLM's fallback
elsewhere), the stand-in for vLLM's compiled CUDA-view op, and the reports naming the path. On CPU; the UVA path
itself runs in tests/gpu/test_vllm_uva.py."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from multiwrite.bench.model import PRESETS
from multiwrite.bench.model_report import model_csv_rows, model_lines
from multiwrite.bench.model_step import ModelResult
from multiwrite.bench.report import format_table
from multiwrite.bench.stage import PATHS, StageResult, stage_csv_rows, stage_lines
from multiwrite.vllm import upstream


def test_the_stand_ins_take_vllms_uva_path_only_when_asked():
    uva = upstream.stand_in_modules("cuda", uva=True)
    assert uva["vllm.utils.platform_utils"].is_uva_available() is True
    assert uva["vllm.utils.torch_utils"].get_accelerator_view_from_cpu_tensor is upstream.cuda_view_of_pinned
    plain = upstream.stand_in_modules("cpu")
    assert plain["vllm.utils.platform_utils"].is_uva_available() is False
    with pytest.raises(RuntimeError, match="no UVA"):
        plain["vllm.utils.torch_utils"].get_accelerator_view_from_cpu_tensor(torch.zeros(2))
    h2d = plain["vllm.utils.torch_utils"].async_tensor_h2d
    assert h2d([1, 2, 3], device="cpu", dtype=torch.int32).tolist() == [1, 2, 3]
    out = torch.zeros(3, dtype=torch.int64)
    assert h2d(np.array([4, 5, 6]), out=out) is out and out.tolist() == [4, 5, 6]


def test_the_uva_path_is_for_cuda_devices_and_a_view_needs_pinned_memory():
    ok, why = upstream.uva_path("cpu")
    assert not ok and why == "vLLM's UVA buffers are for CUDA and ROCm devices, not cpu"
    with pytest.raises(ValueError, match=r"a CUDA view needs a pinned CPU tensor; got one on cpu, pinned: False"):
        upstream.cuda_view_of_pinned(torch.zeros(4, dtype=torch.int32))


def test_the_view_describes_the_tensors_own_memory_with_byte_strides():
    """The interface torch builds the CUDA view from: the tensor's address, shape, strides in bytes (a transposed
    int64 view: 8 and 24 bytes, not elements) and dtype."""
    t = torch.arange(12, dtype=torch.int64).reshape(4, 3).t()
    cai = upstream._PinnedHostMemory(t).__cuda_array_interface__
    assert cai == {"shape": (3, 4), "strides": (8, 24), "typestr": "<i8", "data": (t.data_ptr(), False), "version": 3}
    assert upstream._PinnedHostMemory(torch.zeros(2, dtype=torch.float32)).__cuda_array_interface__["typestr"] == "<f4"


def _row(path: str, **more) -> dict:
    label = f"vllm-0.33-{path}" if path else "ours"
    return {"config": "G3", "C": 40, "variant": label[:9] if path else "ours", "label": label, "path": path,
            "launches": "3", "steps": 5, "writes_per_step": 2.0, "step_us": 30.0, "step_p99_us": 40.0,
            "empty_us": 10.0, "step_x_empty": 3.0, "mismatch": "", **more}  # fmt: skip


def test_the_stage_report_and_csv_name_the_path_the_anchor_ran():
    r = StageResult(rows=[_row(""), _row("uva")], floor="floor-triton")
    text = "\n".join(stage_lines(r, True, format_table))
    table = [line.split() for line in text.splitlines() if line.startswith("  40 ")]
    assert [row[1] for row in table] == ["ours", "vllm-0.33-uva"]
    assert " ".join(PATHS.split()) in " ".join(text.split())
    variants = {x["variant"] for x in stage_csv_rows(r, {})}
    assert variants == {"stage-ours", "stage-vllm-0.33-uva"}
    r.rows[1] = _row("fallback", mismatch="group 0 gathered[0, 0] = 1, reference 2")
    assert r.failures() == ["stage vllm-0.33-fallback G3 C=40: group 0 gathered[0, 0] = 1, reference 2"]


def test_the_model_report_and_csv_name_the_path_the_anchor_ran():
    r = ModelResult(PRESETS["tiny"], "bfloat16", attention="flex-paged")
    r.steps.append({"C": 40, "steps": 5, "batch": 40.0, "ctx": 100.0, "eager_wall_us": 990.0, "eager_host_us": 900.0,
                    "replay_host_us": 5.0, "graph_device_us": 985.0, "mismatch": ""})  # fmt: skip
    r.rows.append({"C": 40, "variant": "vllm-0.33", "label": "vllm-0.33-uva", "path": "uva", "launches": "3",
                   "mismatch": "", "stage_us": 10.0, "stage_p99_us": 12.0, "n": 5, "behind_n": 0})  # fmt: skip
    text = "\n".join(model_lines(r, format_table))
    assert any(line.split()[:2] == ["40", "vllm-0.33-uva"] for line in text.splitlines())
    assert "vllm-0.33-uva: vLLM's CUDA path" in text
    assert {x["variant"] for x in model_csv_rows(r, {})} == {"model", "model-vllm-0.33-uva"}


@pytest.fixture
def vllm_modules_restored():
    """The anchor leaves its stand-ins in `sys.modules` (a process that keeps using vLLM's class): taken out again
    after the test, so that no later test finds a `vllm` package."""
    before = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "vllm"}
    yield
    for k in [k for k in sys.modules if k.split(".")[0] == "vllm"]:
        del sys.modules[k]
    sys.modules.update(before)


def test_off_a_gpu_the_anchor_is_built_on_vllms_fallback_and_says_so(vllm_modules_restored, auto_selection):
    if not upstream.configured():
        pytest.skip(upstream.SKIP_REASON)
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":  # (a GPU machine: tests/conftest.py leaves the interpreter off)
        pytest.skip("vLLM's Triton kernels run on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1)")
    from multiwrite.bench.stage_designs import Ours, StepBuffers, Vllm033
    from multiwrite.workload import ScheduledStep

    anchor = upstream.load_vllm_anchor("cpu")
    assert (anchor.path, anchor.why) == ("fallback", "vLLM's UVA buffers are for CUDA and ROCm devices, not cpu")
    cpu = torch.device("cpu")
    vllm, ours = Vllm033(cpu, None, 4, 32, "G2"), Ours(cpu, None, 4, 32, "G2")
    assert (vllm.label, ours.label) == ("vllm-0.33-fallback", "ours")
    assert "its buffers on its fallback path" in vllm.launch_path()
    calls = [(2, [[3, 4], [5, 6]], True)]  # row 2: a prompt of 17 tokens, two blocks of 16 in each group
    x = StepBuffers(cpu, 4, 32)
    x.load(ScheduledStep(calls, [2], [0], [17]))
    for design in (vllm, ours):
        design.stage(design.prepare(calls))
        design.run(x)
    (g_v, s_v), (g_o, s_o) = vllm.outputs(x), ours.outputs(x)
    assert [t[:, :2].tolist() for t in g_v] == [t[:, :2].tolist() for t in g_o] == [[[3, 4]], [[5, 6]]]
    assert torch.equal(s_v, s_o) and s_v[:, -1].tolist() == [4 * 16, 6 * 16]  # token 16: the second block's first

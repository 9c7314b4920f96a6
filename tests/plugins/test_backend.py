"""The plugin contract's base class `Backend`: the reasons its default checks give (each naming the value found and what
is accepted), the priorities of the built-ins that third-party priorities are chosen against, and graph mode, which a
backend opts into with `Backend.graph_plan` (a `GraphPlan` implementing `consume` and `record_stage`): tables asking for
it from a backend without a working one are refused at construction, naming the backend."""

from __future__ import annotations

import pytest
import torch

from multiwrite import Backend, BackendUnavailableError, BlockTables, GraphPlan, available_backends, select_backend
from multiwrite.plugins.backend import PRIORITY_BUILTIN_CPU, PRIORITY_BUILTIN_GPU, PRIORITY_FALLBACK


class Plain(Backend):
    NAME = "plain"
    SUPPORTED_DEVICE_TYPES = frozenset({"cuda", "cpu", "xpu"})

    def apply(self, batches):
        select_backend("cpu", "torch-cpu").apply(batches)


class IntsOnly(Plain):
    NAME = "ints-only"
    SUPPORTED_DTYPES = frozenset({torch.int32, torch.int64})


def test_the_default_checks_name_the_value_found_and_what_is_accepted():
    cpu, mps = torch.device("cpu"), torch.device("mps")
    assert Plain().not_supported_reasons(cpu) == []
    assert Plain().not_supported_reasons(cpu, [torch.int32, torch.float32]) == []
    assert Plain().not_supported_reasons(mps, [torch.float16, torch.bfloat16]) == [
        "device type mps (supported: cpu, cuda, xpu)",
        "dtype=float16 (supported: float32, int32, int64)",
        "dtype=bfloat16 (supported: float32, int32, int64)",
    ]
    assert IntsOnly().not_supported_reasons(cpu, [torch.int64, torch.float32]) == [
        "dtype=float32 (supported: int32, int64)"
    ]


def test_priority_defaults_to_the_class_priority_and_the_builtins_rank_as_documented():
    class Ranked(Plain):
        PRIORITY = 60

    assert Ranked().priority(torch.device("xpu")) == 60 and Plain().priority(torch.device("cpu")) == 0
    assert (PRIORITY_FALLBACK, PRIORITY_BUILTIN_CPU, PRIORITY_BUILTIN_GPU) == (-100, 0, 100)
    cpu = {s.name: s.priority for s in available_backends("cpu") if s.distribution == "multiwrite"}
    assert {n: cpu[n] for n in ("torch-generic", "torch-cpu", "compiled-cpu")} == {
        "torch-generic": -100, "torch-cpu": 0, "compiled-cpu": 10,
    }  # fmt: skip
    for name in ("triton-cuda", "triton-rocm"):
        triton = next(s.backend for s in available_backends("cpu") if s.name == name)
        assert triton.priority(torch.device("cuda", 0)) == PRIORITY_BUILTIN_GPU  # (on CPU: test_gpu_detection.py)


class NoConsume(GraphPlan):
    """A graph plan that implements neither job."""


class NoRecordStage(GraphPlan):
    """A graph plan whose consume works (it applies eagerly) but which cannot record a stage."""

    def consume(self, ring, limit):
        if self.arena.num_writes:
            self.apply()


class GraphBackend(Plain):
    NAME = "half-graph"
    PLAN: type[GraphPlan] | None = None

    def graph_plan(self, layout, arena):
        return None if self.PLAN is None else self.PLAN(self, layout, arena)


GRAPH_PLANS = [
    pytest.param(None, id="no-graph-plan"),
    pytest.param(NoConsume, id="plan-without-consume"),
    pytest.param(NoRecordStage, id="plan-without-record-stage"),
]  # fmt: skip


@pytest.mark.parametrize("plan", GRAPH_PLANS)
def test_graph_mode_is_refused_at_construction_without_a_working_graph_plan(plan):
    backend = GraphBackend()
    backend.PLAN = plan
    with pytest.raises(BackendUnavailableError) as info:
        BlockTables([16], 4, [4], "cpu", backend=backend, cuda_graphs=True, max_num_batched_tokens=8)
    message = str(info.value)
    assert "BlockTables(cuda_graphs=True)" in message and "'half-graph'" in message, message
    assert (plan.__name__ if plan is not None else "has no graph mode (Backend.graph_plan)") in message, message
    BlockTables([16], 4, [4], "cpu", backend=backend)  # without graph mode, the same backend serves

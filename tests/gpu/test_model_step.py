"""On a real GPU: the model-step bench and the decode example with FlexAttention compiled, at the tiny size. The
bench runs every design (graph mode and the anchor included), captures the step in a CUDA graph and passes its
checks; a planted wrong slot or block id fails them, as on CPU."""

from __future__ import annotations

import dataclasses
import math

import torch

from multiwrite.bench.model import PRESETS
from multiwrite.bench.model_step import measure_model
from multiwrite.bench.paged_attention import PagedAttention
from multiwrite.workload import load_trace
from tests.support.example_scripts import load_example
from tests.support.processes import SMALL_TRACE


def _measure(device, tamper=None):
    with torch.no_grad():
        return measure_model(load_trace(SMALL_TRACE), device, None, PRESETS["tiny"], 12, 0, [40], "auto",
                             lambda n: None, tamper=tamper)  # fmt: skip


def test_the_bench_runs_every_design_captures_the_step_and_passes_its_checks(device):
    r = _measure(device)
    assert r.failures() == [] and r.fallback == "" and r.attention == "flex-paged (compiled)"
    assert {d["variant"] for d in r.rows} >= {"ours", "graph-mode", "vllm-3-calls", "anchor-3"}
    (s,) = r.steps
    assert s["steps"] == 11 and math.isfinite(s["graph_device_us"]) and s["graph_device_us"] > 0
    assert all(d["behind_n"] > 0 and math.isfinite(d["exposed_us"]) for d in r.rows)


def test_a_wrong_slot_and_a_wrong_block_id_fail_the_bench_on_the_gpu(device):
    def wrong_slot(step, gathered, slots):
        slots[0] = slots[1]

    def wrong_block(step, gathered, slots):
        gathered[0, 0] += 1

    assert any("its K/V is not at slot" in f for f in _measure(device, wrong_slot).failures())
    assert any("attention relative error" in f for f in _measure(device, wrong_block).failures())


def test_the_example_matches_dense_attention_with_flex_attention_compiled(device):
    example = load_example("paged_decode", "paged_decode_gpu")
    size = dataclasses.replace(example.SIZES["tiny"], steps=12)
    attention = PagedAttention("flex-paged", compile=True)
    with torch.no_grad():
        r = example.run(size, device, attention, load_trace())
        assert r.worst < size.tolerance and r.misplaced == 0 and r.checked == 355

        def wrong_block(step, gathered, slots):
            if step == 5:
                gathered[0, 0] += 1

        bad = example.run(size, device, attention, load_trace(), wrong_block)
    assert bad.worst > 100 * size.tolerance

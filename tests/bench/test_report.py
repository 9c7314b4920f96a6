"""What `multiwrite bench` reports, from results built by hand (so that the GPU branches run on a machine without a
GPU): the first mismatching cell of a verification, aligned tables, the goals of BENCHMARKS.md judged with their
ratios, CSV rows, the plot, the stage goals and the launch part's failures. Bench-internal modules are the subject
here (`multiwrite.bench.*`): there is no other face to these reports than a full run on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from multiwrite.bench.launch import LaunchResult
from multiwrite.bench.report import csv_rows, format_table, goal_lines, terminal_report
from multiwrite.bench.runner import BenchResult, BurstResult, ConfigResult, Stats, VariantResult
from multiwrite.bench.stage import StageResult, stage_goal_lines
from multiwrite.bench.variants import Mismatch, Snapshot, compare
from multiwrite.reference import ReferenceBlockTables


def test_a_verification_counts_the_cells_that_differ_and_names_the_first():
    ref = ReferenceBlockTables([16, 32], 2, [3, 3], [16, 16])
    ref.append_block_ids(1, [[5], [7]], True)
    good = Snapshot([t.copy() for t in ref.tables], ref.num_blocks.copy(), ref.num_blocks.copy())
    assert compare(good, ref) is None
    bad = Snapshot([t.copy() for t in ref.tables], ref.num_blocks.copy(), np.zeros_like(ref.num_blocks))
    bad.tables[1][1, 1] = 0  # kernel ids 14, 15 of block 7: the second is lost
    assert compare(bad, ref) == Mismatch(3, "group 1 table[1, 1] = 0, reference 15")  # + 2 device counts
    short = Snapshot([ref.tables[0].copy(), ref.tables[1][:, :4].copy()], ref.num_blocks.copy(), ref.num_blocks.copy())
    assert compare(short, ref) == Mismatch(12, "group 1 table: shape (2, 4), reference (2, 6)")


def test_tables_align_every_column():
    lines = format_table(["config", "C", "fused"], [["G1", "40", "1.5 (2.0)"], ["G3", "256", "10.25 (12.0)"]])
    assert lines == [
        "  config    C         fused",
        "  ------  ---  ------------",
        "  G1       40     1.5 (2.0)",
        "  G3      256  10.25 (12.0)",
    ]


def _fake_gpu_result() -> BenchResult:
    """A made-up GPU run: fused 12 us per apply against a 10 us empty launch."""
    env = {"multiwrite": "0", "torch": "t", "triton": "tr", "numpy": "n", "python": "p", "device": "cuda:0"}
    result = BenchResult("2026-11-29T00:00:00+00:00", {**env, "device_name": "H", "torch_threads": "8"}, "b", "x", 9, 1)
    for config, c in (("G1", 40), ("G3", 40)):
        cr = ConfigResult(config, c, 9, 5.0, floor="floor-triton")
        for name, t in (("fused", 12.0), ("per-group", 30.0), ("naive", 60.0)):
            cr.variants[name] = VariantResult(
                name, Stats(t + 3, t + 9, 8), Stats(t, t + 5, 8), Stats(4.0, 6.0, 8), True
            )
        for name, t in (("floor-triton", 10.0), ("floor-torch", 6.0)):
            cr.variants[name] = VariantResult(name, None, Stats(t, t + 1, 8), Stats(2.0, 3.0, 8))
        result.configs.append(cr)
    result.burst = BurstResult(2, 8, 256, Stats(5, 6, 3), Stats(10, 12, 3), Stats(4, 5, 3), "pinned-h2d-copy", True)
    return result


def test_a_gpu_run_is_judged_against_the_gpu_goals_with_its_ratios():
    result = _fake_gpu_result()
    text = terminal_report(result)
    assert "device time per apply" in text and "floor-triton" in text
    assert "goals (BENCHMARKS.md)" in text and "ANCHORS" not in text
    assert goal_lines(result) == [
        "GPU apply host time <= 1.3x one empty launch (floor-triton): met on 2 of 2 configurations; worst 1.20x "
        "(G1 C=40): met",
        "GPU staging+apply at C=40 G3 = 1.50x one empty launch; goal <= 2x: met",  # step 15 us / floor 10 us
        "GPU device time per fused apply at C=40 G3 (decode-dominated steps; CUDA events, launch latency included) "
        "= 4.0 us; goal <= 5 us: met",
        "GPU prefill burst = 0.40x the pinned-h2d-copy bandwidth; goal >= 0.5x: missed by 1.2x",
        "CPU goals: not measured on a GPU run",
    ]
    rows = csv_rows(result)
    assert {r["metric"] for r in rows} == {"step_us", "apply_us", "device_us", "burst_stage_us", "burst_apply_us",
                                           "burst_copy_us"}  # fmt: skip
    assert {r["verified"] for r in rows if r["variant"].startswith("floor")} == {"n/a"}
    assert {r["verified"] for r in rows if r["variant"] in ("fused", "per-group", "naive")} == {"true"}
    device = [r for r in rows if r["metric"] == "device_us" and r["variant"] == "fused" and r["config"] == "G3"]
    assert [(r["median_us"], r["p99_us"], r["n"]) for r in device] == [("4.000", "6.000", "8")]


def test_the_plot_of_a_gpu_run_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from multiwrite.bench.plot import write_plot

    write_plot(_fake_gpu_result(), tmp_path / "gpu.png")
    assert (tmp_path / "gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_stage_goals_judge_each_design_per_concurrency_or_say_it_was_not_in_the_run():
    def row(variant, c, x, config="G3"):
        return {"variant": variant, "C": c, "step_x_empty": x, "config": config}

    r = StageResult(rows=[row("ours", 40, 1.5), row("ours-batched", 256, 2.5), row("graph-mode-batched", 40, 0.31),
                          row("graph-mode-batched", 256, 1.2), row("graph-mode", 40, 0.6),
                          row("ours", 256, 9.9, "G20")])  # fmt: skip
    lines = stage_goal_lines(r, gpu=True, interpreted=False)
    assert lines[0] == "GPU ours (prepare_inputs, staging included) at C=40 G3 = 1.50 empty launches; goal <= 2: met"
    assert lines[1] == "GPU ours at C=256 G3 <= 2 empty launches: not in this run"  # (G20's row is no G3 figure)
    assert lines[3] == ("GPU ours-batched (prepare_inputs, batched staging) at C=256 G3 = 2.50 empty launches; goal "
                        "<= 1.2: missed by 2.1x")  # fmt: skip
    assert lines[4] == "GPU vllm-3-calls at C=40 G3 <= 1.5 empty launches: not in this run"
    assert lines[6] == ("GPU graph-mode (a loop of append_block_ids + commit_staged_writes; the replay not counted) at "
                        "C=40 G3 = 0.60 empty launches; goal <= 0.4: missed by 1.5x")  # fmt: skip
    graph = [line for line in lines if "graph-mode-batched (batched staging" in line]
    assert graph[0].endswith("at C=40 G3 = 0.31 empty launches; goal <= 0.5: met")
    assert graph[1].endswith("at C=256 G3 = 1.20 empty launches; goal <= 0.5: missed by 2.4x")
    r.rows.pop(3)
    assert stage_goal_lines(r, gpu=True, interpreted=False)[-1] == (
        "GPU graph-mode-batched at C=256 G3 <= 0.5 empty launches: not in this run"
    )
    assert all(line.endswith("not measured on this run") for line in stage_goal_lines(r, gpu=True, interpreted=True))


def test_a_launch_run_that_differs_from_the_reference_fails_the_bench():
    rows = [{"launcher": v, "config": "G1", "C": 3, "mismatches": m} for v, m in (("auto", 0), ("run", 5))]
    launch = LaunchResult(same_loop=rows)
    assert launch.failures() == ["launch run G1 C=3: 5 cells differ"]
    result = _fake_gpu_result()
    result.launch = launch
    assert result.failures() == ["launch run G1 C=3: 5 cells differ"]

"""`multiwrite bench --quick` on a tiny trace: CSV columns, every variant verified, sane ratios, and a broken
variant caught. Timings are never asserted (the goals of BENCHMARKS.md are reported by the bench, not tested)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

import multiwrite
from multiwrite.bench import command as bench
from multiwrite.bench import variants as bench_variants
from multiwrite.bench.report import CSV_COLUMNS, csv_rows, format_table, goal_lines, terminal_report
from multiwrite.bench.runner import BenchResult, BurstResult, ConfigResult, Stats, VariantResult
from multiwrite.bench.variants import Mismatch, Snapshot, compare
from multiwrite.cli import main
from multiwrite.reference import ReferenceBlockTables

SMALL_TRACE = str(Path(__file__).parent / "data" / "small_trace.csv")
# The tiny trace ends after ~20 steps, so no warm-up; a small burst keeps the run to a few seconds.
QUICK = ["bench", "--quick", "--trace", SMALL_TRACE, *"--warmup 0 --no-progress".split()]
QUICK += "--burst-requests 4 --burst-ids 16 --burst-reps 2".split()
VERIFIED_VARIANTS = {"fused", "per-group", "naive"}


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_quick_bench_writes_verified_rows_and_finite_ratios(tmp_path, capsys):
    out_csv = tmp_path / "bench.csv"
    argv = [*QUICK, "--csv", str(out_csv)]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(tmp_path / "bench.png")]
    except ImportError:
        pass
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "verification: OK" in printed and "ratios of medians" in printed and "goals" in printed

    columns, rows = _read(out_csv)
    assert tuple(columns) == CSV_COLUMNS
    configs = {(r["config"], int(r["concurrency"])) for r in rows if r["metric"] == "apply_us"}
    assert configs == {(g, c) for g in ("G1", "G3") for c in (40, 256)}
    assert all(r["timestamp"] and r["torch_version"] and r["device_name"] and r["multiwrite_version"] for r in rows)
    variant_rows = [r for r in rows if r["variant"] in VERIFIED_VARIANTS]
    assert {r["variant"] for r in variant_rows} == VERIFIED_VARIANTS
    assert all(r["verified"] == "true" for r in variant_rows)
    assert any(r["variant"].startswith("floor") for r in rows)
    burst = [r for r in rows if r["config"] == "burst-G3"]
    assert {r["metric"] for r in burst} == {"burst_stage_us", "burst_apply_us", "burst_copy_us"}
    assert all(int(r["bytes"]) == 4 * 16 * (1 + 2 + 1) * 4 for r in burst)  # requests x ids x sum(k) x 4 bytes

    median = {(r["variant"], r["config"], r["concurrency"], r["metric"]): float(r["median_us"]) for r in rows}
    for (variant, config, c, metric), value in median.items():
        if variant != "fused" or metric not in ("step_us", "apply_us"):
            continue
        for other in ("per-group", "naive"):
            ratio = value / median[(other, config, c, metric)]
            assert math.isfinite(ratio) and ratio > 0, (variant, other, config, c, metric)
    if "--plot" in argv:
        assert (tmp_path / "bench.png").stat().st_size > 0


def test_a_dropped_write_fails_the_run(monkeypatch, capsys):
    real = bench_variants.NaiveTables.append_block_ids
    dropped = []

    def drop_first_write(self, req_index, new_block_ids, overwrite):
        if not dropped and any(new_block_ids):
            dropped.append(req_index)
            return
        real(self, req_index, new_block_ids, overwrite)

    monkeypatch.setattr(bench_variants.NaiveTables, "append_block_ids", drop_first_write)
    assert main([*QUICK, "--configs", "G1", "--concurrency", "40", "--burst-reps", "0"]) == 1
    printed = capsys.readouterr().out
    assert "verification: FAILED" in printed and "MISMATCH naive G1 C=40" in printed
    assert "MISMATCH fused" not in printed


@pytest.mark.parametrize(
    "extra", [["--configs", "G9"], ["--steps", "0"], ["--concurrency", "x"], ["--burst-reps", "-1"]]
)
def test_bad_arguments_exit_2(extra, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*QUICK, *extra])
    assert exc.value.code == 2


def test_warmup_that_leaves_no_step_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main([*QUICK, "--steps", "10", "--warmup", "10"])
    assert exc.value.code == 2
    assert "multiwrite bench: error: argument --warmup: 10 warm-up steps leave none" in capsys.readouterr().err


def _no_run(*args, **kwargs):
    raise AssertionError("the run must not start")


@pytest.mark.parametrize(
    ("option", "where", "fragment"),
    [
        ("--csv", "/nonexistent/dir/x.csv", "--csv /nonexistent/dir/x.csv: cannot write there"),
        ("--csv", "{tmp}", "is a directory"),
        ("--plot", "/nonexistent/dir/x.png", "--plot /nonexistent/dir/x.png"),
        ("--plot", "{tmp}/x.notaformat", "--plot"),
    ],
)
def test_unwritable_outputs_exit_2_before_the_run(monkeypatch, capsys, tmp_path, option, where, fragment):
    if option == "--plot":
        pytest.importorskip("matplotlib", reason="--plot needs the plot extra (matplotlib)")
    monkeypatch.setattr(bench, "run_bench", _no_run)
    where = where.format(tmp=tmp_path)
    assert main([*QUICK, option, where]) == 2
    err = capsys.readouterr().err
    assert err.startswith("multiwrite bench: error: ") and fragment.format(tmp=tmp_path) in err
    assert list(tmp_path.iterdir()) == []  # the check leaves nothing behind


def test_bad_device_exits_2_before_the_run(monkeypatch, capsys):
    monkeypatch.setattr(bench, "run_bench", _no_run)
    assert main([*QUICK, "--device", "cudax"]) == 2
    assert "multiwrite bench: error: cannot parse device 'cudax'" in capsys.readouterr().err


def test_writable_csv_is_checked_without_touching_an_existing_file(tmp_path):
    existing = tmp_path / "old.csv"
    existing.write_text("keep me\n")
    assert bench.output_path_problem(str(existing), "--csv") is None
    assert existing.read_text() == "keep me\n"
    assert bench.output_path_problem(str(tmp_path / "new.csv"), "--csv") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.csv"]


def test_interpreted_triton_run_judges_no_goal(capsys):
    statuses = {s.name: s for s in multiwrite.available_backends("cpu")}
    if "triton-cuda" not in statuses or not statuses["triton-cuda"].available:
        pytest.skip("triton-cuda cannot run on CPU here (needs Triton and TRITON_INTERPRET=1)")
    argv = [*QUICK, "--backend", "triton-cuda", "--device", "cpu", "--configs", "G3", "--concurrency", "40"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("multiwrite bench: triton-cuda (through Triton's interpreter) on cpu")
    goals = out[out.index("goals (BENCHMARKS.md)") :]
    assert "not evaluated for interpreted kernels" in goals
    assert "missed by" not in goals and ": met" not in goals


def test_compare_names_the_first_mismatching_cell():
    ref = ReferenceBlockTables([16, 32], 2, [3, 3], [16, 16])
    ref.append_block_ids(1, [[5], [7]], True)
    good = Snapshot([t.copy() for t in ref.tables], ref.num_blocks.copy(), ref.num_blocks.copy())
    assert compare(good, ref) is None
    bad = Snapshot([t.copy() for t in ref.tables], ref.num_blocks.copy(), np.zeros_like(ref.num_blocks))
    bad.tables[1][1, 1] = 0
    assert compare(bad, ref) == Mismatch(3, "group 1 table[1, 1] = 0, reference 15")


def test_format_table_aligns_columns():
    lines = format_table(["config", "C", "fused"], [["G1", "40", "1.5 (2.0)"], ["G3", "256", "10.25 (12.0)"]])
    assert len({len(line) for line in lines}) == 1
    assert lines[2].startswith("  G1 ") and lines[2].endswith(" 1.5 (2.0)")


def _fake_gpu_result() -> BenchResult:
    """A made-up GPU run, so that the GPU branches of the report run on machines without a GPU."""
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


def test_gpu_report_judges_the_gpu_goals():
    result = _fake_gpu_result()
    text = terminal_report(result)
    assert "device time per apply" in text and "floor-triton" in text
    assert "goals (BENCHMARKS.md)" in text and "ANCHORS" not in text
    goals = goal_lines(result)
    assert goals[0].startswith("GPU apply host time <= 1.3x") and "met on 2 of 2" in goals[0]
    assert "= 1.50x one empty launch; goal <= 2x: met" in goals[1]  # step 15 us / floor 10 us
    assert "= 4.0 us; goal <= 5 us: met" in goals[2]
    assert "= 0.40x the pinned-h2d-copy bandwidth; goal >= 0.5x: missed by 1.2x" in goals[3]
    rows = csv_rows(result)
    assert {r["metric"] for r in rows} >= {"step_us", "apply_us", "device_us", "burst_copy_us"}
    assert {r["verified"] for r in rows if r["variant"].startswith("floor")} == {"n/a"}


def test_gpu_plot_draws_both_floors(tmp_path):
    pytest.importorskip("matplotlib")
    from multiwrite.bench.plot import write_plot

    write_plot(_fake_gpu_result(), tmp_path / "gpu.png")
    assert (tmp_path / "gpu.png").stat().st_size > 0


def test_a_burst_that_cannot_fit_in_memory_is_refused_before_the_run(monkeypatch, capsys):
    from multiwrite import cli_args

    monkeypatch.setattr(bench, "run_bench", _no_run)
    monkeypatch.setattr(cli_args, "host_memory_available", lambda: 10**9)  # a machine with 1 GB free
    assert main([*QUICK, "--burst-requests", "1", "--burst-ids", "30000000"]) == 2  # ids fit int32, not memory
    err = capsys.readouterr().err
    assert err.startswith("multiwrite bench: error: --burst-requests 1 --burst-ids 30000000 needs about ")
    assert err.strip().endswith("1.0 GB is available: refused before the run")


def test_a_quick_run_calls_its_goal_verdicts_indicative(capsys):
    assert main([*QUICK, "--configs", "G3", "--concurrency", "40", "--burst-reps", "0"]) == 0
    out = capsys.readouterr().out
    assert "goals (BENCHMARKS.md): INDICATIVE ONLY" in out
    assert "terms:" in out and "C: concurrency" in out and "floor: the cheapest apply" in out


def test_launch_timing_runs_and_checks_every_launch_variant():
    """`--launch`'s measurements on a few steps of the tiny trace (Triton's interpreter on CPU)."""
    import torch

    from multiwrite.bench.launch import LAUNCH_VARIANTS, measure_launch
    from multiwrite.bench.report import launch_lines
    from multiwrite.workload import load_trace

    statuses = {s.name: s for s in multiwrite.available_backends("cpu")}
    if "triton-cuda" not in statuses or not statuses["triton-cuda"].available:
        pytest.skip("triton-cuda cannot run on CPU here (needs Triton and TRITON_INTERPRET=1)")
    result = measure_launch(load_trace(SMALL_TRACE), torch.device("cpu"), 6, 0, [3], 2, (2, 4), lambda n=1: None)
    assert [(r["config"], r["launcher"], r["guard"]) for r in result.same_loop] == [
        (g, *v) for g in ("G1", "G3") for v in LAUNCH_VARIANTS
    ]
    assert all(r["mismatches"] == 0 and r["steps"] >= 1 and r["apply_x_empty"] > 0 for r in result.same_loop)
    assert len(result.tight_loop) == 1 and result.tight_loop[0]["writes"] >= 1
    assert result.device == {}  # no device times off a GPU
    text = "\n".join(launch_lines(result))
    assert "same loop" in text and "tight loop" in text and "not measured off a GPU" in text
    result.same_loop[0]["mismatches"] = 5
    assert result.failures() == ["launch auto/kernel G1 C=3: 5 cells differ"]


def test_stage_part_runs_on_cpu_and_checks_every_design(capsys, monkeypatch):
    """`bench --stage` on CPU: ours and our three calls timed next to the floor, verified; anchors skipped with why."""
    from multiwrite.cli import main
    from multiwrite.dispatch import BACKEND_ENV

    monkeypatch.delenv(BACKEND_ENV, raising=False)  # CPU tables: a GPU backend forced by tox -e cuda cannot run them

    code = main(["bench", "--quick", "--stage", "--device", "cpu", "--configs", "G3", "--concurrency", "40",
                 "--steps", "60", "--warmup", "10", "--burst-reps", "0", "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "stage (--stage)" in out and "anchor-3 and anchor-2 not run" in out
    assert " ours " in out and "ours-3-calls" in out
    # graph mode needs a CUDA graph: not run off a GPU, with why, and its goal line says it was not measured
    assert "graph-mode not run: it replays prepare_inputs captured in a CUDA graph" in out
    assert "graph-mode goal (staging + commit_staged_writes <= 0.5 empty launch per decode step): not measured" in out
    assert "0 (replay)" not in out  # no graph-mode row


def test_anchor_kernels_equal_the_reference_through_the_interpreter():
    """The anchor designs the stage part times on a GPU, run here through the interpreter on a few trace steps,
    their outputs checked as the bench checks them (and a broken copy is caught)."""
    import torch

    if torch.cuda.is_available():  # no interpreter there: the bench runs the anchors on the GPU and verifies them
        pytest.skip("the anchors run through Triton's interpreter only on a machine without CUDA")

    from multiwrite.bench import stage as st
    from multiwrite.reference import ReferenceBlockTables
    from multiwrite.workload import load_trace, max_blocks_per_group, replay_schedule

    bs, kbs = st.CONFIGS[st.STAGE_CONFIG]
    cpu = torch.device("cpu")
    runners = [v(cpu, "torch-cpu", 8, 8192) for v in (st.Anchor3, st.Anchor2, st.Ours)]
    ref = ReferenceBlockTables(bs, 8, max_blocks_per_group(bs), kbs)
    x = st._Inputs(cpu, 8, 8192)
    decode = 0
    for step in replay_schedule(load_trace(), bs, 8, 16):
        x.load(step)
        for r in runners:
            r.stage(step.calls)
            r.run(x)
        for req, ids, overwrite in step.calls:
            ref.append_block_ids(req, ids, overwrite)
        ref.apply_staged_writes()
        for r in runners:
            assert st._check(r, x, ref) == "", r.name
        decode += step.is_decode
    assert decode >= 5
    runners[0].anchor.slot_mappings[0, 0] += 1  # a wrong slot must be reported
    assert "slot_mappings[0, 0]" in st._check(runners[0], x, ref)


def test_stage_goal_lines_judge_graph_mode_against_half_an_empty_launch():
    """The graph-mode goal line: staging + commit per step <= 0.5 empty launch, judged per C from its rows."""
    from multiwrite.bench.stage import StageResult, stage_goal_lines

    def row(variant, c, x):
        return {"variant": variant, "C": c, "step_x_empty": x}

    r = StageResult(rows=[row("ours", 40, 1.5), row("ours-batched", 256, 2.5), row("graph-mode-batched", 40, 0.31),
                          row("graph-mode-batched", 256, 1.2), row("graph-mode", 40, 0.6)])  # fmt: skip
    lines = stage_goal_lines(r, gpu=True, interpreted=False)
    graph = [line for line in lines if "graph-mode-batched (staging" in line]
    assert graph[0].endswith("at C=40 G3 = 0.31 empty launches; goal <= 0.5: met")
    assert graph[1].endswith("at C=256 G3 = 1.20 empty launches; goal <= 0.5: missed by 2.4x")
    assert "GPU graph-mode (staging + commit_staged_writes per step; the replay not counted) at C=40 G3 = 0.60 " in (
        "\n".join(lines)
    )
    assert lines[0] == "GPU ours (prepare_inputs, staging included) at C=40 G3 = 1.50 empty launches; goal <= 2: met"
    assert lines[1] == "GPU ours at C=256 G3 <= 2 empty launches: not in this run"
    assert lines[3] == (
        "GPU ours-batched (prepare_inputs, staging included) at C=256 G3 = 2.50 empty launches; goal <= 2: "
        "missed by 1.2x"
    )
    r.rows.pop(3)
    assert stage_goal_lines(r, gpu=True, interpreted=False)[-1] == (
        "GPU graph-mode-batched at C=256 G3 <= 0.5 empty launches: not in this run"
    )

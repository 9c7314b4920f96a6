"""`multiwrite bench` end to end on the small trace: a quick run's CSV, plot and verified rows; a wrong design failing
the run (exit 1) and named; what is refused before the run (exit 2, one line); the parts `--stage` and `--launch` on
CPU (the Triton kernels through Triton's interpreter). Timings are never asserted: the goals of BENCHMARKS.md are
reported by the bench, not tested."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from multiwrite import Backend, WriteBatch, available_backends, select_backend
from multiwrite.bench.report import CSV_COLUMNS
from multiwrite.cli import main
from multiwrite.plugins.dispatch import BACKEND_ENV
from tests.support.processes import SMALL_TRACE, one_line_error

# The tiny trace ends after ~20 steps, so no warm-up; a small burst keeps the run to a second.
QUICK = ["bench", "--quick", "--trace", SMALL_TRACE, "--warmup", "0", "--no-progress", "--device", "cpu"]
SMALL_BURST = ["--burst-requests", "4", "--burst-ids", "16", "--burst-reps", "2"]
ONE = ["--configs", "G3", "--concurrency", "40", "--burst-reps", "0"]
VERIFIED_VARIANTS = {"fused", "per-group", "naive"}


@pytest.fixture(autouse=True)
def _auto_selection(monkeypatch):
    """CPU tables: a GPU backend forced by tox -e cuda cannot run them."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def _needs_interpreted_triton() -> None:
    statuses = {s.name: s for s in available_backends("cpu")}
    if "triton-cuda" not in statuses or not statuses["triton-cuda"].available:
        pytest.skip("triton-cuda cannot run on CPU here (needs Triton and TRITON_INTERPRET=1)")


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_a_quick_run_writes_verified_rows_finite_ratios_and_a_plot(tmp_path, capsys):
    out_csv, out_png = tmp_path / "bench.csv", tmp_path / "bench.png"
    argv = [*QUICK, *SMALL_BURST, "--csv", str(out_csv)]
    plot = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plot = False
    assert main([*argv, "--plot", str(out_png)] if plot else argv) == 0
    printed = capsys.readouterr().out
    assert "verification: OK" in printed and "ratios of medians" in printed
    assert "goals (BENCHMARKS.md): INDICATIVE ONLY" in printed  # a --quick run judges nothing for real
    assert "terms:" in printed and "C: concurrency" in printed and "floor: the cheapest apply" in printed
    assert f"csv: {out_csv}" in printed

    columns, rows = _read(out_csv)
    assert tuple(columns) == CSV_COLUMNS
    configs = {(r["config"], int(r["concurrency"])) for r in rows if r["metric"] == "apply_us"}
    assert configs == {(g, c) for g in ("G1", "G3") for c in (40, 256)}
    assert all(r["timestamp"] and r["torch_version"] and r["device_name"] and r["multiwrite_version"] for r in rows)
    variant_rows = [r for r in rows if r["variant"] in VERIFIED_VARIANTS]
    assert {r["variant"] for r in variant_rows} == VERIFIED_VARIANTS
    assert all(r["verified"] == "true" for r in variant_rows)
    assert {r["verified"] for r in rows if r["variant"].startswith("floor")} == {"n/a"}
    burst = [r for r in rows if r["config"] == "burst-G3"]
    assert {r["metric"] for r in burst} == {"burst_stage_us", "burst_apply_us", "burst_copy_us"}
    assert all(int(r["bytes"]) == 4 * 16 * (1 + 2 + 1) * 4 for r in burst)  # requests x ids x sum(k) x 4 bytes
    median = {(r["variant"], r["config"], r["concurrency"], r["metric"]): float(r["median_us"]) for r in rows}
    for (variant, config, c, metric), value in median.items():
        if variant == "fused" and metric in ("step_us", "apply_us"):
            for other in ("per-group", "naive"):
                ratio = value / median[(other, config, c, metric)]
                assert math.isfinite(ratio) and ratio > 0, (variant, other, config, c, metric)
    if plot:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {out_png}" in printed


class DropsTheLastValue(Backend):
    """A wrong design: the last value of every batch lands one too high."""

    NAME = "drops-last"
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def apply(self, batches):
        wrong = []
        for b in batches:
            values = b.values.copy()
            if values.shape[0]:
                values[-1] += 1
            wrong.append(WriteBatch(b.tables, b.meta, values, b.may_overlap, b.values_in_order, None, b.checked))
        select_backend("cpu", "torch-cpu").apply(wrong)


@pytest.fixture
def wrong_design(provide_backends):
    provide_backends("drops-last-plugin", DropsTheLastValue)


def test_a_wrong_design_fails_the_run_with_exit_1_naming_it(capsys, wrong_design):
    """The fused and per-group variants (and the stage designs) run on the backend: each is named; the naive
    variant writes with plain torch and stays verified."""
    assert main([*QUICK, *ONE, "--backend", "drops-last", "--stage"]) == 1
    printed = capsys.readouterr().out
    assert "verification: FAILED" in printed and "verification: OK" not in printed
    for variant in ("fused", "per-group"):
        assert f"MISMATCH {variant} G3 C=40: " in printed
    assert "MISMATCH naive" not in printed
    assert "MISMATCH stage ours G3 C=40" in printed and "MISMATCH stage ours-3-calls G3 C=40" in printed


def test_warmup_that_leaves_no_step_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([*QUICK, "--steps", "10", "--warmup", "10"])
    assert exc.value.code == 2
    assert one_line_error(capsys.readouterr().err).startswith(
        "multiwrite bench: error: argument --warmup: 10 warm-up steps leave none of 10 steps to measure"
    )


def _no_run(*args, **kwargs):
    """Stands in for the run: `main` reports it as an internal error (exit 3), so an exit 2 was decided before."""
    raise RuntimeError("the run was reached")


@pytest.mark.parametrize(
    ("option", "where", "fragment"),
    [
        ("--csv", "/nonexistent/dir/x.csv", "--csv /nonexistent/dir/x.csv: cannot write there: "),
        ("--csv", "{tmp}", "--csv {tmp}: is a directory"),
        ("--plot", "/nonexistent/dir/x.png", "--plot /nonexistent/dir/x.png: cannot write there: "),
        ("--plot", "{tmp}/x.notaformat", "--plot {tmp}/x.notaformat: matplotlib cannot write .notaformat files"),
    ],
    ids=["csv-missing-dir", "csv-is-a-directory", "plot-missing-dir", "plot-unknown-format"],
)
def test_an_unwritable_output_is_refused_before_the_run_leaving_nothing_behind(monkeypatch, capsys, tmp_path, option,
                                                                                where, fragment):  # fmt: skip
    if option == "--plot":
        pytest.importorskip("matplotlib", reason="--plot needs the plot extra (matplotlib)")
    monkeypatch.setattr("multiwrite.cli.bench.run_bench", _no_run)  # "before the run": the run is never reached
    where = where.format(tmp=tmp_path)
    assert main([*QUICK, option, where]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("multiwrite bench: error: " + fragment.format(tmp=tmp_path)), line
    assert list(tmp_path.iterdir()) == []  # the check leaves nothing behind


def test_an_existing_output_file_is_accepted_and_left_as_it_is_by_the_check(monkeypatch, capsys, tmp_path):
    existing = tmp_path / "old.csv"
    existing.write_text("keep me\n")
    argv = [*QUICK, "--csv", str(existing)]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(tmp_path / "new.png")]
    except ImportError:
        pass
    monkeypatch.setattr("multiwrite.cli.bench.run_bench", _no_run)
    assert main(argv) == 3  # every check passed: the run was reached
    assert "RuntimeError: the run was reached" in capsys.readouterr().err
    assert existing.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.csv"]  # the new path's probe file is gone


@pytest.mark.parametrize(
    ("extra", "start", "end"),
    [
        (["--burst-ids", "100000000"], "--burst-requests 64 --burst-ids 100000000: the burst's kernel block ids reach ",
         "beyond int32 (2,147,483,647): refused before the run"),
        (["--concurrency", "40,100000000"], "--concurrency 100000000 (configuration G3) needs about ",
         "is available: refused before the run"),
    ],
    ids=["burst-beyond-int32", "concurrency-beyond-memory"],
)  # fmt: skip
def test_sizes_that_cannot_fit_are_refused_before_the_run_in_one_line(monkeypatch, capsys, extra, start, end):
    monkeypatch.setattr("multiwrite.cli.bench.run_bench", _no_run)
    assert main([*QUICK, *extra]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith(f"multiwrite bench: error: {start}") and line.endswith(end), line


def test_a_burst_that_fits_int32_but_not_the_hosts_memory_is_refused_before_the_run(monkeypatch, capsys):
    monkeypatch.setattr("multiwrite.cli.bench.run_bench", _no_run)
    monkeypatch.setattr("multiwrite.cli.args.host_memory_available", lambda: 10**9)  # a machine with 1 GB free
    assert main([*QUICK, "--burst-requests", "1", "--burst-ids", "30000000"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("multiwrite bench: error: --burst-requests 1 --burst-ids 30000000 needs about ")
    assert line.endswith("1.0 GB is available: refused before the run")


def test_a_run_through_the_interpreter_judges_no_goal(capsys):
    _needs_interpreted_triton()
    assert main([*QUICK, *ONE, "--backend", "triton-cuda"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("multiwrite bench: triton-cuda (through Triton's interpreter) on cpu")
    goals = out[out.index("goals (BENCHMARKS.md)") :]
    assert "not evaluated for interpreted kernels" in goals
    assert "missed by" not in goals and ": met" not in goals


def test_the_stage_part_on_cpu_runs_and_verifies_ours_and_says_why_the_rest_did_not_run(capsys):
    assert main([*QUICK, *ONE, "--stage", "--steps", "60", "--warmup", "10"]) == 0
    out = capsys.readouterr().out
    stage = out[out.index("stage (--stage)") :]
    rows = {line.split()[1]: line.split() for line in stage.splitlines() if line.startswith("  40 ")}
    assert set(rows) == {"ours", "ours-batched", "ours-3-calls", "vllm-3-calls"}
    assert all(r[-1] == "yes" for r in rows.values())  # verified
    assert "anchor-3 and anchor-2 not run: their kernels are Triton kernels" in stage
    assert "graph-mode not run: it replays prepare_inputs captured in a CUDA graph" in stage
    assert "vllm-0.33 not run: vLLM 0.33's kernels are Triton kernels" in stage
    assert "graph-mode goal (staging + commit_staged_writes <= 0.5 empty launch per decode step): not measured" in out


def test_the_stage_part_replays_graph_mode_through_a_simulated_capture_off_a_gpu(capsys):
    """On a backend with a graph mode (Triton through its interpreter), graph mode runs off a GPU too: captured by a
    simulated capture, replayed per step, and verified like the other designs."""
    _needs_interpreted_triton()
    assert main([*QUICK, "--configs", "G3", "--concurrency", "3", "--steps", "8", "--burst-reps", "0",
                 "--backend", "triton-cuda", "--stage"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    stage = out[out.index("stage (--stage)") :]
    rows = {line.split()[1]: line.split() for line in stage.splitlines() if line.startswith("  3 ")}
    assert {"ours", "ours-3-calls", "graph-mode", "graph-mode-batched"} <= set(rows)
    assert rows["graph-mode"][2:4] == ["0", "(replay)"] and rows["graph-mode"][-1] == "yes"
    assert all(r[-1] == "yes" for r in rows.values())
    assert "graph-mode not run" not in stage


def test_the_launch_part_runs_every_launch_path_through_the_interpreter_and_verifies_them(capsys):
    _needs_interpreted_triton()
    assert main([*QUICK, "--configs", "G1", "--concurrency", "3", "--steps", "6", "--burst-reps", "0", "--launch"]) == 0
    out = capsys.readouterr().out
    launch = out[out.index("launch (--launch)") : out.index("verification:")]
    same_loop = [line.split() for line in launch.splitlines() if line.startswith(("  G1 ", "  G3 "))]
    assert [(r[0], r[2]) for r in same_loop if len(r) == 10] == [(g, v) for g in ("G1", "G3")
                                                                 for v in ("auto", "run", "jit")]  # fmt: skip
    assert all(r[3] == "1" for r in same_loop if len(r) == 10)  # one kernel launch per apply
    assert "launch path of the default backend: cpu: apply interpreter" in launch
    assert "tight loop" in launch and "device time behind a sleep: not measured off a GPU" in launch
    assert "verification: OK, all 9 variant runs equal the reference" in out  # 3 variants + 6 launch runs


def test_the_launch_part_is_refused_where_triton_cuda_cannot_run(monkeypatch, capsys):
    triton_backend = pytest.importorskip("multiwrite.backends.triton.backend")
    monkeypatch.setattr(triton_backend, "interpreter_enabled", lambda: False)  # as on a CPU machine without it
    monkeypatch.setattr("multiwrite.cli.bench.run_bench", _no_run)
    assert main([*QUICK, "--launch"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("multiwrite bench: error: --launch times triton-cuda, which cannot run on cpu: device type "
                           "cpu (supported: cuda)")  # fmt: skip

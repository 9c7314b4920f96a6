"""`multiwrite bench --quick` on a tiny trace: CSV columns, every variant verified, sane ratios, and a broken
variant caught. Timings are never asserted (ANCHORS.md goals are reported by the bench, not tested)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from multiwrite import bench_variants
from multiwrite.bench_report import CSV_COLUMNS, format_table
from multiwrite.bench_variants import Mismatch, Snapshot, compare
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
    assert main([*QUICK, "--steps", "10", "--warmup", "10"]) == 2
    assert "--warmup" in capsys.readouterr().err


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

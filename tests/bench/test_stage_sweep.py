"""`multiwrite bench --stage --groups`: the stage designs on G3, G11 and G20 on CPU, verified, with the sweep table
(each design's ratio per group count and the change from the fewest groups to the most), its CSV rows, and the
options refused before the run. Timings are never asserted."""

from __future__ import annotations

import csv
import math

import pytest

from multiwrite.bench.groups import BY_GROUP_COUNT, GROUP_KINDS, STAGE_CONFIGS, group_counts, sweep_rows
from multiwrite.cli import main
from multiwrite.plugins.dispatch import BACKEND_ENV
from multiwrite.workload import MAX_MODEL_LEN, max_blocks_per_group
from tests.support.processes import SMALL_TRACE, one_line_error

RUN = ["bench", "--quick", "--trace", SMALL_TRACE, "--warmup", "0", "--no-progress", "--device", "cpu",
       "--configs", "G3", "--concurrency", "40", "--burst-reps", "0"]  # fmt: skip


@pytest.fixture(autouse=True)
def _auto_selection(monkeypatch):
    """CPU tables: a GPU backend forced by tox -e cuda cannot run them."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def test_the_group_configurations_have_their_counts_and_mix_the_kinds_of_group():
    assert {n: BY_GROUP_COUNT[n] for n in (3, 11, 20)} == {3: "G3", 11: "G11", 20: "G20"}
    for name, n in (("G11", 11), ("G20", 20)):
        bs, kbs = STAGE_CONFIGS[name]
        assert len(bs) == len(kbs) == n and all(b % k == 0 for b, k in zip(bs, kbs))
        assert {GROUP_KINDS["full-64"], GROUP_KINDS["mamba-like"]} <= set(zip(bs, kbs))
        assert any(k < b for b, k in zip(bs, kbs))  # a group whose blocks expand into several kernel blocks
    # a mamba-like group holds one block per request: its row fits a request of the longest trace length
    assert max_blocks_per_group([MAX_MODEL_LEN]) == [2]


def test_the_sweep_gives_each_design_its_ratio_per_group_count_and_the_change_in_percent():
    rows = [{"C": 40, "label": "ours", "config": cfg, "step_x_empty": x} for cfg, x in (("G3", 2.0), ("G11", 2.5),
                                                                                        ("G20", 3.0))]  # fmt: skip
    rows += [{"C": 40, "label": "vllm-0.33-uva", "config": "G3", "step_x_empty": 10.0},
             {"C": 40, "label": "vllm-0.33-uva", "config": "G20", "step_x_empty": 8.0}]  # fmt: skip
    heads, table = sweep_rows(rows)
    assert heads == ["C", "design", "3 groups", "11 groups", "20 groups", "20 vs 3"]
    assert table == [["40", "ours", "2.00", "2.50", "3.00", "+50%"], ["40", "vllm-0.33-uva", "10.00", "-", "8.00",
                                                                      "-20%"]]  # fmt: skip


def test_bench_stage_groups_runs_every_configuration_verified_with_the_sweep_and_csv_rows(tmp_path, capsys):
    out_csv = tmp_path / "stage.csv"
    assert main([*RUN, "--stage", "--groups", "3,11,20", "--steps", "24", "--csv", str(out_csv)]) == 0
    out = capsys.readouterr().out
    stage = out[out.index("stage (--stage)") : out.index("verification:")]
    assert "G11: 11 groups, block sizes [64, 64, 64, 64, 256, 256, 16, 16, 16, 16384, 16384]" in stage
    assert "illustrative shapes" in stage and "G20: 20 groups" in stage
    tables = {}  # config -> design -> step x empty, from the per-configuration tables
    config = None
    for line in stage[: stage.index("the group sweep")].splitlines():
        if line.startswith("  G"):
            config = line.split(":")[0].strip()
        elif line.startswith("  40 "):
            cells = line.split()
            assert cells[-1] == "yes", line  # verified
            tables.setdefault(config, {})[cells[1]] = float(cells[-2])
    assert set(tables) == {"G3", "G11", "G20"}
    assert set(tables["G20"]) == {"ours", "ours-batched", "ours-3-calls", "vllm-3-calls"}
    sweep = [line.split() for line in stage[stage.index("the group sweep") :].splitlines() if line.startswith("  40 ")]
    assert {r[1] for r in sweep} == set(tables["G3"])
    for r in sweep:
        design = r[1]
        assert [float(v) for v in r[2:5]] == [tables[g][design] for g in ("G3", "G11", "G20")]
        want = (tables["G20"][design] / tables["G3"][design] - 1) * 100
        assert math.isclose(float(r[5].rstrip("%")), want, abs_tol=1.0), (r, want)
    assert "verification: OK, all 15 variant runs" in out  # 3 variants + 4 designs x 3 configurations
    with open(out_csv, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["variant"].startswith("stage-")]
    assert {(r["config"], r["variant"]) for r in rows if r["metric"] == "stage_step_us"} == {
        (g, f"stage-{d}") for g in ("G3", "G11", "G20") for d in tables["G3"]
    }
    assert all(r["verified"] == "true" for r in rows)


def test_groups_without_stage_and_an_unknown_group_count_are_refused_in_one_line(capsys):
    unknown = "argument --groups: no configuration of 5 groups (known: 1, 2, 3, 4, 11, 20)"
    for extra, message in ((["--groups", "3,11"], "argument --groups: only with --stage"),
                           (["--stage", "--groups", "3,5"], unknown)):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main([*RUN, *extra])
        assert exc.value.code == 2
        line = one_line_error(capsys.readouterr().err)
        assert line.startswith(f"multiwrite bench: error: {message}"), line
    assert group_counts("20,3,20") == [20, 3]  # repeats dropped, order kept

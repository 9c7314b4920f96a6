"""`multiwrite bench --sglang` on CPU (not timed: only what it reports and writes): both writers of both
implementations at each bs, tables compared, CSV and plot written, goals judged only with device times (checked on a
made-up result), and a refusal naming how to provide SGLang's files when none are found."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from multiwrite.bench.runner import Stats
from multiwrite.bench.sglang import CSV_COLUMNS, Measured, SglangResult, measure_sglang, terminal_report, write_csv
from multiwrite.cli import main
from multiwrite.sglang import upstream
from multiwrite.workload import load_trace
from tests.support.processes import SMALL_TRACE

needs_sglang = pytest.mark.skipif(not upstream.configured(), reason=upstream.SKIP_REASON)


@needs_sglang
def test_the_run_measures_both_writers_of_both_at_each_bs_and_compares_their_tables(tmp_path, auto_selection):
    ticks = []
    source = upstream.locate_sources(tmp_path / "src")
    result = measure_sglang(load_trace(SMALL_TRACE), torch.device("cpu"), [1, 3], 3, 1, None, ticks.append, "now",
                            {"device": "cpu", "device_name": "test"}, source)  # fmt: skip
    assert [(r.writer, r.impl, r.bs) for r in result.rows] == [
        (w, i, bs) for bs in (1, 3) for w in ("extend", "decode") for i in ("sglang", "multiwrite")
    ]
    assert all(r.verified and r.host.n == 2 and r.device is None and r.kernels is None for r in result.rows)
    assert sum(ticks) == 2 * 4 * 3 and result.sglang_path == "torch_native"
    assert [ok for _, ok in result.goals()] == [None, None, None] and result.failures() == []
    report = terminal_report(result)
    assert "not judged" in report and "result: OK" in report
    write_csv(result, tmp_path / "r.csv")
    with open(tmp_path / "r.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS and len(rows) == 8 and {r["metric"] for r in rows} == {"host"}


def _made_up(extend_x: float, decode_x: float, decode_kernels: int) -> SglangResult:
    r = SglangResult("now", {}, "src", "triton", 10, 1)
    for bs in (1, 256):
        for writer, x, k in (("extend", extend_x, 1), ("decode", decode_x, decode_kernels)):
            r.rows.append(Measured(writer, "sglang", bs, Stats(9, 9, 9), Stats(10 * x, 10 * x, 9), 3, True))
            r.rows.append(Measured(writer, "multiwrite", bs, Stats(9, 9, 9), Stats(10, 10, 9), k, True))
    return r


@pytest.mark.parametrize(("extend_x", "decode_x", "kernels", "met"), [
    (6.0, 1.5, 1, [True, True, True, True]),
    (4.0, 1.5, 1, [True, True, False, True]),  # the extend at bs 256 below 5x
    (6.0, 0.9, 1, [True, False, True, True]),  # the decode slower than SGLang's
    (6.0, 1.5, 2, [True, True, True, False]),  # the decode write two launches
])  # fmt: skip
def test_the_goals_are_judged_from_device_times(extend_x, decode_x, kernels, met):
    r = _made_up(extend_x, decode_x, kernels)
    assert [ok for _, ok in r.goals()] == met
    assert math.isclose(r.ratio("extend", 256, "device"), extend_x)
    assert bool(r.failures()) is not all(met)


@needs_sglang
def test_the_command_writes_its_report_csv_and_plot(tmp_path, capsys, auto_selection):
    pytest.importorskip("matplotlib")
    code = main(["bench", "--sglang", "--quick", "--sglang-bs", "2", "--steps", "3", "--warmup", "1", "--trace",
                 SMALL_TRACE, "--csv", str(tmp_path / "s.csv"), "--plot", str(tmp_path / "s.png"), "--no-progress",
                 "--device", "cpu"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "multiwrite bench --sglang" in out and (tmp_path / "s.csv").is_file() and (tmp_path / "s.png").stat().st_size


def test_without_sglangs_files_the_command_refuses_saying_how_to_provide_them(tmp_path, monkeypatch, capsys):
    for name in (upstream.WHEEL_ENV, upstream.SRC_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # (no cached wheel there)
    assert main(["bench", "--sglang", "--quick", "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--sglang: SGLang's writers are not located" in err and "tox -e sglang" in err

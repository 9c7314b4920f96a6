"""`multiwrite bench --model` on CPU at the tiny preset: its report, CSV rows and plot; the TPOT arithmetic; the
check failing the run when one slot or one gathered block id is wrong; its options refused without `--model`."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from multiwrite.bench.model import PRESETS
from multiwrite.bench.model_report import derived
from multiwrite.bench.model_step import ModelResult, measure_model
from multiwrite.cli import main
from multiwrite.plugins.dispatch import BACKEND_ENV
from multiwrite.workload import load_trace
from tests.support.processes import SMALL_TRACE

ARGS = ["bench", "--quick", "--trace", SMALL_TRACE, "--warmup", "0", "--no-progress", "--device", "cpu",
        "--configs", "G1", "--concurrency", "40", "--burst-reps", "0", "--model", "--model-preset", "tiny",
        "--attention", "flex-paged"]  # fmt: skip


@pytest.fixture(autouse=True)
def _auto_selection(monkeypatch):
    """CPU tables: a GPU backend forced by tox -e cuda cannot run them."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def test_the_tiny_preset_reports_tpot_shares_and_writes_csv_rows_and_a_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_csv, out_png = tmp_path / "bench.csv", tmp_path / "bench.png"
    assert main([*ARGS, "--csv", str(out_csv), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "model (--model): a decode step of tiny" in printed and "attention: flex-paged (eager)" in printed
    assert "assumptions: TPOT = time per output token" in printed and "Left out of the step: embedding" in printed
    assert "vllm-3-calls" in printed and "graph device / replay host: not measured" in printed
    assert f"plot: {tmp_path / 'bench-model.png'}" in printed and "verification: OK" in printed

    with open(out_csv, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["config"] == "model-tiny"]
    got = {(r["variant"], r["metric"]) for r in rows}  # no graph off a GPU; graph mode: compiled-cpu has none
    assert got == {
        ("model", "model_eager_wall_us"),
        ("model", "model_eager_host_us"),
        ("model-ours", "model_stage_host_us"),
        ("model-vllm-3-calls", "model_stage_host_us"),
    }
    assert all(r["concurrency"] == "40" and r["verified"] == "true" and r["n"] == "20" for r in rows)
    value = {(r["variant"], r["metric"]): float(r["median_us"]) for r in rows}
    assert 0 < value[("model", "model_eager_host_us")] <= value[("model", "model_eager_wall_us")]
    assert 0 < value[("model-ours", "model_stage_host_us")]
    assert (tmp_path / "bench-model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shares_tpot_and_the_async_verdict_follow_from_the_measured_times():
    r = ModelResult(PRESETS["tiny"], "bfloat16")
    r.steps.append({"C": 40, "eager_wall_us": 990.0, "replay_host_us": 5.0, "graph_device_us": 985.0})
    r.rows += [{"C": 40, "variant": "ours", "stage_us": 10.0}, {"C": 40, "variant": "graph-mode", "stage_us": 990.0}]
    ours, graph_mode = derived(r)
    assert ours["eager_tpot_us"] == 1000.0 and ours["eager_share"] == pytest.approx(0.01)
    assert ours["graph_tpot_us"] == 1000.0 and ours["graph_share"] == pytest.approx(0.01)
    assert ours["host_work_us"] == 15.0 and ours["async_margin_us"] == 970.0 and ours["hides"] is True
    assert math.isnan(graph_mode["eager_tpot_us"])  # graph mode is for a graph-replaying engine only
    assert graph_mode["async_margin_us"] == -10.0 and graph_mode["hides"] is False


def _measure(tamper):
    with torch.no_grad():
        return measure_model(load_trace(SMALL_TRACE), torch.device("cpu"), None, PRESETS["tiny"], 12, 0, [40],
                             "auto", lambda n: None, tamper=tamper)  # fmt: skip


def test_one_wrong_slot_fails_the_model_check():
    def wrong_slot(step, gathered, slots):
        slots[0] = slots[1]  # entry 0's K/V over entry 1's slot (entry 1 then writes its own: it wins, in order)

    failures = _measure(wrong_slot).failures()
    assert any(f.startswith("model step C=40: layer 0: entry 0") and "its K/V is not at slot" in f for f in failures)
    assert any(f.startswith("model stage ours C=40: slot_mappings[0, 0]") for f in failures)
    assert not any("vllm-3-calls" in f for f in failures)  # only the design the model reads was tampered with


def test_one_wrong_block_id_fails_the_model_check():
    def wrong_block(step, gathered, slots):
        gathered[0, 0] += 1  # entry 0 reads another page for its first 16 positions

    failures = _measure(wrong_block).failures()
    assert any(f.startswith("model step C=40: layer 0: entry 0") and "attention relative error" in f for f in failures)
    assert any(f.startswith("model stage ours C=40: group 0 gathered[0, 0]") for f in failures)
    assert not any("vllm-3-calls" in f for f in failures)


def test_an_unmodified_run_passes_the_same_checks():
    r = _measure(None)
    assert [d["variant"] for d in r.rows] == ["ours", "vllm-3-calls"]  # graph mode: compiled-cpu has none
    assert r.failures() == [] and [s["steps"] for s in r.steps] == [11] and r.attention == "flex-paged (eager)"


@pytest.mark.parametrize("option", [["--model-preset", "tiny"], ["--attention", "sdpa-gathered"],
                                    ["--model-steps", "5"]])  # fmt: skip
def test_model_options_without_model_are_refused(option, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--quick", "--device", "cpu", *option])
    assert exc.value.code == 2
    assert f"argument {option[0]}: only with --model" in capsys.readouterr().err


def test_with_a_stand_in_graph_the_graph_figures_shares_and_panels_appear(tmp_path, capsys, monkeypatch):
    """Off a GPU there is no CUDA graph; a stand-in whose replay runs the step eagerly drives the graph half of the
    report, the CSV and the plot as a GPU run does (its times are the eager step's, not a graph's)."""
    pytest.importorskip("matplotlib")
    from multiwrite.bench import model_step

    graphs = []

    def stand_in(self):
        self.graph = FakeGraph(self.step)
        graphs.append(self.graph)

    monkeypatch.setattr(model_step._Model, "capture", stand_in)
    out_csv, out_png = tmp_path / "bench.csv", tmp_path / "bench.png"
    assert main([*ARGS, "--csv", str(out_csv), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "graph device / replay host: not measured" not in printed
    table = printed[printed.index("the block-table stage in the step") :].splitlines()[3]
    cells = table.split()
    assert cells[:3] == ["40", "ours", "1"] and cells[-1] == "yes" and cells[-3] in ("yes", "no")
    assert cells[8].endswith("%") and float(cells[8].rstrip("%")) > 0  # the graph share ("stage (p99)" is 2 cells)
    # the async pass: one design per measured step after a replay (not the first: the graph is captured during it);
    # off a GPU nothing overlaps
    behind = printed[printed.index("async scheduling, measured") :].splitlines()[3:5]
    assert [r.split()[:3] for r in behind] == [["40", "ours", "10"], ["40", "vllm-3-calls", "9"]]
    assert all(r.split()[-2] == "0.00%" for r in behind)
    assert graphs[0].replays == 20 + 19  # one timed replay per measured step, and one before each async stage
    with open(out_csv, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["config"] == "model-tiny"]
    metrics = {r["metric"] for r in rows}
    assert {"model_graph_device_us", "model_replay_host_us", "model_stage_exposed_us"} <= metrics
    stage = {r["variant"]: r["n"] for r in rows if r["metric"] == "model_stage_host_us"}
    assert stage == {"model-ours": "10", "model-vllm-3-calls": "11"}  # the other steps, synchronous
    assert (tmp_path / "bench-model.png").stat().st_size > 20_000  # two panels: eager and graph


class FakeGraph:
    def __init__(self, step):
        self.replays = 0
        self._step = step

    def replay(self) -> None:
        self.replays += 1
        self._step()


@pytest.mark.slow
def test_the_small_preset_runs_and_verifies_on_cpu(capsys):
    """The about-1B preset (16 layers, hidden 2048) on CPU, a few decode steps at C=8: what CI runs of it (slow
    tests: tox -e plugin)."""
    args = [a for a in ARGS if a not in ("tiny",)]
    args[args.index("--model-preset") + 1 : args.index("--model-preset") + 1] = ["small"]
    args[args.index("--concurrency") + 1] = "8"
    assert main([*args, "--steps", "10", "--model-steps", "10"]) == 0
    printed = capsys.readouterr().out
    assert "model (--model): a decode step of small" in printed and "verification: OK" in printed


@pytest.mark.parametrize(
    ("extra", "device", "expected", "line"),
    [
        ((), "cpu", ("tiny", "sdpa-gathered", 40, [40]),
         "--quick --model: --model-preset tiny, --model-steps 40, --concurrency 40 for --model, --attention "
         "sdpa-gathered (a smoke test; "),
        (("--model-preset", "small", "--model-steps", "30", "--attention", "flex-paged", "--concurrency", "8,16"),
         "cpu", ("small", "flex-paged", 30, [8, 16]), ""),
        ((), "cuda", ("llama-8b", "auto", 40, [40]), "--quick --model: --model-steps 40, --concurrency 40 for --model "
         "(a smoke test; "),
    ],
    ids=["cpu", "cpu-chosen-by-hand", "cuda"],
)  # fmt: skip
def test_quick_model_picks_a_smoke_test_and_says_so(monkeypatch, extra, device, expected, line):
    """`--quick --model` on a CPU: the tiny preset, few steps at one concurrency, gathered SDPA, each named in one
    line; options given by hand win and are not named. (The fit check is left out: this tests the choice, not a
    run.)"""
    import torch

    from multiwrite.cli import bench_model, build_parser
    from multiwrite.cli.bench import options_from_args

    monkeypatch.setattr(bench_model, "refuse_if_it_cannot_fit", lambda *a: None)
    args = build_parser().parse_args(["bench", "--quick", "--model", *extra])
    opts = bench_model.model_options(args, options_from_args(args), torch.device(device))
    assert (opts.preset, opts.attention, opts.steps, opts.concurrency) == expected
    assert opts.chosen.startswith(line) if line else opts.chosen == ""

"""The `multiwrite` command: replay on small traces, bad traces, info."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import CPU_DEFAULT

import multiwrite
from multiwrite import Backend, hookimpl
from multiwrite.cli import main

SMALL = "tests/data/small_trace.csv"


@pytest.fixture(autouse=True)
def _auto_selection(monkeypatch):
    """These tests are about choosing a backend: a forced one (tox -e cuda) must not leak in."""
    monkeypatch.delenv("MULTIWRITE_BACKEND", raising=False)


def test_replay_small_trace_reports_zero_mismatches(capsys):
    code = main(
        [
            "replay",
            "--trace",
            SMALL,
            "--concurrency",
            "3",
            "--steps",
            "40",
            "--check-every",
            "7",
            "--no-progress",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "result: OK, zero mismatches" in out
    assert f"backend            {CPU_DEFAULT}" in out
    assert "trace              tests/data/small_trace.csv (6 requests)" in out
    assert "steps              21 of 40 (the trace ran out of requests)" in out
    assert "checks             3" in out  # steps 7, 14, 21
    assert "apply host time    median" in out


def test_replay_detects_a_broken_backend(capsys, monkeypatch):
    from multiwrite.backends import torch_cpu

    real = torch_cpu.TorchCpuBackend.apply

    def drop_last_batch_value(self, batches):
        for b in batches:
            if b.values.shape[0]:
                b.values[-1] += 1
        real(self, batches)

    monkeypatch.setattr(torch_cpu.TorchCpuBackend, "apply", drop_last_batch_value)
    code = main(
        ["replay", "--trace", SMALL, "--concurrency", "2", "--steps", "30", "--no-progress", "--device", "cpu",
         "--backend", "torch-cpu"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1
    assert "result: FAILED" in out


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("", "line 1: empty file"),
        ("TIMESTAMP,ContextTokens\nx,3\n", "line 1: missing column 'GeneratedTokens'"),
        ("ContextTokens,GeneratedTokens\n3,4\n5,x\n", "line 3: GeneratedTokens='x' is not an integer"),
        ("ContextTokens,GeneratedTokens\n3,4\n-5,1\n", "line 3: ContextTokens=-5 is negative"),
        ("ContextTokens,GeneratedTokens\n3,\n", "line 2: GeneratedTokens='' is not an integer"),
        ("ContextTokens,GeneratedTokens\n", "no requests after the header"),
    ],
)
def test_bad_trace_files_name_file_and_line(tmp_path, capsys, content, fragment):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    code = main(["replay", "--trace", str(path), "--steps", "5", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert str(path) in err and fragment in err


def test_missing_trace_file(capsys):
    assert main(["replay", "--trace", "/nonexistent/trace.csv", "--no-progress"]) == 2
    assert "cannot read trace" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "--concurrency", "0"],
        ["replay", "--block-sizes", "16,x"],
        ["replay", "--steps", "-1"],
        ["replay", "--check-every", "-1"],
        ["replay", "--check-every", "x"],
        ["nope"],
    ],
)
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_check_every_0_checks_only_after_the_last_step(capsys):
    argv = ["replay", "--trace", SMALL, "--concurrency", "3", "--steps", "10", "--check-every", "0"]
    assert main([*argv, "--no-progress", "--device", "cpu"]) == 0
    assert "checks             1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cudax", "error: cannot parse device 'cudax'"),
        ("cuda:x", "error: cannot parse device 'cuda:x'"),
    ],
)
def test_unparsable_device_exits_2(capsys, device, message):
    assert main(["replay", "--trace", SMALL, "--steps", "3", "--no-progress", "--device", device]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_exits_2(capsys):
    assert main(["replay", "--trace", SMALL, "--steps", "3", "--no-progress", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    build = "without CUDA" if torch.version.cuda is None and not getattr(torch.version, "hip", None) else "built with"
    assert (
        f"multiwrite replay: error: device cuda requested but CUDA is not available (torch {torch.__version__} " in err
    )
    assert build in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-sizes", "16,32", "--kernel-block-sizes", "16"], "1 entry for the 2 groups of --block-sizes 16,32"),
        (["--block-sizes", "16,24", "--kernel-block-sizes", "16,16"], "group 1: block size 24 is not a positive"),
    ],
)
def test_mismatched_kernel_block_sizes_exit_2_in_argparse_format(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["replay", *argv, "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"multiwrite replay: error: argument --kernel-block-sizes: {message}")
    assert len(err.strip().splitlines()) == 1, err


def test_forced_unknown_backend_exit_2(capsys):
    assert main(["replay", "--backend", "nope", "--steps", "3", "--no-progress"]) == 2
    assert "registered backends" in capsys.readouterr().err


def test_info_lists_every_backend(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch-cpu" in out and "<- selected" in out
    assert "triton-cuda" in out and "triton-rocm" in out
    assert f"versions  multiwrite {multiwrite.__version__}," in out


class _LowPriorityCpu(Backend):
    NAME = "low-cpu"
    PRIORITY = -100
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def apply(self, batches):
        raise AssertionError("never applied here")


class _XpuOnly(Backend):
    NAME = "xpu-only"
    PRIORITY = 500
    SUPPORTED_DEVICE_TYPES = frozenset({"xpu"})

    def apply(self, batches):
        raise AssertionError("never applied here")


@pytest.fixture
def extra_backends():
    class Plugin:
        @hookimpl
        def multiwrite_backends(self):
            return [_LowPriorityCpu(), _XpuOnly()]

    pm = multiwrite.get_plugin_manager()
    plugin = Plugin()
    pm.register(plugin, name="test-cli-extra")
    yield
    pm.unregister(plugin)


def _section(out: str, device: str) -> list[str]:
    lines = out.splitlines()
    start = lines.index(f"backends for {device}:") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("backends for ")), len(lines))
    return lines[start:end]


def test_info_marks_the_forced_backend_selected(capsys, monkeypatch, extra_backends):
    monkeypatch.setenv("MULTIWRITE_BACKEND", "low-cpu")
    assert main(["info"]) == 0
    cpu = _section(capsys.readouterr().out, "cpu")
    selected = [line for line in cpu if "<- selected" in line]
    assert len(selected) == 1
    assert selected[0].lstrip().startswith("low-cpu") and "forced by $MULTIWRITE_BACKEND" in selected[0]


def test_info_says_the_forced_backend_cannot_run(capsys, monkeypatch, extra_backends):
    monkeypatch.setenv("MULTIWRITE_BACKEND", "xpu-only")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    cpu = _section(out, "cpu")
    assert not any("<- selected" in line for line in cpu)
    assert "  forced by $MULTIWRITE_BACKEND=xpu-only: cannot run: device type cpu (supported: xpu)" in cpu
    monkeypatch.setenv("MULTIWRITE_BACKEND", "nope")
    assert main(["info"]) == 0
    cpu = _section(capsys.readouterr().out, "cpu")
    assert not any("<- selected" in line for line in cpu)
    assert any(line.startswith("  forced by $MULTIWRITE_BACKEND=nope: cannot run: no backend") for line in cpu)


@pytest.mark.parametrize("command", ["replay", "bench"])
def test_help_cites_benchmarks_md_not_a_file_outside_the_repository(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "BENCHMARKS.md" in text and "ANCHORS" not in text


def test_console_script_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "multiwrite.cli", "info"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "backends for cpu:" in proc.stdout

"""`multiwrite info`: versions, devices and every registered backend per device with its distribution, priority and
status; the backend dispatch would pick marked (also when `$MULTIWRITE_BACKEND` forces it, or a line saying why the
forced one cannot run); a name collision said once after the listing; a plugin that failed to load listed with its
distribution, and its traceback with `-v`."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import multiwrite
from multiwrite import Backend
from multiwrite.cli import main
from multiwrite.plugins.dispatch import BACKEND_ENV
from tests.conftest import CPU_DEFAULT
from tests.support.distributions import install_distribution
from tests.support.processes import subprocess_env

BUILTIN = ("compiled-cpu", "torch-cpu", "torch-generic", "triton-cuda", "triton-rocm")


@pytest.fixture(autouse=True)
def _auto_selection(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def _info(capsys, *argv: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning escaping into the listing fails the test
        assert main(["info", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def _section(out: str, device: str) -> list[str]:
    lines = out.splitlines()
    start = lines.index(f"backends for {device}:") + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return lines[start:end]


def _row(section: list[str], name: str) -> str:
    (row,) = [line for line in section if line.split()[0] == name]
    return row


def test_info_lists_versions_devices_and_every_backend_per_device(capsys):
    out = _info(capsys)
    lines = out.splitlines()
    assert lines[0] == "multiwrite info"
    assert lines[1].startswith(f"  versions  multiwrite {multiwrite.__version__}, torch ")
    assert lines[2].startswith("  cpu       ")
    cpu = _section(out, "cpu")
    no_gpu = "backends for cuda:" in lines  # (the line itself: "backends for cuda:0:" is a GPU's)
    gpu = _section(out, "cuda") if no_gpu else _section(out, "cuda:0")  # the GPU, or why there is none
    for section in (cpu, gpu):
        assert {line.split()[0] for line in section} >= set(BUILTIN)
        for name in BUILTIN:
            assert f"multiwrite {multiwrite.__version__}" in _row(section, name)
    selected = [line for line in cpu if "<- selected" in line]
    assert len(selected) == 1 and selected[0].split()[0] == CPU_DEFAULT
    assert selected[0].endswith("available  <- selected")
    assert "priority -100  available" in _row(cpu, "torch-generic")
    assert "priority    0  available" in _row(cpu, "torch-cpu")
    if no_gpu:  # the reasons of the GPU backends are listed
        assert "unavailable: " in _row(gpu, "triton-cuda") and "unavailable: device type cuda (supported: cpu)" in (
            _row(gpu, "torch-cpu")
        )


class LowCpu(Backend):
    NAME = "low-cpu"
    PRIORITY = -500
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def apply(self, batches):
        raise AssertionError("never applied here")


class XpuOnly(LowCpu):
    NAME = "xpu-only"
    PRIORITY = 500
    SUPPORTED_DEVICE_TYPES = frozenset({"xpu"})


class Impostor(LowCpu):
    NAME = "torch-cpu"  # a built-in's name: the built-in keeps it, the plugin is listed as taken
    PRIORITY = 5


@pytest.fixture
def extra_backends(provide_backends):
    provide_backends("info-extra", LowCpu, XpuOnly)


def test_the_forced_backend_is_the_one_marked_selected(capsys, monkeypatch, extra_backends):
    monkeypatch.setenv(BACKEND_ENV, "low-cpu")
    cpu = _section(_info(capsys), "cpu")
    selected = [line for line in cpu if "<- selected" in line]
    assert len(selected) == 1
    assert selected[0].split()[0] == "low-cpu" and selected[0].endswith("<- selected (forced by $MULTIWRITE_BACKEND)")
    assert "priority -500  available" in selected[0] and "plugin" not in selected[0].split()[1]


@pytest.mark.parametrize(
    ("forced", "why"),
    [("xpu-only", "device type cpu (supported: xpu)"), ("nope", "no backend of that name is registered (registered: ")],
)
def test_a_forced_backend_that_cannot_run_gets_a_line_and_nothing_is_marked(capsys, monkeypatch, extra_backends,
                                                                           forced, why):  # fmt: skip
    monkeypatch.setenv(BACKEND_ENV, forced)
    cpu = _section(_info(capsys), "cpu")
    assert not any("<- selected" in line for line in cpu)
    assert cpu[-1].startswith(f"  forced by $MULTIWRITE_BACKEND={forced}: cannot run: {why}")


def test_a_name_collision_is_said_once_after_the_listing(capsys, provide_backends):
    provide_backends("info-impostor", Impostor)
    out = _info(capsys)
    lines = out.splitlines()
    assert lines.count("warnings:") == 1
    tail = lines[lines.index("warnings:") + 1 :]
    assert len(tail) == 1 and tail[0].startswith("  multiwrite: backend name 'torch-cpu' is provided by multiwrite ")
    assert "and by plugin 'info-impostor'" in tail[0]
    taken = [line for line in _section(out, "cpu") if line.split()[0] == "torch-cpu" and "already taken" in line]
    assert len(taken) == 1 and "unavailable: backend name 'torch-cpu' is already taken by " in taken[0]


def test_a_plugin_that_failed_to_load_is_listed_with_its_distribution_and_verbose_adds_its_traceback(tmp_path):
    install_distribution(tmp_path, "exploding-plugin", "exploding_plugin",
                         "def _load():\n    raise ImportError('needs libfoo')\n\n_load()\n")  # fmt: skip
    cmd = [sys.executable, "-m", "multiwrite", "info"]
    plain = subprocess.run(cmd, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=120)
    verbose = subprocess.run([*cmd, "-v"], env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and verbose.returncode == 0, plain.stderr + verbose.stderr
    line = next(x for x in plain.stdout.splitlines() if x.strip().startswith("exploding-plugin"))
    assert "exploding-plugin 1.0" in line and "priority    -  unavailable: " in line
    assert "failed to load: ImportError: needs libfoo" in line
    assert "Traceback" not in plain.stdout
    listing = verbose.stdout.splitlines()
    at = listing.index(next(x for x in listing if x.strip().startswith("exploding-plugin")))
    assert listing[at + 1] == "    Traceback (most recent call last):"  # right under its line, indented
    assert "in _load" in verbose.stdout and verbose.stdout.count("Traceback (most recent call last)") == 1

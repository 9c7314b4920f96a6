"""`multiwrite check-backend`: what it refuses up front, in one line with exit 2, instead of running the kit and
reporting every property failed (the kit's runs themselves: tests/packaging/test_plugin_package.py)."""

from __future__ import annotations

import sys

import pytest

from multiwrite.cli import main
from multiwrite.plugins.dispatch import BACKEND_ENV
from tests.support.processes import one_line_error


@pytest.fixture(autouse=True)
def _auto_selection(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def test_without_the_test_extra_it_is_one_line_exit_2_naming_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # as if not installed (pytest itself runs this test)
    assert main(["check-backend", "torch-cpu"]) == 2
    captured = capsys.readouterr()
    assert one_line_error(captured.err) == (
        "multiwrite check-backend: error: the conformance kit needs hypothesis: install the test extra "
        "(pip install 'multiwrite[test]')"
    )
    assert captured.out == ""


@pytest.mark.parametrize(
    ("argv", "start", "names"),
    [
        (("nope",), "unknown backend 'nope'; registered backends: ", ("compiled-cpu", "torch-cpu", "torch-generic")),
        (("compiled-cpu", "--device", "meta"), "backend 'compiled-cpu' cannot run: meta: device type meta (supported: "
         "cpu)", ()),
        (("torch-cpu", "--device", "cudax"), "bad --device 'cudax': ", ()),
    ],
    ids=["unknown", "cannot-run-there", "bad-device"],
)  # fmt: skip
def test_a_backend_the_kit_cannot_check_is_one_line_exit_2(capsys, argv, start, names):
    assert main(["check-backend", *argv]) == 2
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert line.startswith(f"multiwrite check-backend: error: {start}"), line
    assert all(n in line for n in names) and captured.out == ""

"""The conformance kit for backend authors: multiwrite's own backend tests, installed.

Three ways to run it against a backend `NAME`:

- `pytest --multiwrite-backend NAME [--multiwrite-device DEV] [--multiwrite-examples N]` (the pytest
  plugin `multiwrite.testing.plugin`, registered through the `pytest11` entry point; inert otherwise);
- a test file in the plugin's own package: `from multiwrite.testing.suite import *` and
  `from multiwrite.testing.properties import *`, with `multiwrite_backend_name` overridden in its
  `conftest.py` (see `examples/multiwrite-numpy-plugin/`);
- `multiwrite check-backend NAME [--device DEV]`, which prints one line per property (`check_backend`).

What each property checks is in the docstrings of `multiwrite.testing.suite` and `.properties`; the
contract they check is `docs/backends.md`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["PropertyResult", "check_backend", "kit_problem", "run_kit"]

#: Modules the kit's pytest subprocess needs (the `test` extra).
KIT_REQUIREMENTS = ("pytest", "hypothesis")


@dataclass
class PropertyResult:
    """One property (a test function of the suite) over all its cases (dtypes, staging paths)."""

    name: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    first_failure: str = ""
    cases: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.passed > 0


def run_kit(
    name: str, device: str | None = None, examples: int | None = None, extra_args: tuple[str, ...] = ()
) -> tuple[int, list[PropertyResult], str]:
    """Run the kit against backend `name` in a fresh Python process (so no state of this one leaks in).

    Returns (pytest's exit code, one `PropertyResult` per property in suite order, pytest's output).
    """
    with tempfile.TemporaryDirectory(prefix="multiwrite-kit-") as tmp:
        report = os.path.join(tmp, "report.xml")
        ini = os.path.join(tmp, "pytest.ini")
        with open(ini, "w", encoding="utf-8") as f:
            f.write("[pytest]\n")  # not the caller's project configuration
        args = [sys.executable, "-m", "pytest", "-c", ini, "--rootdir", tmp, "-p", "no:cacheprovider", "-q"]
        args += ["--multiwrite-backend", name, f"--junitxml={report}", "-o", "junit_family=xunit1"]
        if device:
            args += ["--multiwrite-device", device]
        if examples:
            args += ["--multiwrite-examples", str(examples)]
        args += list(extra_args)
        env = dict(os.environ)
        env.pop("MULTIWRITE_BACKEND", None)
        proc = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True)
        results: dict[str, PropertyResult] = {}
        if os.path.exists(report):
            for case in ET.parse(report).getroot().iter("testcase"):
                full = case.get("name", "")
                prop = full.split("[", 1)[0]
                r = results.setdefault(prop, PropertyResult(prop))
                r.cases.append(full)
                failure = case.find("failure")
                if failure is None:
                    failure = case.find("error")
                if failure is not None:
                    r.failed += 1
                    if not r.first_failure:
                        message = (failure.get("message") or failure.text or "").strip().splitlines()
                        r.first_failure = f"{full}: {message[0] if message else 'failed'}"
                elif case.find("skipped") is not None:
                    r.skipped += 1
                else:
                    r.passed += 1
        return proc.returncode, list(results.values()), proc.stdout + proc.stderr


def kit_problem(name: str, device: str | None = None) -> str | None:
    """Why the kit cannot run against backend `name` on `device` at all, as one line; None when it can.

    Checked before the kit starts (it would otherwise report every property failed): the `test` extra
    (pytest, hypothesis) is installed, `name` is a registered backend, and it can run on `device` (or, with
    no device, on one of the devices the kit's `multiwrite_device` fixture tries).
    """
    import importlib.util

    missing = [m for m in KIT_REQUIREMENTS if importlib.util.find_spec(m) is None]
    if missing:
        return (
            f"the conformance kit needs {' and '.join(missing)}: install the test extra "
            "(pip install 'multiwrite[test]')"
        )
    if device is not None and device.startswith("cpu"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # as the kit's plugin does, before Triton loads
    import torch

    from multiwrite import available_backends
    from multiwrite.testing.plugin import candidate_devices

    try:
        candidates = [torch.device(device)] if device else candidate_devices()
    except (RuntimeError, ValueError) as exc:
        return f"bad --device {device!r}: {exc}"
    why = []
    for dev in candidates:
        statuses = available_backends(dev)
        match = [s for s in statuses if s.name == name and s.taken_by is None]
        if not match:
            names = ", ".join(sorted({s.name for s in statuses if s.taken_by is None})) or "none"
            return f"unknown backend {name!r}; registered backends: {names}"
        if match[0].available:
            return None
        why.append(f"{dev}: " + "; ".join(match[0].reasons))
    return f"backend {name!r} cannot run: " + " | ".join(why)


def check_backend(
    name: str, device: str | None = None, examples: int | None = None, out: Callable[[str], None] = print
) -> int:
    """Run the kit against backend `name` on `device` and print one line per property.

    Returns 0 when every property passed, 1 when any failed (or nothing ran), 2 when the kit cannot run
    at all (`kit_problem`: the test extra missing, an unknown backend, one that cannot run on `device`),
    after printing that reason as one line.
    """
    problem = kit_problem(name, device)
    if problem is not None:
        out(f"multiwrite check-backend: error: {problem}")
        return 2
    code, results, output = run_kit(name, device, examples)
    width = max((len(r.name) for r in results), default=0)
    for r in results:
        state = "PASS" if r.ok else "FAIL" if r.failed else "SKIP"
        line = f"{state}  {r.name:<{width}}  {r.passed}/{len(r.cases)} cases"
        if r.failed:
            line += f"  -- {r.first_failure}"
        out(line)
    failed = [r for r in results if r.failed]
    if not results:
        out(output.strip()[-2000:])
    verdict = code == 0 and results and not failed
    where = f" on {device}" if device else ""
    out(f"result: {name}{where}: " + ("OK, every property holds" if verdict else f"FAILED ({len(failed)} properties)"))
    return 0 if verdict else 1

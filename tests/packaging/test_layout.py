"""The layout of the test suite itself: every test lives in a room (a package one level below the tests root, named
for what it covers), the root holds only the shared conftest and helpers, and file names say what they test."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
#: What the tests root itself may hold besides the rooms.
ROOT_FILES = {"__init__.py", "conftest.py", "support.py", "wheels.py"}  # wheels.py: tests/vllm and tests/sglang
#: Directories of the tests root that are no rooms: they hold no Python.
NOT_ROOMS = {"data", "__pycache__"}
#: Words that tell the history of a test instead of what it checks.
HISTORY = re.compile(r"regression|first_hour|holes|issue_?\d|bug_?\d|fix(ed)?_|old_|new_")


def _rooms() -> list[Path]:
    return sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name not in NOT_ROOMS and not p.name.startswith("."))


def test_the_root_holds_no_test_file_only_the_shared_conftest_and_helpers():
    files = {p.name for p in TESTS.iterdir() if p.is_file() and p.suffix == ".py"}
    assert not [f for f in files if f.startswith("test_")], "tests outside a room"
    assert files <= ROOT_FILES, sorted(files - ROOT_FILES)
    assert (TESTS / "__init__.py").is_file()


def test_every_room_is_a_package_one_level_deep_with_tests_of_its_own():
    rooms = _rooms()
    assert {"plugins", "cli", "bench", "packaging"} <= {r.name for r in rooms}
    for room in rooms:
        assert (room / "__init__.py").is_file(), f"{room.name}/ is no package: its test modules would clash by name"
        assert list(room.glob("test_*.py")), f"{room.name}/ holds no tests"
        nested = [p.relative_to(TESTS).as_posix() for p in room.rglob("*.py") if p.parent != room]
        assert not nested, f"tests below a room: {nested}"
    for other in NOT_ROOMS & {p.name for p in TESTS.iterdir()}:
        assert not list((TESTS / other).rglob("*.py")), f"{other}/ is no room and holds Python"


def test_file_names_say_what_they_test_not_their_history():
    names = [p.relative_to(TESTS).as_posix() for room in _rooms() for p in room.glob("*.py")]
    assert [n for n in names if HISTORY.search(Path(n).stem)] == []

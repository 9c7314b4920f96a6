"""Every file of the repository that the package's messages and docstrings send a reader to exists (an error message
that cites a missing document leaves its reader with nothing)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: A repository path as the source writes it: a document, an example, a script.
CITED = re.compile(r"\b(?:docs/[\w./-]+\.md|[A-Z][A-Z_]+\.md|examples/[\w.-]+/?|scripts/[\w.-]+\.py)")


def _citations() -> dict[str, list[str]]:
    """Cited path -> the source files citing it."""
    found: dict[str, list[str]] = {}
    for top in ("multiwrite", "backends"):
        for path in sorted((REPO / top).rglob("*.py")):
            for cited in set(CITED.findall(path.read_text(encoding="utf-8"))):
                found.setdefault(cited.rstrip("/"), []).append(path.relative_to(REPO).as_posix())
    return found


def test_the_scan_finds_the_citations():
    cited = _citations()
    assert {"BENCHMARKS.md", "docs/backends.md", "examples/multiwrite-numpy-plugin"} <= set(cited)


def test_every_cited_file_exists():
    missing = {cited: where for cited, where in _citations().items() if not (REPO / cited).exists()}
    assert missing == {}

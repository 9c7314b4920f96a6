"""The bench's terms, defined once: `bench --help`, the terminal report and the plot all print these.

Definitions as in BENCHMARKS.md (the project's performance anchors).
"""

from __future__ import annotations

import textwrap

from multiwrite.workload import CONFIGS


def config_definition(name: str) -> str:
    """`"G3"` -> `"G3: 3 groups, block sizes 16,32,8, kernel block sizes 16,16,8"`."""
    bs, kbs = CONFIGS[name]
    groups = f"{len(bs)} group{'s' if len(bs) > 1 else ''}"
    text = f"{name}: {groups}, block sizes {','.join(map(str, bs))}"
    if kbs != bs:
        text += f", kernel block sizes {','.join(map(str, kbs))}"
    return text


#: One line per term, in the order the report prints them.
TERMS = (
    "G1-G4: KV-cache group configurations: " + "; ".join(config_definition(n) for n in CONFIGS),
    "C: concurrency, the request slots (table rows) the scheduler keeps full; writes/step: median "
    "append_block_ids calls of a measured step",
    "fused: one BlockTables, one apply for every group (this library); per-group: one BlockTables and one "
    "apply per group; naive: one device tensor and slice assignment per write",
    "floor: the cheapest apply there is, nothing written: one empty backend call on a CPU; one empty Triton "
    "kernel launch (floor-triton; floor-torch: a one-element torch op) on a GPU",
    "staging + apply: host time of a scheduler step's append_block_ids calls plus its apply: the figure the "
    "staging goals judge; times are medians (p99) in microseconds, lower is better",
)


def help_text(intro: str, width: int = 78) -> str:
    """`intro` and the terms, wrapped to `width` columns, for a parser with `RawDescriptionHelpFormatter`."""
    terms = [textwrap.fill(t, width, initial_indent="  ", subsequent_indent="      ") for t in TERMS]
    return "\n".join([textwrap.fill(intro, width), "", "terms:", *terms])

"""The group-count sweep of `multiwrite bench --stage --groups`: the stage designs on tables of many KV-cache groups.

`STAGE_CONFIGS` are the configurations the stage designs run on: the anchors' G1-G4 (`workload.CONFIGS`) and two of
this bench's own, G11 and G20, named after the group counts of DeepSeek-V4 (11) and Kimi-K3 (20). Their per-group
shapes are ILLUSTRATIVE, not read from either model's configuration: a mix of the kinds of groups a hybrid model's
KV cache has, each kind drawn as the block table sees it (`GROUP_KINDS`):

- full attention: a block of 64 tokens (MLA-style, kernel block 64), or 256 with kernel block 64 (a compressed or
  sparse attention's larger manager block, written as 4 kernel blocks per block);
- sliding window: blocks of 16 or 32 tokens (kernel block 16); the table is as wide as full attention's (vLLM sizes
  every group's row by `cdiv(max_model_len, block_size)`), the window only masks what attention reads;
- mamba-like (recurrent state): one block per request, a block of `MAX_MODEL_LEN` tokens (kernel block = block), so
  a request's only write is its first chunk's.

What the bench leaves out of those kinds: the sliding window's masking in the gather (vLLM's
`sliding_window_reach`) and the mamba-like groups' disabled slot mappings (`slot_mapping_enabled`): every group is
gathered and slot-mapped alike, as G1-G4's are, against the same reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from multiwrite.workload import CONFIGS, MAX_MODEL_LEN

#: The kinds of group of G11 and G20: name -> (block size, kernel block size).
GROUP_KINDS = {
    "full-64": (64, 64),
    "full-256/64": (256, 64),
    "window-16": (16, 16),
    "window-32/16": (32, 16),
    "mamba-like": (MAX_MODEL_LEN, MAX_MODEL_LEN),
}
#: The bench's own configurations, as group kinds: G11 6 full attention, 3 sliding window, 2 mamba-like groups; G20
#: 5, 5 and 10 (a model of mostly linear-attention layers).
GROUP_MIXES = {
    "G11": ["full-64"] * 4 + ["full-256/64"] * 2 + ["window-16"] * 3 + ["mamba-like"] * 2,
    "G20": ["full-64"] * 4 + ["full-256/64"] * 1 + ["window-32/16"] * 5 + ["mamba-like"] * 10,
}


def _config(kinds: Sequence[str]) -> tuple[list[int], list[int]]:
    return [GROUP_KINDS[k][0] for k in kinds], [GROUP_KINDS[k][1] for k in kinds]


#: Every configuration the stage designs can run on: name -> (block sizes, kernel block sizes).
STAGE_CONFIGS: dict[str, tuple[list[int], list[int]]] = {
    **CONFIGS,
    **{name: _config(kinds) for name, kinds in GROUP_MIXES.items()},
}
#: `--groups N`: the configuration of N groups.
BY_GROUP_COUNT = {len(bs): name for name, (bs, _) in STAGE_CONFIGS.items()}


def describe(config: str) -> str:
    """One line naming a configuration's groups: `G3: 3 groups, block sizes [16, 32, 8] ...`."""
    bs, kbs = STAGE_CONFIGS[config]
    line = f"{config}: {len(bs)} groups, block sizes {bs}, kernel block sizes {kbs}"
    if config in GROUP_MIXES:
        kinds = GROUP_MIXES[config]
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in GROUP_KINDS if k in kinds)
        line += f" ({counts}; illustrative shapes: multiwrite.bench.groups)"
    return line


def group_counts(text: str) -> list[int]:
    """`"3,11,20"` -> `[3, 11, 20]` (argparse type of `--groups`): counts with a configuration in `BY_GROUP_COUNT`.

    Raises:
        ValueError: a count that is not an integer or has no configuration (the message lists the known ones).
    """
    known = ", ".join(str(n) for n in sorted(BY_GROUP_COUNT))
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"not a list of group counts: {text!r} (known: {known})") from None
    bad = [n for n in counts if n not in BY_GROUP_COUNT]
    if bad or not counts:
        raise ValueError(f"no configuration of {bad[0] if bad else 'no'} groups (known: {known})")
    return list(dict.fromkeys(counts))


def sweep_rows(rows: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    """The sweep table from `bench.stage`'s rows (several configurations): per (C, design) its step / empty-launch
    ratio per group count, and the change from the fewest groups to the most in % (headers, rows)."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    counts = [len(STAGE_CONFIGS[c][0]) for c in configs]
    ratio = {(r["C"], r["label"], r["config"]): r["step_x_empty"] for r in rows}
    out = []
    for c, label in dict.fromkeys((r["C"], r["label"]) for r in rows):
        values = [ratio.get((c, label, cfg), math.nan) for cfg in configs]
        first, last = values[0], values[-1]
        change = (last / first - 1) * 100 if first > 0 and math.isfinite(first) and math.isfinite(last) else math.nan
        out.append([str(c), label, *("-" if not math.isfinite(v) else f"{v:.2f}" for v in values),
                    "-" if not math.isfinite(change) else f"{change:+.0f}%"])  # fmt: skip
    heads = ["C", "design", *(f"{n} groups" for n in counts), f"{counts[-1]} vs {counts[0]}"]
    return heads, out

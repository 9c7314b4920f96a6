"""Reading and comparing tables: values on the host, a `BlockTables` against its reference."""

from __future__ import annotations

import numpy as np
import torch

from multiwrite.reference import ReferenceBlockTables

#: The backend of tests whose property does not depend on the backend (staging, argument checks): named, so that a
#: `MULTIWRITE_BACKEND` forcing a GPU backend (tox -e cuda) does not apply to them.
CPU = "torch-cpu"


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values on the host, as numpy."""
    return t.detach().cpu().numpy()


def examples(backend: object, native: int, interpreted: int = 4) -> int:
    """Hypothesis examples for a test on `backend` (a conftest `BackendCase`): Triton's interpreter runs a launch in
    tens of milliseconds, so it gets few."""
    return interpreted if getattr(backend, "interpreted", False) else native


def mismatches(bt, ref: ReferenceBlockTables) -> list[str]:
    """What differs between a `BlockTables` and a `ReferenceBlockTables` right after an apply of both: every group's
    device table, host `num_blocks` and `num_blocks_device`. Empty when equal."""
    bad = []
    for g, t in enumerate(bt.block_tables):
        got, want = host(t.tensor), ref.tables[g]
        if not np.array_equal(got, want):
            cells = np.argwhere(got != want)[:5].tolist()
            bad.append(f"group {g}: cells {cells} differ (got {[int(got[r, c]) for r, c in cells]}, "
                       f"want {[int(want[r, c]) for r, c in cells]})")  # fmt: skip
    if not np.array_equal(bt.num_blocks, ref.num_blocks):
        bad.append(f"num_blocks {bt.num_blocks.tolist()} != {ref.num_blocks.tolist()}")
    if not np.array_equal(host(bt.num_blocks_device), ref.num_blocks_applied):
        bad.append(f"num_blocks_device {host(bt.num_blocks_device).tolist()} != {ref.num_blocks_applied.tolist()}")
    return bad

"""`apply_grid` (`backends/triton/device.py`): the one tiling rule of the apply programs, which the eager Python path
(`TritonPlan._stage`, `TritonDevice.launch_apply`) and the compiled stage entry both call; its compiled form
(`_cstaging.apply_grid`, which the entry's C calls directly) against its Python twin and against hand-computed grids."""

from __future__ import annotations

import numpy as np
import pytest

from multiwrite.backends.triton.device import apply_grid, py_apply_grid
from multiwrite.staging.fields import _cstaging

#: The apply kernel's tiling on NVIDIA (decode tiles of 128 writes, tiles of 16 x 64 cells, 256 preloaded values,
#: 64 splits at most) and an H200's programs in flight (8 x 132 SMs).
APPLY = (128, 16, 256, 64, 64)
H200 = 1056

CASES = [
    # (writes, values, rounds, tiling, max_programs) -> (tiles, splits)
    ((40, 900, 3, APPLY, H200), (1, 1)),  # overlapping rounds: one program
    ((10, 200, 1, APPLY, H200), (1, 1)),  # decode: one tile of 128 writes
    ((300, 256, 1, APPLY, H200), (3, 1)),  # 256 values are still preloaded
    ((300, 257, 1, APPLY, H200), (19, 5)),  # 257 are not: 16-write tiles, ceil(257 / 64) splits
    ((20, 1000, 1, APPLY, H200), (2, 16)),
    ((1, 10_000, 1, APPLY, H200), (1, 64)),  # at most 64 splits
    ((100, 100_000, 1, APPLY, 8), (7, 1)),  # at most 8 programs: 8 // 7 splits
    ((0, 300, 1, APPLY, H200), (0, 5)),  # (no writes: no tiles; the split count is then unused)
    ((33, 500, 1, (64, 64, 128, 128, 64), H200), (1, 4)),  # the stage kernel's tiling: one tile width
]


@pytest.mark.parametrize(("args", "grid"), CASES)
def test_the_grid_of_a_batch_is_the_documented_one(args, grid):
    assert py_apply_grid(*args) == grid
    assert apply_grid(*args) == grid


@pytest.mark.skipif(_cstaging is None, reason="the compiled staging helper is not built")
def test_the_compiled_rule_is_its_python_twin():
    rng = np.random.default_rng(7)
    for _ in range(3000):
        tiling = tuple(int(x) for x in rng.integers(1, 300, 5))
        args = (int(rng.integers(0, 5000)), int(rng.integers(0, 200_000)), int(rng.integers(1, 4)), tiling,
                int(rng.integers(1, 2000)))  # fmt: skip
        assert _cstaging.apply_grid(*args) == py_apply_grid(*args), args


@pytest.mark.skipif(_cstaging is None, reason="the compiled staging helper is not built")
@pytest.mark.parametrize("args", [(1, 1, 1, (1, 1, 0, 1, 1), 8), (1, 1, 1, (1, 1, 1, 1), 8), (1, 1, 1, APPLY, 0),
                                  (-1, 1, 1, APPLY, 8), (1, 1, 1, APPLY)])  # fmt: skip
def test_the_compiled_rule_refuses_what_has_no_grid(args):
    with pytest.raises(TypeError, match="apply_grid\\(num_writes, num_values, rounds, tiling, max_programs\\)"):
        _cstaging.apply_grid(*args)

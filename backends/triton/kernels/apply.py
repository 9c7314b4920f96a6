"""The apply kernel: one launch lands a batch of staged writes (any number of tables of one dtype), then hands its
staging memory back (`common.release_staging`).

Grid: (tiles of `BLOCK_W` writes, column splits of each tile's cells). A batch with overlapping writes comes in
rounds (a row's later writes in later rounds) and runs as one program that lands round after round. A batch of at
most `PRELOADED_VALUES` values (a decode step) is loaded whole by every program at the same time as its metadata,
so the values do not wait for a second round trip over PCIe.
"""

from __future__ import annotations

import triton
import triton.language as tl

from multiwrite.backends.triton.kernels.common import (
    apply_rounds,
    load_descriptors,
    release_staging,
)

#: Kernel parameters that vary per launch; none may become a specialization key (no recompiles).
DO_NOT_SPECIALIZE = ("desc_addr", "meta_addr", "values_addr", "bounds_addr", "counter_addr", "done_addr", "token",
                     "num_tables", "num_writes", "num_values", "num_rounds")  # fmt: skip
#: Tables whose descriptors every program loads up front (more: one dependent load per write).
NT: tl.constexpr = tl.constexpr(8)
#: A batch of at most this many values is loaded whole, with its metadata.
PRELOADED_VALUES: tl.constexpr = tl.constexpr(256)


def apply_kernel_fn(
    desc_addr: tl.int64,  # device int64 [num_tables, 5] table descriptors
    meta_addr: tl.int64,  # int32 [num_writes, 5] metadata (pinned host memory on a GPU)
    values_addr: tl.int64,  # [num_values] of VALUE_DTYPE (pinned host memory on a GPU)
    bounds_addr: tl.int64,  # int32 [num_rounds + 1] first write of each round (read only if num_rounds > 1)
    counter_addr: tl.int64,  # device int32: programs of this launch that finished
    done_addr: tl.int64,  # int32 completion word: receives `token` when every program has finished
    token: tl.int32,
    num_tables: tl.int32,
    num_writes: tl.int32,
    num_values: tl.int32,
    num_rounds: tl.int32,
    VALUE_DTYPE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Land `num_writes` staged writes (module docstring)."""
    pid_w = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_w = tl.num_programs(0)
    n_s = tl.num_programs(1)
    meta = meta_addr.to(tl.pointer_type(tl.int32))
    values = values_addr.to(tl.pointer_type(VALUE_DTYPE))
    bounds = bounds_addr.to(tl.pointer_type(tl.int32))
    base_all, row_stride_all, col_stride_all, rows_all, cols_all = load_descriptors(desc_addr, num_tables, NT)
    few = num_tables <= NT  # every descriptor preloaded
    lanes_v = tl.arange(0, PRELOADED_VALUES)
    preloaded = num_values <= PRELOADED_VALUES
    values_all = tl.load(values + lanes_v, mask=lanes_v < num_values * preloaded.to(tl.int32), other=0,
                         cache_modifier=".cv")  # fmt: skip
    apply_rounds(meta, bounds, num_rounds, num_writes, pid_w * BLOCK_W, n_w * BLOCK_W, desc_addr, few, base_all,
                 row_stride_all, col_stride_all, rows_all, cols_all, num_tables, values, values_all, preloaded,
                 num_values, pid_s * BLOCK_L, n_s * BLOCK_L, VALUE_DTYPE, BLOCK_W, BLOCK_L, NT)  # fmt: skip
    release_staging(done_addr, token, counter_addr, n_w * n_s)


apply_kernel = triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)(apply_kernel_fn)


def noop_args(done_addr: int, counter_addr: int, token: int) -> tuple:
    """Arguments of a launch that writes nothing and stores `token` into `done_addr` (validation of a launcher)."""
    return (0, 0, 0, 0, counter_addr, done_addr, token, 0, 0, 0, 1)

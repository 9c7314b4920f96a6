/* multiwrite.staging._cstaging: the apply programs' tiling (_cstaging_grid.c). */
#ifndef MW_CSTAGING_GRID_H
#define MW_CSTAGING_GRID_H

#include "_cstaging.h"

/* The apply programs of a batch of w writes and v values in `rounds` overlap rounds: grid[0] tiles of tiling[0]
 * writes (a decode batch: v <= tiling[2] values) or tiling[1] writes, grid[1] column splits of tiling[3] cells, at
 * most tiling[4] and max_programs in all (apply_grid, the one rule of TritonPlan._stage and launch_apply). */
MW_INTERNAL void mw_apply_grid(long long w, long long v, long long rounds, const long long tiling[5],
                               long long max_programs, long long grid[2]);
/* apply_grid(num_writes, num_values, rounds, tiling, max_programs) -> (tiles, splits): mw_apply_grid for Python. */
MW_INTERNAL PyObject *mw_apply_grid_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif

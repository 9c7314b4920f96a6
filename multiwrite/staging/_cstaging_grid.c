/*
 * multiwrite.staging._cstaging, part: the tiling of the apply programs, the one rule that TritonPlan._stage,
 * TritonDevice.launch_apply (through the module function apply_grid) and the stage entry (_cstaging_prepare.c) use;
 * its Python twin is multiwrite/backends/triton/device.py's py_apply_grid.
 */
#include "_cstaging_grid.h"

void mw_apply_grid(long long w, long long v, long long rounds, const long long tiling[5], long long max_programs,
                   long long grid[2]) {
    if (rounds > 1) { /* (overlapping writes: one program applies the rounds in order) */
        grid[0] = grid[1] = 1;
        return;
    }
    if (v <= tiling[2]) { /* (a decode step: many short writes, one program per tile of decode_w writes) */
        grid[0] = (w + tiling[0] - 1) / tiling[0];
        grid[1] = 1;
        return;
    }
    const long long tiles = (w + tiling[1] - 1) / tiling[1];
    long long splits = (v + tiling[3] - 1) / tiling[3];
    splits = splits < tiling[4] ? splits : tiling[4];
    const long long room = max_programs / (tiles > 1 ? tiles : 1);
    splits = splits < room ? splits : room;
    grid[0] = tiles;
    grid[1] = splits > 1 ? splits : 1;
}

PyObject *mw_apply_grid_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const char usage[] = "apply_grid(num_writes, num_values, rounds, tiling, max_programs): tiling a tuple "
                                "of 5 positive ints (decode_w, tile_w, preloaded, tile_l, max_splits), max_programs "
                                "a positive int";
    if (nargs != 5 || !PyTuple_Check(args[3]) || PyTuple_GET_SIZE(args[3]) != 5)
        return mw_usage_error(usage);
    long long n[4], tiling[5], grid[2];
    const int from[4] = {0, 1, 2, 4};
    for (int i = 0; i < 4; i++) {
        n[i] = PyLong_AsLongLong(args[from[i]]);
        if (n[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    for (int i = 0; i < 5; i++) {
        tiling[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[3], i));
        if (tiling[i] == -1 && PyErr_Occurred())
            return NULL;
        if (tiling[i] < 1)
            return mw_usage_error(usage);
    }
    if (n[0] < 0 || n[1] < 0 || n[3] < 1)
        return mw_usage_error(usage);
    mw_apply_grid(n[0], n[1], n[2], tiling, n[3], grid);
    return Py_BuildValue("(LL)", grid[0], grid[1]);
}

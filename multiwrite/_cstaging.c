/*
 * multiwrite._cstaging: the hot path of BlockTables.append_block_ids, compiled.
 *
 * One call stages one request's new block ids for every KV-cache group: it checks them, expands each
 * manager id b into the k kernel block ids b*k + j, stores the values and one metadata row per written
 * group into the staging arena's numpy arrays, records (row, table) keys for overlap detection, and
 * updates the host num_blocks. It either does all of that or nothing: every check runs before anything
 * is committed, and on any doubt it returns a status so that the pure-Python path (which raises the
 * precise StagedWriteError) takes over.
 *
 * The arena's arrays are passed as raw addresses inside an int64 context array owned by BlockTables
 * (see block_tables.py, `_context`); Python refreshes it whenever an array is reallocated.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum {
    CTX_META = 0,      /* int32 [meta_cap, 5] */
    CTX_META_CAP = 1,  /* rows */
    CTX_VALUES = 2,    /* int32 [values_cap] */
    CTX_VALUES_CAP = 3,
    CTX_NUM_BLOCKS = 4, /* int32 [num_groups, max_num_reqs] */
    CTX_MAX_REQS = 5,
    CTX_GROUPS = 6,
    CTX_GROUP0 = 7, /* per group: k, width, max_id */
};

#define STATUS_GROW 1     /* not enough room in the arena: grow it and call again */
#define STATUS_FALLBACK 2 /* invalid or unusual input: let the Python path handle it */

/* stage_block_ids(ctx_addr, num_writes, num_values, rows_seen, req, new_block_ids, overwrite)
 *   -> (num_writes, num_values, overlapped) or an int status. */
static PyObject *stage_block_ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "stage_block_ids takes 7 arguments");
        return NULL;
    }
    const int64_t *ctx = (const int64_t *)PyLong_AsVoidPtr(args[0]);
    Py_ssize_t w = PyLong_AsSsize_t(args[1]);
    Py_ssize_t v = PyLong_AsSsize_t(args[2]);
    PyObject *rows_seen = args[3];
    PyObject *req_obj = args[4];
    PyObject *groups_obj = args[5];
    int overwrite = PyObject_IsTrue(args[6]);
    if (ctx == NULL || w < 0 || v < 0 || overwrite < 0 || !PySet_Check(rows_seen)) {
        PyErr_Clear();
        return PyLong_FromLong(STATUS_FALLBACK);
    }
    if (!PyLong_CheckExact(req_obj) || !(PyList_CheckExact(groups_obj) || PyTuple_CheckExact(groups_obj)))
        return PyLong_FromLong(STATUS_FALLBACK);
    const Py_ssize_t num_groups = (Py_ssize_t)ctx[CTX_GROUPS];
    const Py_ssize_t max_reqs = (Py_ssize_t)ctx[CTX_MAX_REQS];
    int overflow = 0;
    long long req = PyLong_AsLongLongAndOverflow(req_obj, &overflow);
    if (overflow || req < 0 || req >= max_reqs || PySequence_Fast_GET_SIZE(groups_obj) != num_groups ||
        num_groups > 64)
        return PyLong_FromLong(STATUS_FALLBACK);
    PyObject **groups = PySequence_Fast_ITEMS(groups_obj);
    int32_t *meta = (int32_t *)(intptr_t)ctx[CTX_META];
    int32_t *values = (int32_t *)(intptr_t)ctx[CTX_VALUES];
    int32_t *num_blocks = (int32_t *)(intptr_t)ctx[CTX_NUM_BLOCKS];

    /* Pass 1: sizes and bounds, nothing written. */
    int64_t starts[64], cells[64];
    Py_ssize_t writes_needed = 0, values_needed = 0;
    for (Py_ssize_t g = 0; g < num_groups; g++) {
        PyObject *ids = groups[g];
        if (!(PyList_CheckExact(ids) || PyTuple_CheckExact(ids)))
            return PyLong_FromLong(STATUS_FALLBACK);
        const int64_t *grp = ctx + CTX_GROUP0 + 3 * g;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
        cells[g] = -1;
        if (n == 0 && !overwrite)
            continue;
        int64_t start = overwrite ? 0 : num_blocks[g * max_reqs + req];
        int64_t c = (int64_t)n * grp[0];
        if (start + c > grp[1])
            return PyLong_FromLong(STATUS_FALLBACK);
        starts[g] = start;
        cells[g] = c;
        writes_needed += 1;
        values_needed += (Py_ssize_t)c;
    }
    if (w + writes_needed > ctx[CTX_META_CAP] || v + values_needed > ctx[CTX_VALUES_CAP])
        return PyLong_FromLong(STATUS_GROW);

    /* Pass 2: values and metadata into the uncommitted tail of the arena. */
    Py_ssize_t w1 = w, v1 = v;
    for (Py_ssize_t g = 0; g < num_groups; g++) {
        if (cells[g] < 0)
            continue;
        const int64_t *grp = ctx + CTX_GROUP0 + 3 * g;
        const int64_t k = grp[0], max_id = grp[2];
        PyObject *ids = groups[g];
        Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
        PyObject **items = PySequence_Fast_ITEMS(ids);
        const Py_ssize_t v0 = v1;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = items[i];
            if (!PyLong_Check(item))
                return PyLong_FromLong(STATUS_FALLBACK);
            long long b = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow || b < 0 || b > max_id) {
                PyErr_Clear();
                return PyLong_FromLong(STATUS_FALLBACK);
            }
            int64_t base = (int64_t)b * k;
            for (int64_t j = 0; j < k; j++)
                values[v1++] = (int32_t)(base + j);
        }
        int32_t *row = meta + 5 * w1;
        row[0] = (int32_t)g;
        row[1] = (int32_t)req;
        row[2] = (int32_t)starts[g];
        row[3] = (int32_t)cells[g];
        row[4] = (int32_t)v0;
        w1 += 1;
    }

    /* Pass 3: commit (overlap keys, num_blocks). Nothing below can fail but the set insertion. */
    int overlapped = 0;
    for (Py_ssize_t g = 0; g < num_groups; g++) {
        if (cells[g] < 0)
            continue;
        PyObject *key = PyLong_FromLongLong((req << 16) | (long long)g);
        if (key == NULL)
            return NULL;
        int seen = PySet_Contains(rows_seen, key);
        if (seen == 0)
            seen = PySet_Add(rows_seen, key) < 0 ? -1 : 0;
        Py_DECREF(key);
        if (seen < 0)
            return NULL;
        overlapped |= seen;
        num_blocks[g * max_reqs + req] = (int32_t)(starts[g] + cells[g]);
    }
    return Py_BuildValue("nni", w1, v1, overlapped);
}

static PyMethodDef methods[] = {
    {"stage_block_ids", (PyCFunction)(void (*)(void))stage_block_ids, METH_FASTCALL,
     "Stage one request's block ids for every group; see multiwrite/_cstaging.c."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "multiwrite._cstaging",
                                    "Compiled staging hot path of BlockTables.", -1, methods};

PyMODINIT_FUNC PyInit__cstaging(void) { return PyModule_Create(&module); }

/*
 * multiwrite._cstaging: the compiled hot paths: BlockTables.append_block_ids, and the compiled-cpu
 * backend's scatter (`scatter_writes`, at the end of this file).
 *
 * One call stages one request's new block ids for every KV-cache group: it checks them, expands each
 * manager id b into the k kernel block ids b*k + j, stores the values and one metadata row per written
 * group into the staging arena's numpy arrays, records (row, table) keys for overlap detection, and
 * updates the host num_blocks. It either does all of that or nothing: every check runs before anything
 * is committed, and on any doubt it returns a status so that the pure-Python path (which raises the
 * precise StagedWriteError) takes over.
 *
 * Each call that stages into another arena than the one that staged last (the shared staging clock,
 * CTX_CLOCK) starts a run of this arena (`StagingArena.begin_run`), so writes of arenas applied together
 * keep their true staging order.
 *
 * The arena's arrays are reached through raw addresses in an int64 context array owned by BlockTables
 * (see block_tables.py, `_context`), refreshed through `_refresh_context` whenever the arena's
 * `generation` says its arrays moved (growth, or a new slot lent by a GPU backend after an apply).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum {
    CTX_META = 0,      /* int32 [meta_cap, 5] */
    CTX_META_CAP = 1,  /* rows */
    CTX_VALUES = 2,    /* int32 [values_cap] */
    CTX_VALUES_CAP = 3,
    CTX_NUM_BLOCKS = 4, /* int32 [num_groups, max_num_reqs] */
    CTX_MAX_REQS = 5,
    CTX_GROUPS = 6,
    CTX_GENERATION = 7, /* the arena's `generation` the addresses above belong to */
    CTX_COUNTS_TABLE = 8, /* table index of num_blocks' [max_num_reqs, num_groups] view, or -1 */
    CTX_STAMPS = 9,       /* int64 [num_tables, max_num_reqs]: epoch of the last staged write per (table, row) */
    CTX_EPOCH = 10,       /* the current batch's epoch: a stamp equal to it means "already written" */
    CTX_CLOCK = 11,       /* int64 [2]: the staging clock shared by every arena (staging.STAGE_CLOCK) */
    CTX_ARENA_UID = 12,   /* this arena's uid on that clock */
    CTX_NUM_BLOCKS_APPLIED = 13, /* int32 [num_groups, max_num_reqs]: a row's counts before its first
                                  * change in this batch, i.e. as of the last apply (for clears) */
    CTX_GROUP0 = 14,      /* per group: k, width, max_id */
};

#define STATUS_GROW 1     /* not enough room in the arena: grow it and call again */
#define STATUS_FALLBACK 2 /* invalid or unusual input: let the Python path handle it */

/* Stage one call. Returns 0 (staged: *w_out, *v_out, *overlapped set), STATUS_GROW, STATUS_FALLBACK,
 * or -1 with a Python exception set. */
static int stage_core(const int64_t *ctx, Py_ssize_t w, Py_ssize_t v, PyObject *req_obj,
                      PyObject *groups_obj, int overwrite, Py_ssize_t *w_out, Py_ssize_t *v_out, int *overlapped_out) {
    if (!PyLong_CheckExact(req_obj) || !(PyList_CheckExact(groups_obj) || PyTuple_CheckExact(groups_obj)))
        return STATUS_FALLBACK;
    const Py_ssize_t num_groups = (Py_ssize_t)ctx[CTX_GROUPS];
    const Py_ssize_t max_reqs = (Py_ssize_t)ctx[CTX_MAX_REQS];
    int overflow = 0;
    long long req = PyLong_AsLongLongAndOverflow(req_obj, &overflow);
    if (overflow || req < 0 || req >= max_reqs || PySequence_Fast_GET_SIZE(groups_obj) != num_groups ||
        num_groups > 64)
        return STATUS_FALLBACK;
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
            return STATUS_FALLBACK;
        const int64_t *grp = ctx + CTX_GROUP0 + 3 * g;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
        cells[g] = -1;
        if (n == 0 && !overwrite)
            continue;
        int64_t start = overwrite ? 0 : num_blocks[g * max_reqs + req];
        int64_t c = (int64_t)n * grp[0];
        if (start + c > grp[1])
            return STATUS_FALLBACK;
        starts[g] = start;
        cells[g] = c;
        writes_needed += 1;
        values_needed += (Py_ssize_t)c;
    }
    const int64_t counts_table = ctx[CTX_COUNTS_TABLE];
    if (counts_table >= 0 && writes_needed) { /* the request's new counts, one more row write */
        writes_needed += 1;
        values_needed += num_groups;
    }
    if (w + writes_needed > ctx[CTX_META_CAP] || v + values_needed > ctx[CTX_VALUES_CAP])
        return STATUS_GROW;

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
            if (!PyLong_CheckExact(item)) /* bools, int subclasses, numpy scalars: the Python path decides */
                return STATUS_FALLBACK;
            long long b = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow || b < 0 || b > max_id) {
                PyErr_Clear();
                return STATUS_FALLBACK;
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
    if (counts_table >= 0 && w1 != w) {
        int32_t *row = meta + 5 * w1;
        row[0] = (int32_t)counts_table;
        row[1] = (int32_t)req;
        row[2] = 0;
        row[3] = (int32_t)num_groups;
        row[4] = (int32_t)v1;
        for (Py_ssize_t g = 0; g < num_groups; g++)
            values[v1++] = cells[g] >= 0 ? (int32_t)(starts[g] + cells[g]) : num_blocks[g * max_reqs + req];
        w1 += 1;
    }

    /* Pass 3: commit. A (table, row) already stamped with this batch's epoch was written before in the
     * same batch: those writes may overlap. */
    int overlapped = 0;
    int64_t *stamps = (int64_t *)(intptr_t)ctx[CTX_STAMPS];
    const int64_t epoch = ctx[CTX_EPOCH];
    for (Py_ssize_t g = 0; g <= num_groups; g++) {
        int64_t table = g;
        if (g == num_groups) { /* the counts row */
            if (counts_table < 0 || w1 == w)
                break;
            table = counts_table;
        } else if (cells[g] < 0)
            continue;
        int64_t *stamp = stamps + table * max_reqs + req;
        overlapped |= *stamp == epoch;
        if (g == num_groups && *stamp != epoch) { /* first change of the row's counts in this batch */
            int32_t *applied = (int32_t *)(intptr_t)ctx[CTX_NUM_BLOCKS_APPLIED];
            for (Py_ssize_t gg = 0; gg < num_groups; gg++)
                applied[gg * max_reqs + req] = num_blocks[gg * max_reqs + req];
        }
        *stamp = epoch;
    }
    for (Py_ssize_t g = 0; g < num_groups; g++)
        if (cells[g] >= 0)
            num_blocks[g * max_reqs + req] = (int32_t)(starts[g] + cells[g]);
    *w_out = w1;
    *v_out = v1;
    *overlapped_out = overlapped;
    return 0;
}

static PyObject *s_arena, *s_context_addr, *s_generation, *s_num_writes, *s_num_values, *s_may_overlap,
    *s_refresh, *s_python_path, *s_begin_run;

static int get_ssize(PyObject *obj, PyObject *name, Py_ssize_t *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    *out = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_ssize(PyObject *obj, PyObject *name, Py_ssize_t value) {
    PyObject *boxed = PyLong_FromSsize_t(value);
    if (boxed == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, boxed);
    Py_DECREF(boxed);
    return rc;
}

/* append_block_ids(block_tables, req_index, new_block_ids, overwrite): BlockTables.append_block_ids.
 * Stages through the arena's arrays in C; hands anything unusual (errors included) to the Python path,
 * `block_tables._append_block_ids_python`, which raises the precise StagedWriteError. */
static PyObject *append_block_ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "append_block_ids takes 4 arguments");
        return NULL;
    }
    PyObject *bt = args[0], *req = args[1], *groups = args[2];
    int overwrite = PyObject_IsTrue(args[3]);
    if (overwrite < 0)
        return NULL;
    PyObject *arena = PyObject_GetAttr(bt, s_arena);
    if (arena == NULL)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t ctx_addr, generation, w, v, w1, v1;
    int overlapped, status;
    for (int attempt = 0;; attempt++) {
        if (get_ssize(bt, s_context_addr, &ctx_addr) < 0 || get_ssize(arena, s_generation, &generation) < 0)
            goto done;
        const int64_t *ctx = (const int64_t *)(intptr_t)ctx_addr;
        if (generation != ctx[CTX_GENERATION]) { /* the arena's arrays moved: point the context at them */
            PyObject *r = PyObject_CallMethodNoArgs(bt, s_refresh);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        }
        if (get_ssize(arena, s_num_writes, &w) < 0 || get_ssize(arena, s_num_values, &v) < 0)
            goto done;
        status = stage_core(ctx, w, v, req, groups, overwrite, &w1, &v1, &overlapped);
        if (status < 0)
            goto done;
        if (status == 0) {
            if (w1 != w && ((const int64_t *)(intptr_t)ctx[CTX_CLOCK])[0] != ctx[CTX_ARENA_UID]) {
                /* another arena staged last: these writes start a run (recorded at the current num_writes) */
                PyObject *r = PyObject_CallMethodNoArgs(arena, s_begin_run);
                if (r == NULL)
                    goto done;
                Py_DECREF(r);
            }
            if (w1 != w) {
                if (set_ssize(arena, s_num_writes, w1) < 0 || set_ssize(arena, s_num_values, v1) < 0 ||
                    (overlapped && PyObject_SetAttr(arena, s_may_overlap, Py_True) < 0))
                    goto done;
            }
            result = Py_NewRef(Py_None);
            goto done;
        }
        if (status == STATUS_GROW && attempt == 0) { /* room for every group's ids, then once more */
            Py_ssize_t needed = 0, num_groups = (Py_ssize_t)ctx[CTX_GROUPS];
            PyObject **items = PySequence_Fast_ITEMS(groups); /* stage_core checked: list or tuple */
            for (Py_ssize_t g = 0; g < num_groups; g++)
                needed += PySequence_Fast_GET_SIZE(items[g]) * (Py_ssize_t)ctx[CTX_GROUP0 + 3 * g];
            PyObject *r = PyObject_CallMethod(arena, "reserve", "nn", num_groups, needed);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
            continue;
        }
        PyObject *fallback_args[3] = {req, groups, args[3]};
        PyObject *method = PyObject_GetAttr(bt, s_python_path);
        if (method == NULL)
            goto done;
        result = PyObject_Vectorcall(method, fallback_args, 3, NULL);
        Py_DECREF(method);
        goto done;
    }
done:
    Py_DECREF(arena);
    return result;
}

/* scatter_writes(meta, values, tables): apply a WriteBatch to tables in host memory, in staging order
 * (so where writes overlap the later one wins). meta: C-contiguous int32 [num_writes, 5] (table, row,
 * start, length, value offset); values: C-contiguous 1-D buffer of 4- or 8-byte items; tables:
 * C-contiguous int64 [num_tables, 5] (base address, row stride, column stride, rows, columns; strides
 * in elements of the values' item size). Every write is checked against its table's shape and the
 * values first; on a bad one nothing is written and ValueError is raised, naming the write, its table
 * index and shape, row, start, length and value offset. Empty writes are no-ops (not checked but for
 * their table index). With a true 4th argument `check_only`, only the checks run. */
static PyObject *scatter_writes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "scatter_writes takes 3 or 4 arguments");
        return NULL;
    }
    const int check_only = nargs == 4 ? PyObject_IsTrue(args[3]) : 0;
    if (check_only < 0)
        return NULL;
    Py_buffer mb = {0}, vb = {0}, tb = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[0], &mb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &vb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    if (PyObject_GetBuffer(args[2], &tb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    if (mb.itemsize != 4 || (vb.itemsize != 4 && vb.itemsize != 8) || tb.itemsize != 8 || mb.len % 20 ||
        tb.len % 40) {
        PyErr_SetString(PyExc_ValueError, "scatter_writes: meta int32 [w, 5], values of 4 or 8 bytes, tables int64 [t, 5]");
        goto done;
    }
    const int32_t *meta = (const int32_t *)mb.buf;
    const int64_t *tables = (const int64_t *)tb.buf;
    const Py_ssize_t num_writes = mb.len / 20, num_tables = tb.len / 40, item = vb.itemsize;
    const Py_ssize_t num_values = vb.len / item;
    for (Py_ssize_t w = 0; w < num_writes; w++) { /* check everything before writing anything */
        const int32_t *m = meta + 5 * w;
        if (m[0] < 0 || m[0] >= num_tables) {
            PyErr_Format(PyExc_ValueError, "scatter_writes: write %zd (table %d of a batch of %zd tables, row %d, "
                         "start %d, length %d) names no table of the batch; nothing was written",
                         w, m[0], num_tables, m[1], m[2], m[3]);
            goto done;
        }
        if (m[3] == 0)
            continue;
        const int64_t *t = tables + 5 * (int64_t)m[0];
        if (m[1] < 0 || m[1] >= t[3] || m[2] < 0 || m[3] < 0 || (int64_t)m[2] + m[3] > t[4] || m[4] < 0 ||
            (int64_t)m[4] + m[3] > num_values) {
            PyErr_Format(PyExc_ValueError, "scatter_writes: write %zd (table %d, row %d, start %d, length %d) "
                         "is outside its table (shape (%lld, %lld)) or the values (offset %d of %zd); "
                         "nothing was written", w, m[0], m[1], m[2], m[3], (long long)t[3], (long long)t[4], m[4],
                         num_values);
            goto done;
        }
    }
    const char *src = (const char *)vb.buf;
    for (Py_ssize_t w = 0; !check_only && w < num_writes; w++) {
        const int32_t *m = meta + 5 * w;
        if (m[3] == 0)
            continue;
        const int64_t *t = tables + 5 * (int64_t)m[0];
        char *dst = (char *)(intptr_t)t[0] + ((int64_t)m[1] * t[1] + (int64_t)m[2] * t[2]) * item;
        const char *from = src + (int64_t)m[4] * item;
        if (t[2] == 1) {
            memmove(dst, from, (size_t)m[3] * item);
        } else {
            for (int32_t c = 0; c < m[3]; c++)
                memcpy(dst + (int64_t)c * t[2] * item, from + (int64_t)c * item, item);
        }
    }
    result = Py_NewRef(Py_None);
done:
    if (mb.obj)
        PyBuffer_Release(&mb);
    if (vb.obj)
        PyBuffer_Release(&vb);
    if (tb.obj)
        PyBuffer_Release(&tb);
    return result;
}

static PyMethodDef methods[] = {
    {"append_block_ids", (PyCFunction)(void (*)(void))append_block_ids, METH_FASTCALL,
     "append_block_ids(block_tables, req_index, new_block_ids, overwrite): BlockTables.append_block_ids "
     "staged in C; see multiwrite/_cstaging.c."},
    {"scatter_writes", (PyCFunction)(void (*)(void))scatter_writes, METH_FASTCALL,
     "scatter_writes(meta, values, tables[, check_only]): apply a WriteBatch to host-memory tables in "
     "staging order, every write checked first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "multiwrite._cstaging",
                                    "Compiled staging hot path of BlockTables.", -1, methods};

PyMODINIT_FUNC PyInit__cstaging(void) {
    s_arena = PyUnicode_InternFromString("_arena");
    s_context_addr = PyUnicode_InternFromString("_context_addr");
    s_generation = PyUnicode_InternFromString("generation");
    s_num_writes = PyUnicode_InternFromString("num_writes");
    s_num_values = PyUnicode_InternFromString("num_values");
    s_may_overlap = PyUnicode_InternFromString("may_overlap");
    s_refresh = PyUnicode_InternFromString("_refresh_context");
    s_python_path = PyUnicode_InternFromString("_append_block_ids_python");
    s_begin_run = PyUnicode_InternFromString("begin_run");
    if (!s_arena || !s_context_addr || !s_generation || !s_num_writes || !s_num_values ||
        !s_may_overlap || !s_refresh || !s_python_path || !s_begin_run)
        return NULL;
    return PyModule_Create(&module);
}

/*
 * multiwrite.staging._cstaging, part: BlockIdStaging, the base class of BlockTables.
 *
 * BlockTables.append_block_ids and append_block_ids_batch, compiled: they stage a request's new manager block ids
 * straight into the staging arena (values and metadata into its lease's tail, then one commit of the counters), and
 * _bind_staging hands them the arrays they write (num_blocks, applied, stamps) once. A call it does not take exactly
 * (anything unusual, any error, no room) goes to the Python twin (multiwrite/staging/block_ids.py, the functions
 * set_fallbacks in _cstaging.c binds), which stages it or raises.
 */
#include "_cstaging.h"

/* ---- BlockIdStaging: BlockTables.append_block_ids ------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    ArenaFields *arena;  /* the arena all groups stage into (strong), NULL before _bind_staging */
    PyObject *num_blocks, *applied, *stamps, *groups; /* strong: the arrays below stay valid */
    Py_buffer nb_view, ap_view, st_view;
    int32_t *nb;         /* int32 [num_groups, max_reqs]: kernel blocks per request and group, as staged */
    int32_t *ap;         /* int32 [num_groups, max_reqs]: a row's counts as of the last landed batch */
    int64_t *st;         /* int64 [num_groups + 1, max_reqs]: batch number of the last write per (table, row) */
    Py_ssize_t num_groups, max_reqs;
    int64_t info[MAX_GROUPS][3]; /* per group: k (kernel blocks per block), row width (cells), largest id */
} BlockIdStaging;

static PyMemberDef staging_members[] = {
    {"staging_arena", T_OBJECT, offsetof(BlockIdStaging, arena), READONLY, "the staging arena"},
    {"staging_num_blocks", T_OBJECT, offsetof(BlockIdStaging, num_blocks), READONLY, "host num_blocks"},
    {"staging_applied", T_OBJECT, offsetof(BlockIdStaging, applied), READONLY, "num_blocks of the last batch"},
    {"staging_stamps", T_OBJECT, offsetof(BlockIdStaging, stamps), READONLY, "batch number per (table, row)"},
    {"staging_groups", T_OBJECT, offsetof(BlockIdStaging, groups), READONLY, "(k, width, largest id) per group"},
    {NULL},
};

/* Stage one call into the arena: 0 (staged, counters moved), STATUS_FALLBACK (nothing changed), -1 (error set).
 * flags: MW_EXTRA_GROUPS, MW_NULL_BLOCK (_cstaging.h). */
static int stage_core(BlockIdStaging *s, PyObject *req_obj, PyObject *groups_obj, int overwrite, int flags) {
    ArenaFields *arena = s->arena;
    if (!PyLong_CheckExact(req_obj) || !(PyList_CheckExact(groups_obj) || PyTuple_CheckExact(groups_obj)))
        return STATUS_FALLBACK;
    const Py_ssize_t G = s->num_groups, R = s->max_reqs;
    int overflow = 0;
    long long req = PyLong_AsLongLongAndOverflow(req_obj, &overflow);
    const Py_ssize_t given = PySequence_Fast_GET_SIZE(groups_obj);
    if (overflow || req < 0 || req >= R || given < G || (given > G && !(flags & MW_EXTRA_GROUPS)))
        return STATUS_FALLBACK;
    PyObject **groups = PySequence_Fast_ITEMS(groups_obj);
    const Py_ssize_t w = arena->num_writes, v = arena->num_values;
    int32_t *meta = (int32_t *)(intptr_t)arena->meta_addr;
    int32_t *values = (int32_t *)(intptr_t)arena->values_addr;

    /* Pass 1: sizes and bounds; nothing written. */
    int64_t starts[MAX_GROUPS], cells[MAX_GROUPS];
    Py_ssize_t writes = 0, cells_total = 0;
    for (Py_ssize_t g = 0; g < G; g++) {
        PyObject *ids = groups[g];
        if (!(PyList_CheckExact(ids) || PyTuple_CheckExact(ids)))
            return STATUS_FALLBACK;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
        cells[g] = -1;
        if (n == 0 && !overwrite)
            continue; /* an append of nothing stages nothing */
        int64_t start = overwrite ? 0 : s->nb[g * R + req];
        int64_t c = (int64_t)n * s->info[g][0];
        if (start + c > s->info[g][1])
            return STATUS_FALLBACK; /* past the row: the twin names it */
        starts[g] = start;
        cells[g] = c;
        writes += 1;
        cells_total += (Py_ssize_t)c;
    }
    if (writes == 0)
        return 0;
    if (w + writes + 1 > arena->meta_cap || v + cells_total + G > arena->values_cap)
        return STATUS_FALLBACK; /* no room: the twin grows the arena */

    /* Pass 2: values and metadata into the arena's uncounted tail. */
    Py_ssize_t w1 = w, v1 = v;
    for (Py_ssize_t g = 0; g < G; g++) {
        if (cells[g] < 0)
            continue;
        const int64_t k = s->info[g][0], max_id = s->info[g][2];
        PyObject *ids = groups[g];
        Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
        PyObject **items = PySequence_Fast_ITEMS(ids);
        const Py_ssize_t v0 = v1;
        if (flags & MW_NULL_BLOCK) { /* every id is the null block 0, whatever was passed */
            for (Py_ssize_t i = 0; i < n * k; i++)
                values[v1++] = (int32_t)(i % k);
            n = 0;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = items[i];
            if (!PyLong_CheckExact(item)) /* bools, int subclasses, numpy scalars: the twin decides */
                return STATUS_FALLBACK;
            long long b = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow || b < 0 || b > max_id) {
                PyErr_Clear();
                return STATUS_FALLBACK;
            }
            const int64_t base = (int64_t)b * k;
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
    /* The request's new counts: one more write, row `req` of num_blocks' [max_reqs, num_groups] view (table G). */
    int32_t *row = meta + 5 * w1;
    row[0] = (int32_t)G;
    row[1] = (int32_t)req;
    row[2] = 0;
    row[3] = (int32_t)G;
    row[4] = (int32_t)v1;
    for (Py_ssize_t g = 0; g < G; g++)
        values[v1++] = cells[g] >= 0 ? (int32_t)(starts[g] + cells[g]) : s->nb[g * R + req];
    w1 += 1;

    /* Pass 3: commit. A (table, row) stamped with this batch's number was written before in this batch. */
    if (mw_clock_words[0] != arena->uid && mw_arena_begin_run(arena) < 0)
        return -1; /* (nothing counted yet: the tail is ignored) */
    const int64_t batch = arena->batch;
    int overlapped = 0;
    for (Py_ssize_t g = 0; g <= G; g++) {
        if (g < G && cells[g] < 0)
            continue;
        int64_t *stamp = s->st + g * R + req;
        overlapped |= *stamp == batch;
        if (g == G && *stamp != batch) /* the row's counts change for the first time in this batch */
            for (Py_ssize_t gg = 0; gg < G; gg++)
                s->ap[gg * R + req] = s->nb[gg * R + req];
        *stamp = batch;
    }
    for (Py_ssize_t g = 0; g < G; g++)
        if (cells[g] >= 0)
            s->nb[g * R + req] = (int32_t)(starts[g] + cells[g]);
    arena->num_writes = w1;
    arena->num_values = v1;
    if (overlapped)
        arena->may_overlap = 1;
    return 0;
}

static int staging_ready(BlockIdStaging *self) {
    if (self->arena != NULL && mw_clock_words != NULL)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "append_block_ids before _bind_staging (or bind_clock)");
    return 0;
}

int mw_stage_block_ids(PyObject *staging, PyObject *req, PyObject *groups, int overwrite, int flags) {
    BlockIdStaging *s = (BlockIdStaging *)staging;
    return staging_ready(s) ? stage_core(s, req, groups, overwrite, flags) : -1;
}

PyObject *mw_call_fallback(PyObject *fn, PyObject *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    if (fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "multiwrite.staging._cstaging: set_fallbacks was not called");
        return NULL;
    }
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8], **stack = small;
    if (total + 1 > 8 && (stack = PyMem_Malloc((total + 1) * sizeof(PyObject *))) == NULL)
        return PyErr_NoMemory();
    stack[0] = self;
    for (Py_ssize_t i = 0; i < total; i++)
        stack[i + 1] = args[i];
    PyObject *result = PyObject_Vectorcall(fn, stack, nargs + 1, kwnames);
    if (stack != small)
        PyMem_Free(stack);
    return result;
}

static int name_is(PyObject *name, const char *text) { return PyUnicode_CompareWithASCIIString(name, text) == 0; }

/* The three parameters of a vectorcall (the first named `first`, then new_block_ids, overwrite) into params;
 * 0 when they do not bind (the Python twin then says why). */
int mw_bind_params(PyObject *const *args, size_t nargsf, PyObject *kwnames, const char *first,
                       PyObject **params) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    params[0] = params[1] = params[2] = NULL;
    if (nargs > 3)
        return 0;
    for (Py_ssize_t i = 0; i < nargs; i++)
        params[i] = args[i];
    for (Py_ssize_t i = 0; kwnames != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        int at = name_is(name, first) ? 0 : name_is(name, "new_block_ids") ? 1 : name_is(name, "overwrite") ? 2 : -1;
        if (at < 0 || params[at] != NULL)
            return 0;
        params[at] = args[nargs + i];
    }
    return params[0] != NULL && params[1] != NULL && params[2] != NULL;
}

static PyObject *staging_append(BlockIdStaging *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *p[3];
    if (!staging_ready(self))
        return NULL;
    if (mw_bind_params(args, nargsf, kwnames, "req_index", p) && (p[2] == Py_True || p[2] == Py_False)) {
        int status = stage_core(self, p[0], p[1], p[2] == Py_True, 0);
        if (status <= 0)
            return status < 0 ? NULL : Py_NewRef(Py_None);
    }
    return mw_call_fallback(mw_fallback_append, (PyObject *)self, args, nargsf, kwnames);
}

/* The error of call `index` of a batch of `calls` becomes what the twin's batch_failure makes of it. */
static void batch_failure(Py_ssize_t index, Py_ssize_t calls, PyObject *req) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *failure = mw_batch_failure_fn == NULL
                            ? NULL
                            : PyObject_CallFunction(mw_batch_failure_fn, "OnnO", value, index, calls, req);
    if (failure == NULL) {
        PyErr_Clear();
        PyErr_Restore(type, value, tb);
        return;
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_SetObject((PyObject *)Py_TYPE(failure), failure);
    Py_DECREF(failure);
}

static PyObject *staging_append_batch(BlockIdStaging *self, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames) {
    PyObject *p[3];
    if (!staging_ready(self))
        return NULL;
    if (!mw_bind_params(args, nargsf, kwnames, "req_indices", p))
        return mw_call_fallback(mw_fallback_batch, (PyObject *)self, args, nargsf, kwnames);
    PyObject *reqs = p[0], *ids = p[1], *ow = p[2];
    if (!(PyList_CheckExact(reqs) || PyTuple_CheckExact(reqs)) || !(PyList_CheckExact(ids) || PyTuple_CheckExact(ids)))
        return mw_call_fallback(mw_fallback_batch, (PyObject *)self, args, nargsf, kwnames);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(reqs);
    const int shared = ow == Py_True || ow == Py_False;
    if (PySequence_Fast_GET_SIZE(ids) != n ||
        !(shared || ((PyList_CheckExact(ow) || PyTuple_CheckExact(ow)) && PySequence_Fast_GET_SIZE(ow) == n)))
        return mw_call_fallback(mw_fallback_batch, (PyObject *)self, args, nargsf, kwnames);
    /* As the twin's loop: stops at the end of the shortest sequence, lengths read again at each call (a fallback
     * runs Python code, which may change them). */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(reqs) && i < PySequence_Fast_GET_SIZE(ids) &&
                           i < (shared ? n : PySequence_Fast_GET_SIZE(ow));
         i++) {
        PyObject *call[3] = {PySequence_Fast_ITEMS(reqs)[i], PySequence_Fast_ITEMS(ids)[i],
                             shared ? ow : PySequence_Fast_ITEMS(ow)[i]};
        Py_INCREF(call[0]);
        Py_INCREF(call[1]);
        Py_INCREF(call[2]);
        int status = STATUS_FALLBACK;
        if (call[2] == Py_True || call[2] == Py_False)
            status = stage_core(self, call[0], call[1], call[2] == Py_True, 0);
        PyObject *r = status == 0 ? Py_NewRef(Py_None)
                      : status < 0 ? NULL
                                   : mw_call_fallback(mw_fallback_append, (PyObject *)self, call, 3, NULL);
        Py_DECREF(call[1]);
        Py_DECREF(call[2]);
        if (r == NULL) {
            batch_failure(i, n, call[0]);
            Py_DECREF(call[0]);
            return NULL;
        }
        Py_DECREF(call[0]);
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static int get_array(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t items, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != itemsize || view->len != itemsize * items) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "_bind_staging: %s must be a C-contiguous array of %zd items of %zd bytes",
                     what, items, itemsize);
        return -1;
    }
    return 0;
}

static void staging_release(BlockIdStaging *self) {
    if (self->nb_view.obj)
        PyBuffer_Release(&self->nb_view);
    if (self->ap_view.obj)
        PyBuffer_Release(&self->ap_view);
    if (self->st_view.obj)
        PyBuffer_Release(&self->st_view);
}

/* _bind_staging(arena, num_blocks, applied, stamps, groups) */
static PyObject *staging_bind(BlockIdStaging *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyObject_TypeCheck(args[0], &mw_ArenaFieldsType) || !PyTuple_Check(args[4]))
        return mw_usage_error("_bind_staging(arena, num_blocks, applied, stamps, groups)");
    if (self->arena != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_bind_staging: already bound");
        return NULL;
    }
    PyObject *groups = args[4];
    Py_ssize_t G = PyTuple_GET_SIZE(groups);
    if (G > MAX_GROUPS) {
        PyErr_Format(PyExc_ValueError, "_bind_staging: at most %d KV-cache groups", MAX_GROUPS);
        return NULL;
    }
    for (Py_ssize_t g = 0; g < G; g++) {
        PyObject *info = PyTuple_GET_ITEM(groups, g);
        if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) != 3) {
            PyErr_SetString(PyExc_TypeError, "_bind_staging: groups are (k, width, largest id) tuples");
            return NULL;
        }
        for (int j = 0; j < 3; j++) {
            self->info[g][j] = PyLong_AsLongLong(PyTuple_GET_ITEM(info, j));
            if (PyErr_Occurred())
                return NULL;
        }
    }
    /* max_reqs from num_blocks' length: G * R int32 items. */
    Py_buffer probe;
    if (PyObject_GetBuffer(args[1], &probe, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    Py_ssize_t R = G ? probe.len / 4 / G : 0;
    PyBuffer_Release(&probe);
    if (get_array(args[1], &self->nb_view, 4, G * R, "num_blocks") < 0 ||
        get_array(args[2], &self->ap_view, 4, G * R, "applied") < 0 ||
        get_array(args[3], &self->st_view, 8, (G + 1) * R, "stamps") < 0) {
        staging_release(self);
        return NULL;
    }
    self->nb = (int32_t *)self->nb_view.buf;
    self->ap = (int32_t *)self->ap_view.buf;
    self->st = (int64_t *)self->st_view.buf;
    self->num_groups = G;
    self->max_reqs = R;
    self->arena = (ArenaFields *)Py_NewRef(args[0]);
    self->num_blocks = Py_NewRef(args[1]);
    self->applied = Py_NewRef(args[2]);
    self->stamps = Py_NewRef(args[3]);
    self->groups = Py_NewRef(groups);
    Py_RETURN_NONE;
}

/* The strong references of a BlockIdStaging: what its traverse visits and its tp_clear drops. */
static const Py_ssize_t staging_refs[] = {offsetof(BlockIdStaging, arena),   offsetof(BlockIdStaging, num_blocks),
                                          offsetof(BlockIdStaging, applied), offsetof(BlockIdStaging, stamps),
                                          offsetof(BlockIdStaging, groups),  -1};

static int staging_traverse(BlockIdStaging *self, visitproc visit, void *arg) {
    return mw_visit_refs((PyObject *)self, staging_refs, visit, arg);
}

/* (not MW_GC_FUNCS: the buffer views of the bound arrays are released first) */
static int staging_tp_clear(BlockIdStaging *self) {
    staging_release(self);
    mw_clear_refs((PyObject *)self, staging_refs);
    return 0;
}

static void staging_dealloc(BlockIdStaging *self) { mw_gc_dealloc((PyObject *)self, (inquiry)staging_tp_clear); }

static PyMethodDef staging_methods[] = {
    {"append_block_ids", (PyCFunction)(void (*)(void))staging_append, METH_FASTCALL | METH_KEYWORDS,
     "append_block_ids(req_index, new_block_ids, overwrite)\n--\n\n"
     "Stage request `req_index`'s new manager block ids, one list per KV-cache group (compiled; the exact twin and\n"
     "the full documentation: multiwrite.staging.block_ids.BlockIdStaging.append_block_ids)."},
    {"append_block_ids_batch", (PyCFunction)(void (*)(void))staging_append_batch, METH_FASTCALL | METH_KEYWORDS,
     "append_block_ids_batch(req_indices, new_block_ids, overwrite)\n--\n\n"
     "Stage a step's append_block_ids calls in one call (compiled; the exact twin and the full documentation:\n"
     "multiwrite.staging.block_ids.BlockIdStaging.append_block_ids_batch)."},
    {"_bind_staging", (PyCFunction)(void (*)(void))staging_bind, METH_FASTCALL,
     "_bind_staging(arena, num_blocks, applied, stamps, groups): the arrays staging writes (once)."},
    {NULL},
};

PyTypeObject mw_BlockIdStagingType = {
    MW_TYPE_HEAD("BlockIdStaging", BlockIdStaging, staging, Py_TPFLAGS_HAVE_GC,
                 "append_block_ids and append_block_ids_batch of BlockTables, compiled (base of BlockTables)."),
    .tp_new = PyType_GenericNew,
    MW_GC_SLOTS(staging),
};

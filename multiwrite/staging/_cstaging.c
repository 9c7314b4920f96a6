/*
 * multiwrite.staging._cstaging: the compiled fast paths of staging.
 *
 * Optional: where it is not built, multiwrite/staging/fields.py and block_ids.py are its exact Python twins (graph
 * mode's publish and the compiled-cpu backend's scatter have none: graph mode then reports that it needs this
 * module, and torch-cpu takes over from compiled-cpu).
 *
 * Its staging types read only objects of its own types (C structs) and arrays through the buffer protocol; they never
 * look up an attribute by name (StageEntry, which checks torch tensors, is the exception: it reads the attributes a
 * Python caller reads, through interned names):
 * - ArenaFields: a staging arena's counters, the addresses and capacities of its current lease, its batch number
 *   (the overlap epoch) and its list of runs on the staging clock. Base class of staging.arena.StagingArena.
 * - LeaseFields: one piece of staging memory: addresses, capacities, and for memory a kernel reads in place, its
 *   completion word and token. Base class of staging.arena.Lease.
 * - BlockIdStaging: BlockTables.append_block_ids and append_block_ids_batch. Base class of BlockTables. A call it
 *   does not take exactly (anything unusual, any error) goes to the Python twin, which stages it or raises.
 * - HeaderRingFields: graph mode's ring of published batches; publish() writes one header. Base class of
 *   staging.headers.HeaderRing.
 * - VllmStaging: multiwrite.vllm.BlockTables.append_block_ids, straight into its core's BlockIdStaging. Base class
 *   of multiwrite.vllm.BlockTables.
 * - scatter_writes: the compiled-cpu backend's apply.
 * - Countdown: a counter whose truth test counts (`if countdown:` is true at every period-th test), the periodic
 *   address check of a BlockTables' preamble (multiwrite/tables/mode.py) at the cost of one C call of nb_bool.
 * - FastLaunch: a compiled Triton kernel's launch as one call (multiwrite/backends/triton/launcher.py).
 * - DriverLaunch: the same launch as one call of the CUDA driver's cuLaunchKernelEx, Triton's launcher its fallback.
 * - StageEntry: an eager gather, slot-mapping or prepare_inputs call, checked and launched in one call (or None: the
 *   Python path runs it; multiwrite/stage/entry.py); prepare_inputs applies the staged batch in that launch, and
 *   apply_staged_writes is one launch of the apply kernel.
 * - CommitEntry: graph mode's commit_staged_writes, checked and published in one call (or None: the Python path).
 *
 * Its source is split by type: this file holds the module itself (its functions bind_clock, set_fallbacks and
 * scatter_writes, the small type Countdown, PyInit) and the module's globals (the staging clock, the Python twin's
 * fallbacks); _cstaging_arena.c holds LeaseFields and ArenaFields, _cstaging_block_ids.c BlockIdStaging,
 * _cstaging_headers.c HeaderRingFields, _cstaging_vllm.c VllmStaging, _cstaging_launch.c FastLaunch,
 * _cstaging_driver.c DriverLaunch, _cstaging_entry.c StageEntry (_cstaging_stage.c its gather and slots,
 * _cstaging_prepare.c its prepare and apply, _cstaging_entry.h what the three share), _cstaging_commit.c
 * CommitEntry; _cstaging.h what they share (the structs of more than one file, the header ring's layout, the type
 * objects and what they share, the globals and the arena's shared steps, all named mw_* and hidden outside the
 * extension). This file also defines what the type objects share: the GC types' helpers (mw_visit_refs,
 * mw_clear_refs, mw_gc_dealloc) and the TypeError of a call whose arguments do not bind (mw_usage_error).
 */
#include "_cstaging.h"
#include "_cstaging_grid.h"

/* ---- what the four types share ------------------------------------------------------------------------ */

int mw_visit_refs(PyObject *self, const Py_ssize_t *refs, visitproc visit, void *arg) {
    for (; *refs >= 0; refs++)
        Py_VISIT(*(PyObject **)((char *)self + *refs));
    return 0;
}

void mw_clear_refs(PyObject *self, const Py_ssize_t *refs) {
    for (; *refs >= 0; refs++) {
        PyObject **field = (PyObject **)((char *)self + *refs);
        Py_CLEAR(*field);
    }
}

void mw_gc_dealloc(PyObject *self, inquiry clear) {
    PyObject_GC_UnTrack(self);
    clear(self);
    Py_TYPE(self)->tp_free(self);
}

void mw_count_one(PyObject *obj, PyObject *name) {
    PyObject *count = PyObject_GetAttr(obj, name), *next = NULL;
    if (count != NULL && PyLong_CheckExact(count) && (next = PyLong_FromLongLong(PyLong_AsLongLong(count) + 1)))
        PyObject_SetAttr(obj, name, next);
    Py_XDECREF(count);
    Py_XDECREF(next);
    PyErr_Clear();
}


PyObject *mw_usage_error(const char *usage) {
    PyErr_SetString(PyExc_TypeError, usage);
    return NULL;
}

/* ---- the staging clock --------------------------------------------------------------------------------- */

/* (uid of the arena that staged last, runs started): staging.arena.STAGE_CLOCK, bound by bind_clock. */
static Py_buffer clock_view = {0};
int64_t *mw_clock_words = NULL;

static PyObject *bind_clock(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return NULL;
    if (view.itemsize != 8 || view.len != 16) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "bind_clock: an int64 array of 2 elements");
        return NULL;
    }
    if (clock_view.obj != NULL)
        PyBuffer_Release(&clock_view);
    clock_view = view;
    mw_clock_words = (int64_t *)view.buf;
    Py_RETURN_NONE;
}

/* ---- set_fallbacks: the Python twin of BlockIdStaging --------------------------------------------------- */

/* The Python twin's functions for the calls BlockIdStaging does not take (_cstaging_block_ids.c calls them). */
PyObject *mw_fallback_append = NULL, *mw_fallback_batch = NULL, *mw_batch_failure_fn = NULL;

static PyObject *set_fallbacks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return mw_usage_error("set_fallbacks(append, append_batch, batch_failure)");
    Py_XSETREF(mw_fallback_append, Py_NewRef(args[0]));
    Py_XSETREF(mw_fallback_batch, Py_NewRef(args[1]));
    Py_XSETREF(mw_batch_failure_fn, Py_NewRef(args[2]));
    Py_RETURN_NONE;
}

/* ---- scatter_writes: the compiled-cpu backend --------------------------------------------------------- */

/* scatter_writes(meta, values, tables[, check_only]): apply a batch to tables in host memory, in staging order
 * (where writes overlap the later one wins). meta: C-contiguous int32 [num_writes, 5] (table, row, start, length,
 * value offset); values: C-contiguous 1-D buffer of 4- or 8-byte items; tables: C-contiguous int64
 * [num_tables, 5] (base address, row stride, column stride, rows, columns; strides in items). Every write is
 * checked against its table's shape and the values first; on a bad one nothing is written and ValueError names
 * the write, its table and shape, row, start, length and value offset. Empty writes are no-ops. */
static PyObject *scatter_writes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 && nargs != 4)
        return mw_usage_error("scatter_writes takes 3 or 4 arguments");
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
        PyErr_SetString(PyExc_ValueError,
                        "scatter_writes: meta int32 [w, 5], values of 4 or 8 bytes, tables int64 [t, 5]");
        goto done;
    }
    const int32_t *meta = (const int32_t *)mb.buf;
    const int64_t *tables = (const int64_t *)tb.buf;
    const Py_ssize_t num_writes = mb.len / 20, num_tables = tb.len / 40, item = vb.itemsize;
    const Py_ssize_t num_values = vb.len / item;
    for (Py_ssize_t w = 0; w < num_writes; w++) { /* check everything before writing anything */
        const int32_t *m = meta + 5 * w;
        if (m[0] < 0 || m[0] >= num_tables) {
            PyErr_Format(PyExc_ValueError,
                         "write %zd (table %d of a batch of %zd tables, row %d, start %d, length %d) names no "
                         "table of the batch; nothing was written",
                         w, m[0], num_tables, m[1], m[2], m[3]);
            goto done;
        }
        if (m[3] == 0)
            continue;
        const int64_t *t = tables + 5 * (int64_t)m[0];
        if (m[1] < 0 || m[1] >= t[3] || m[2] < 0 || m[3] < 0 || (int64_t)m[2] + m[3] > t[4] || m[4] < 0 ||
            (int64_t)m[4] + m[3] > num_values) {
            PyErr_Format(PyExc_ValueError,
                         "write %zd (table %d, row %d, start %d, length %d) is outside its table (shape (%lld, "
                         "%lld)) or the values (offset %d of %zd); nothing was written",
                         w, m[0], m[1], m[2], m[3], (long long)t[3], (long long)t[4], m[4], num_values);
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

/* ---- Countdown ----------------------------------------------------------------------------------------- */

typedef mw_Countdown Countdown;

static PyMemberDef countdown_members[] = {
    {"period", T_PYSSIZET, offsetof(Countdown, period), READONLY, "truth tests per true one"},
    {"left", T_PYSSIZET, offsetof(Countdown, left), READONLY, "truth tests left until the next true one"},
    {NULL},
};

/* One truth test: false while tests are left, then true, and true again at every test until restart(). */
static int countdown_bool(Countdown *self) {
    if (self->left > 1) {
        self->left--;
        return 0;
    }
    self->left = 0;
    return 1;
}

static PyObject *countdown_restart(Countdown *self, PyObject *unused) {
    self->left = self->period;
    Py_RETURN_NONE;
}

static int countdown_init(Countdown *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"period", NULL};
    Py_ssize_t period;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n:Countdown", keywords, &period))
        return -1;
    if (period < 1) {
        PyErr_Format(PyExc_ValueError, "Countdown: period must be >= 1, got %zd", period);
        return -1;
    }
    self->period = self->left = period;
    return 0;
}

static PyMethodDef countdown_methods[] = {
    {"restart", (PyCFunction)countdown_restart, METH_NOARGS, "restart(): the next true test is period tests away."},
    {NULL},
};

static PyNumberMethods countdown_number = {.nb_bool = (inquiry)countdown_bool};

PyTypeObject mw_CountdownType = {
    MW_TYPE_HEAD("Countdown", Countdown, countdown, 0,
                 "Countdown(period): its truth test is true at every period-th test (and at every test after it "
                 "until restart()); Python twin: multiwrite.staging.fields.PyCountdown."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)countdown_init,
    .tp_as_number = &countdown_number,
};

/* ---- the module ---------------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"bind_clock", (PyCFunction)bind_clock, METH_O, "bind_clock(array): the staging clock, int64 [2]."},
    {"set_fallbacks", (PyCFunction)(void (*)(void))set_fallbacks, METH_FASTCALL,
     "set_fallbacks(append, append_batch, batch_failure): the Python twin's functions for calls C does not take."},
    {"scatter_writes", (PyCFunction)(void (*)(void))scatter_writes, METH_FASTCALL,
     "scatter_writes(meta, values, tables[, check_only]): apply a batch to host-memory tables in staging order."},
    {"apply_grid", (PyCFunction)(void (*)(void))mw_apply_grid_call, METH_FASTCALL,
     "apply_grid(num_writes, num_values, rounds, tiling, max_programs): (tiles, column splits) of the apply programs "
     "of a batch; Python twin: multiwrite.backends.triton.device.py_apply_grid."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "multiwrite.staging._cstaging",
                                    "The compiled fast paths of multiwrite's staging.", -1, methods};

PyMODINIT_FUNC PyInit__cstaging(void) {
    if (PyType_Ready(&mw_LeaseFieldsType) < 0 || PyType_Ready(&mw_ArenaFieldsType) < 0 ||
        PyType_Ready(&mw_BlockIdStagingType) < 0 || PyType_Ready(&mw_HeaderRingFieldsType) < 0 ||
        PyType_Ready(&mw_VllmStagingType) < 0 || PyType_Ready(&mw_CountdownType) < 0 ||
        PyType_Ready(&mw_FastLaunchType) < 0 || PyType_Ready(&mw_DriverLaunchType) < 0 || PyType_Ready(&mw_StageEntryType) < 0 ||
        PyType_Ready(&mw_CommitEntryType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "LeaseFields", (PyObject *)&mw_LeaseFieldsType) < 0 ||
        PyModule_AddObjectRef(m, "ArenaFields", (PyObject *)&mw_ArenaFieldsType) < 0 ||
        PyModule_AddObjectRef(m, "BlockIdStaging", (PyObject *)&mw_BlockIdStagingType) < 0 ||
        PyModule_AddObjectRef(m, "HeaderRingFields", (PyObject *)&mw_HeaderRingFieldsType) < 0 ||
        PyModule_AddObjectRef(m, "VllmStaging", (PyObject *)&mw_VllmStagingType) < 0 ||
        PyModule_AddObjectRef(m, "Countdown", (PyObject *)&mw_CountdownType) < 0 ||
        PyModule_AddObjectRef(m, "FastLaunch", (PyObject *)&mw_FastLaunchType) < 0 ||
        PyModule_AddObjectRef(m, "DriverLaunch", (PyObject *)&mw_DriverLaunchType) < 0 ||
        PyModule_AddObjectRef(m, "StageEntry", (PyObject *)&mw_StageEntryType) < 0 ||
        PyModule_AddObjectRef(m, "CommitEntry", (PyObject *)&mw_CommitEntryType) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_WORDS", HEADER_WORDS) < 0 ||
        PyModule_AddIntConstant(m, "INLINE_WRITES", INLINE_WRITES) < 0 ||
        PyModule_AddIntConstant(m, "INLINE_VALUES", INLINE_VALUES) < 0 ||
        PyModule_AddIntConstant(m, "ENTRY_WORDS", ENTRY_WORDS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_GROUPS", MAX_GROUPS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

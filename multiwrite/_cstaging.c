/*
 * multiwrite._cstaging: the compiled hot paths of staging, and the compiled-cpu backend's scatter
 * (`scatter_writes`, at the end of this file).
 *
 * - `ArenaFields`: the base class of `staging.StagingArena` holding its counters and the addresses of its
 *   arrays as C fields, so the compiled paths below read and write them without Python attribute traffic
 *   (Python code sees ordinary attributes).
 * - `Stager`: `BlockTables.append_block_ids` of one BlockTables. One call stages one request's new block ids
 *   for every KV-cache group: it checks them, expands each manager id b into the k kernel block ids b*k + j,
 *   stores the values and one metadata row per written group into the staging arena's arrays, stamps
 *   (table, row) for overlap detection, and updates the host num_blocks. It either does all of that or
 *   nothing: every check runs before anything is committed, and on any doubt it hands the call to the
 *   pure-Python method (which raises the precise StagedWriteError).
 * - `rotate_lent` and `commit_graph`: the common case of an arena's rotation into the next slot of a lent
 *   pinned ring (backends/triton_kernel.py `_LentRing`), and of graph mode's commit (backends/triton_graph.py
 *   `GraphStage.commit`); anything else (a slot still in use, one too small, overlapping writes) returns
 *   "not done" before changing anything, and the Python code takes over.
 *
 * Each staging call that stages into another arena than the one that staged last (the shared staging clock,
 * staging.STAGE_CLOCK, bound by `bind_clock`) starts a run of this arena, so writes of arenas applied
 * together keep their true staging order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

/* ---- ArenaFields ------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    Py_ssize_t num_writes;  /* staged writes: meta rows [0, num_writes) */
    Py_ssize_t num_values;  /* staged values: values[0, num_values) */
    Py_ssize_t meta_addr;   /* int32 [meta_cap, 5] */
    Py_ssize_t values_addr; /* values_cap items of the arena's dtype */
    Py_ssize_t meta_cap;
    Py_ssize_t values_cap;
    Py_ssize_t uid;         /* the arena's name on the staging clock */
    char may_overlap;
} ArenaFields;

static PyMemberDef arena_members[] = {
    {"num_writes", T_PYSSIZET, offsetof(ArenaFields, num_writes), 0, "staged writes"},
    {"num_values", T_PYSSIZET, offsetof(ArenaFields, num_values), 0, "staged values"},
    {"meta_addr", T_PYSSIZET, offsetof(ArenaFields, meta_addr), 0, "address of meta"},
    {"values_addr", T_PYSSIZET, offsetof(ArenaFields, values_addr), 0, "address of values"},
    {"meta_cap", T_PYSSIZET, offsetof(ArenaFields, meta_cap), 0, "rows of meta"},
    {"values_cap", T_PYSSIZET, offsetof(ArenaFields, values_cap), 0, "items of values"},
    {"uid", T_PYSSIZET, offsetof(ArenaFields, uid), 0, "name on the staging clock"},
    {"may_overlap", T_BOOL, offsetof(ArenaFields, may_overlap), 0, "two staged writes may touch one row"},
    {NULL},
};

static PyTypeObject ArenaFieldsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "multiwrite._cstaging.ArenaFields",
    .tp_basicsize = sizeof(ArenaFields),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The counters and array addresses of a staging arena as C fields (base of staging.StagingArena).",
    .tp_members = arena_members,
    .tp_new = PyType_GenericNew,
};

/* ---- the staging clock ------------------------------------------------------------------------------ */

static int64_t *clock_words = NULL; /* staging.STAGE_CLOCK: (uid of the arena that staged last, clock) */
static PyObject *clock_owner = NULL;

static PyObject *s_runs, *s_rows_seen, *s_meta, *s_values, *s_meta_bytes, *s_values_flat, *s_ring, *s_current,
    *s_next, *s_slots, *s_lent, *s_tokens, *s_done_addr, *s_depth, *s_kernel_guard, *s_reserve, *s_published,
    *s_lender, *s_headers_addr, *s_mirror_addr, *s_bounds_addr, *s_k_req, *s_k_reqs, *s_k_ids, *s_k_overwrite;

/* The next write of `arena` (at write index `arena->num_writes`) starts a run: staging.StagingArena.begin_run. */
static int begin_run(ArenaFields *arena) {
    int64_t clock = clock_words[1] + 1;
    PyObject *runs = PyObject_GetAttr((PyObject *)arena, s_runs);
    if (runs == NULL)
        return -1;
    PyObject *run = Py_BuildValue("(Ln)", (long long)clock, arena->num_writes);
    int rc = run == NULL ? -1 : PyList_Append(runs, run);
    Py_XDECREF(run);
    Py_DECREF(runs);
    if (rc == 0) {
        clock_words[1] = clock;
        clock_words[0] = arena->uid;
    }
    return rc;
}

/* staging.StagingArena.clear. */
static int clear_arena(ArenaFields *arena) {
    arena->num_writes = 0;
    arena->num_values = 0;
    arena->may_overlap = 0;
    PyObject *seen = PyObject_GetAttr((PyObject *)arena, s_rows_seen);
    if (seen == NULL)
        return -1;
    int rc = PySet_GET_SIZE(seen) ? PySet_Clear(seen) : 0;
    Py_DECREF(seen);
    PyObject *runs = PyObject_GetAttr((PyObject *)arena, s_runs);
    if (rc < 0 || runs == NULL) {
        Py_XDECREF(runs);
        return -1;
    }
    rc = PyList_GET_SIZE(runs) ? PyList_SetSlice(runs, 0, PyList_GET_SIZE(runs), NULL) : 0;
    Py_DECREF(runs);
    if (clock_words[0] == arena->uid)
        clock_words[0] = 0;
    return rc;
}

static PyObject *bind_clock(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "bind_clock(clock_array, address)");
        return NULL;
    }
    Py_XSETREF(clock_owner, Py_NewRef(args[0]));
    clock_words = (int64_t *)PyLong_AsVoidPtr(args[1]);
    if (clock_words == NULL && PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* ---- Stager: BlockTables.append_block_ids ------------------------------------------------------------ */

enum {
    CTX_NUM_BLOCKS = 0,   /* int32 [num_groups, max_num_reqs] */
    CTX_MAX_REQS = 1,
    CTX_GROUPS = 2,
    CTX_COUNTS_TABLE = 3, /* table index of num_blocks' [max_num_reqs, num_groups] view, or -1 */
    CTX_STAMPS = 4,       /* int64 [num_tables, max_num_reqs]: epoch of the last staged write per (table, row) */
    CTX_EPOCH = 5,        /* the current batch's epoch: a stamp equal to it means "already written" */
    CTX_NUM_BLOCKS_APPLIED = 6, /* int32 [num_groups, max_num_reqs]: a row's counts before its first
                                 * change in this batch, i.e. as of the last apply (for clears) */
    CTX_GROUP0 = 7,       /* per group: k, width, max_id */
};

#define STATUS_GROW 1     /* not enough room in the arena: grow it and call again */
#define STATUS_FALLBACK 2 /* invalid or unusual input: let the Python path handle it */

/* Stage one call into `arena`. Returns 0 (staged: *w_out, *v_out, *overlapped set), STATUS_GROW,
 * STATUS_FALLBACK, or -1 with a Python exception set. Nothing is committed unless it returns 0. */
static int stage_core(const int64_t *ctx, const ArenaFields *arena, PyObject *req_obj, PyObject *groups_obj,
                      int overwrite, Py_ssize_t *w_out, Py_ssize_t *v_out, int *overlapped_out) {
    if (!PyLong_CheckExact(req_obj) || !(PyList_CheckExact(groups_obj) || PyTuple_CheckExact(groups_obj)))
        return STATUS_FALLBACK;
    const Py_ssize_t num_groups = (Py_ssize_t)ctx[CTX_GROUPS];
    const Py_ssize_t max_reqs = (Py_ssize_t)ctx[CTX_MAX_REQS];
    const Py_ssize_t w = arena->num_writes, v = arena->num_values;
    int overflow = 0;
    long long req = PyLong_AsLongLongAndOverflow(req_obj, &overflow);
    if (overflow || req < 0 || req >= max_reqs || PySequence_Fast_GET_SIZE(groups_obj) != num_groups ||
        num_groups > 64)
        return STATUS_FALLBACK;
    PyObject **groups = PySequence_Fast_ITEMS(groups_obj);
    int32_t *meta = (int32_t *)(intptr_t)arena->meta_addr;
    int32_t *values = (int32_t *)(intptr_t)arena->values_addr;
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
    if (w + writes_needed > arena->meta_cap || v + values_needed > arena->values_cap)
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

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    ArenaFields *arena;  /* the BlockTables' arena (strong) */
    PyObject *context;   /* the int64 context array (strong: keeps `ctx` alive) */
    int64_t *ctx;
    PyObject *owner;     /* weak reference to the BlockTables */
    PyObject *slow;      /* BlockTables.append_block_ids, the Python method: every other case */
    PyObject *slow_batch; /* BlockTables.append_block_ids_batch, the Python method */
} Stager;

/* The BlockTables, new reference; NULL with ReferenceError once it is gone (the context's addresses point into
 * its arrays, freed with it: nothing may be staged then). */
static PyObject *stager_owner(Stager *self) {
    PyObject *owner;
#if PY_VERSION_HEX >= 0x030D0000
    if (PyWeakref_GetRef(self->owner, &owner) < 0)
        return NULL;
#else
    owner = Py_XNewRef(PyWeakref_GetObject(self->owner));
    if (owner == NULL)
        return NULL;
    if (owner == Py_None)
        Py_CLEAR(owner);
#endif
    if (owner == NULL)
        PyErr_SetString(PyExc_ReferenceError, "append_block_ids: its BlockTables no longer exists");
    return owner;
}

/* The Python method with the caller's arguments exactly as given: it checks them and raises the precise
 * error, or stages what the compiled path declined. */
static PyObject *stager_slow(Stager *self, PyObject *slow, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *owner = stager_owner(self);
    if (owner == NULL)
        return NULL;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8], **stack = small;
    if (total + 1 > 8 && (stack = PyMem_Malloc((total + 1) * sizeof(PyObject *))) == NULL) {
        Py_DECREF(owner);
        return PyErr_NoMemory();
    }
    stack[0] = owner;
    for (Py_ssize_t i = 0; i < total; i++)
        stack[i + 1] = args[i];
    PyObject *result = PyObject_Vectorcall(slow, stack, (nargs + 1), kwnames);
    Py_DECREF(owner);
    if (stack != small)
        PyMem_Free(stack);
    return result;
}

static int name_is(PyObject *name, PyObject *interned) {
    return name == interned || PyUnicode_Compare(name, interned) == 0;
}

/* Stage one call whose overwrite is a bool: in C, or (anything unusual) through the Python method with the
 * caller's arguments `args`/`nargsf`/`kwnames`. */
static PyObject *stage_one(Stager *self, PyObject *req, PyObject *ids, int overwrite, PyObject *const *args,
                           size_t nargsf, PyObject *kwnames) {
    ArenaFields *arena = self->arena;
    Py_ssize_t w = arena->num_writes, w1, v1;
    int overlapped;
    for (int attempt = 0;; attempt++) {
        int status = stage_core(self->ctx, arena, req, ids, overwrite, &w1, &v1, &overlapped);
        if (status < 0)
            return NULL;
        if (status == 0) {
            if (w1 != w) {
                if (clock_words[0] != arena->uid && begin_run(arena) < 0)
                    return NULL; /* (nothing counted yet: the staged tail is ignored) */
                arena->num_writes = w1;
                arena->num_values = v1;
                if (overlapped)
                    arena->may_overlap = 1;
            }
            Py_RETURN_NONE;
        }
        if (status == STATUS_GROW && attempt == 0) { /* room for every group's ids, then once more */
            Py_ssize_t needed = 0, num_groups = (Py_ssize_t)self->ctx[CTX_GROUPS];
            PyObject **items = PySequence_Fast_ITEMS(ids); /* stage_core checked: list or tuple */
            for (Py_ssize_t g = 0; g < num_groups; g++)
                needed += PySequence_Fast_GET_SIZE(items[g]) * (Py_ssize_t)self->ctx[CTX_GROUP0 + 3 * g];
            PyObject *r = PyObject_CallMethod((PyObject *)arena, "reserve", "nn", num_groups + 1, needed + num_groups);
            if (r == NULL)
                return NULL;
            Py_DECREF(r);
            continue;
        }
        return stager_slow(self, self->slow, args, nargsf, kwnames);
    }
}

/* The three parameters (first one named `first`, then new_block_ids, overwrite) of a vectorcall into params[];
 * 0 when they do not bind (more than three, a name unknown or given twice): the Python method then says why.
 * A parameter not given stays NULL. */
static int bind_params(PyObject *const *args, size_t nargsf, PyObject *kwnames, PyObject *first, PyObject **params) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    params[0] = params[1] = params[2] = NULL;
    if (nargs > 3)
        return 0;
    for (Py_ssize_t i = 0; i < nargs; i++)
        params[i] = args[i];
    for (Py_ssize_t i = 0; kwnames != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        int at = name_is(name, first) ? 0 : name_is(name, s_k_ids) ? 1 : name_is(name, s_k_overwrite) ? 2 : -1;
        if (at < 0 || params[at] != NULL)
            return 0;
        params[at] = args[nargs + i];
    }
    return 1;
}

static PyObject *stager_call_owned(Stager *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *params[3];
    /* unbound, missing, or an overwrite that is not a bool: the Python method */
    if (!bind_params(args, nargsf, kwnames, s_k_req, params) || params[0] == NULL || params[1] == NULL ||
        (params[2] != Py_True && params[2] != Py_False))
        return stager_slow(self, self->slow, args, nargsf, kwnames);
    return stage_one(self, params[0], params[1], params[2] == Py_True, args, nargsf, kwnames);
}

/* Every call holds the BlockTables for its duration (a fallback runs Python code, which may drop it). */
static PyObject *stager_call(Stager *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *owner = stager_owner(self);
    if (owner == NULL)
        return NULL;
    PyObject *result = stager_call_owned(self, args, nargsf, kwnames);
    Py_DECREF(owner);
    return result;
}

/* The error raised by call `index` of a batch of `calls` becomes what multiwrite.block_tables._batch_failure
 * makes of it (which call failed, what stays staged); the original one stays if that fails. */
static void batch_failure(Py_ssize_t index, Py_ssize_t calls, PyObject *req) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *module = PyImport_ImportModule("multiwrite.block_tables");
    PyObject *failure = module == NULL ? NULL
                                       : PyObject_CallMethod(module, "_batch_failure", "OnnO", value, index, calls, req);
    Py_XDECREF(module);
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

/* Stager.batch(req_indices, new_block_ids, overwrite): BlockTables.append_block_ids_batch. Lists or tuples of
 * one length (and a bool or such a sequence of bools) are staged call by call in C; anything else goes whole to
 * the Python method, which checks it. */
static PyObject *stager_batch_owned(Stager *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *params[3];
    if (!bind_params(args, nargsf, kwnames, s_k_reqs, params))
        return stager_slow(self, self->slow_batch, args, nargsf, kwnames);
    PyObject *reqs = params[0], *ids = params[1], *ow = params[2];
    if (reqs == NULL || ids == NULL || ow == NULL || !(PyList_CheckExact(reqs) || PyTuple_CheckExact(reqs)) ||
        !(PyList_CheckExact(ids) || PyTuple_CheckExact(ids)))
        return stager_slow(self, self->slow_batch, args, nargsf, kwnames);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(reqs);
    const int shared = ow == Py_True || ow == Py_False;
    if (PySequence_Fast_GET_SIZE(ids) != n ||
        !(shared || ((PyList_CheckExact(ow) || PyTuple_CheckExact(ow)) && PySequence_Fast_GET_SIZE(ow) == n)))
        return stager_slow(self, self->slow_batch, args, nargsf, kwnames);
    /* As the method's zip over the three: it stops at the end of the shortest, its lengths re-read each time (a
     * fallback runs Python code, which may change the lists); one shared bool stands for a list of n. */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(reqs) && i < PySequence_Fast_GET_SIZE(ids) &&
                           i < (shared ? n : PySequence_Fast_GET_SIZE(ow));
         i++) {
        PyObject *call[3] = {PySequence_Fast_ITEMS(reqs)[i], PySequence_Fast_ITEMS(ids)[i],
                             shared ? ow : PySequence_Fast_ITEMS(ow)[i]};
        Py_INCREF(call[0]);
        Py_INCREF(call[1]);
        Py_INCREF(call[2]);
        PyObject *r = call[2] == Py_True || call[2] == Py_False
                          ? stage_one(self, call[0], call[1], call[2] == Py_True, call, 3, NULL)
                          : stager_slow(self, self->slow, call, 3, NULL);
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

static PyObject *stager_batch(Stager *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *owner = stager_owner(self);
    if (owner == NULL)
        return NULL;
    PyObject *result = stager_batch_owned(self, args, (size_t)nargs, kwnames);
    Py_DECREF(owner);
    return result;
}

static PyMethodDef stager_methods[] = {
    {"batch", (PyCFunction)(void (*)(void))stager_batch, METH_FASTCALL | METH_KEYWORDS,
     "batch(req_indices, new_block_ids, overwrite): BlockTables.append_block_ids_batch staged in C."},
    {NULL, NULL, 0, NULL},
};

static PyObject *stager_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *owner, *arena, *context, *slow, *slow_batch;
    Py_ssize_t ctx_addr;
    if (!PyArg_ParseTuple(args, "OOOnOO:Stager", &owner, &arena, &context, &ctx_addr, &slow, &slow_batch))
        return NULL;
    if (!PyObject_TypeCheck(arena, &ArenaFieldsType)) {
        PyErr_SetString(PyExc_TypeError, "Stager: the arena must be an ArenaFields");
        return NULL;
    }
    if (clock_words == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Stager: bind_clock was not called");
        return NULL;
    }
    Stager *self = (Stager *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->owner = PyWeakref_NewRef(owner, NULL);
    if (self->owner == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->arena = (ArenaFields *)Py_NewRef(arena);
    self->context = Py_NewRef(context);
    self->ctx = (int64_t *)(intptr_t)ctx_addr;
    self->slow = Py_NewRef(slow);
    self->slow_batch = Py_NewRef(slow_batch);
    self->vectorcall = (vectorcallfunc)stager_call;
    return (PyObject *)self;
}

static int stager_traverse(Stager *self, visitproc visit, void *arg) {
    Py_VISIT(self->arena);
    Py_VISIT(self->context);
    Py_VISIT(self->owner);
    Py_VISIT(self->slow);
    Py_VISIT(self->slow_batch);
    return 0;
}

static int stager_clear(Stager *self) {
    Py_CLEAR(self->arena);
    Py_CLEAR(self->context);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->slow_batch);
    return 0;
}

static void stager_dealloc(Stager *self) {
    PyObject_GC_UnTrack(self);
    stager_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject StagerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "multiwrite._cstaging.Stager",
    .tp_basicsize = sizeof(Stager),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "append_block_ids(req_index, new_block_ids, overwrite) of one BlockTables, staged in C (see "
              "BlockTables.append_block_ids; anything unusual goes to that method).",
    .tp_vectorcall_offset = offsetof(Stager, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = stager_new,
    .tp_methods = stager_methods,
    .tp_traverse = (traverseproc)stager_traverse,
    .tp_clear = (inquiry)stager_clear,
    .tp_dealloc = (destructor)stager_dealloc,
};

/* ---- rotation into a lent ring's next slot, graph mode's commit ---------------------------------------- */

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

/* The ring's state a rotation or commit reads: the lists are borrowed from the ring (kept alive by it). */
typedef struct {
    PyObject *ring, *tokens, *done_addr, *slots;
    Py_ssize_t next, depth;
} RingView;

static void ring_view_release(RingView *r) {
    Py_XDECREF(r->ring);
    Py_XDECREF(r->tokens);
    Py_XDECREF(r->done_addr);
    Py_XDECREF(r->slots);
}

/* 1: a view of a kernel-guarded ring (lists checked); 0: not that kind of ring; -1: error. */
static int ring_view(PyObject *lender, RingView *r) {
    memset(r, 0, sizeof(*r));
    PyObject *guard = NULL;
    if ((r->ring = PyObject_GetAttr(lender, s_ring)) == NULL ||
        (guard = PyObject_GetAttr(r->ring, s_kernel_guard)) == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear(); /* another kind of lender: its own rotation */
        return 0;
    }
    int kernel_guard = guard == Py_True;
    Py_DECREF(guard);
    if (!kernel_guard)
        return 0;
    if ((r->tokens = PyObject_GetAttr(r->ring, s_tokens)) == NULL ||
        (r->done_addr = PyObject_GetAttr(r->ring, s_done_addr)) == NULL ||
        (r->slots = PyObject_GetAttr(r->ring, s_slots)) == NULL || get_ssize(r->ring, s_next, &r->next) < 0 ||
        get_ssize(r->ring, s_depth, &r->depth) < 0)
        return -1;
    if (!PyList_CheckExact(r->tokens) || !PyList_CheckExact(r->done_addr) || !PyList_CheckExact(r->slots) ||
        PyList_GET_SIZE(r->tokens) < r->depth || PyList_GET_SIZE(r->done_addr) < r->depth ||
        PyList_GET_SIZE(r->slots) != r->depth || r->next < 0 || r->next >= r->depth)
        return 0;
    return 1;
}

/* 1: slot i's kernel has stored the slot's token (released); 0: not yet; -1: error. */
static int slot_released(RingView *r, Py_ssize_t i) {
    long long token = PyLong_AsLongLong(PyList_GET_ITEM(r->tokens, i));
    void *word = PyLong_AsVoidPtr(PyList_GET_ITEM(r->done_addr, i));
    if (PyErr_Occurred())
        return -1;
    return *(volatile int32_t *)word == token;
}

/* The views of slot i lent to the arena (`_Slot.lent`: meta, values, meta_bytes, values_flat, meta_addr,
 * values_addr, meta_cap, values_cap), new reference, when it holds the arena's current capacities; else NULL
 * (with an exception only on error). */
static PyObject *slot_lent(RingView *r, Py_ssize_t i, const ArenaFields *arena) {
    PyObject *lent = PyObject_GetAttr(PyList_GET_ITEM(r->slots, i), s_lent);
    if (lent == NULL)
        return NULL;
    if (!PyTuple_CheckExact(lent) || PyTuple_GET_SIZE(lent) != 8) {
        Py_DECREF(lent);
        return NULL;
    }
    Py_ssize_t meta_cap = PyLong_AsSsize_t(PyTuple_GET_ITEM(lent, 6));
    Py_ssize_t values_cap = PyLong_AsSsize_t(PyTuple_GET_ITEM(lent, 7));
    if (PyErr_Occurred() || meta_cap < arena->meta_cap || values_cap < arena->values_cap) {
        Py_DECREF(lent);
        return NULL;
    }
    return lent;
}

/* Hand the arena slot r->next (checked released, `lent` its views): StagingArena._use, _LentRing.acquire. */
static int use_slot(ArenaFields *arena, PyObject *lender, RingView *r, PyObject *lent) {
    PyObject *o = (PyObject *)arena;
    Py_ssize_t meta_addr = PyLong_AsSsize_t(PyTuple_GET_ITEM(lent, 4));
    Py_ssize_t values_addr = PyLong_AsSsize_t(PyTuple_GET_ITEM(lent, 5));
    if (PyErr_Occurred())
        return -1;
    if (PyObject_SetAttr(o, s_meta, PyTuple_GET_ITEM(lent, 0)) < 0 ||
        PyObject_SetAttr(o, s_values, PyTuple_GET_ITEM(lent, 1)) < 0 ||
        PyObject_SetAttr(o, s_meta_bytes, PyTuple_GET_ITEM(lent, 2)) < 0 ||
        PyObject_SetAttr(o, s_values_flat, PyTuple_GET_ITEM(lent, 3)) < 0)
        return -1;
    arena->meta_addr = meta_addr;
    arena->values_addr = values_addr;
    arena->meta_cap = PyLong_AsSsize_t(PyTuple_GET_ITEM(lent, 6));
    arena->values_cap = PyLong_AsSsize_t(PyTuple_GET_ITEM(lent, 7));
    if (set_ssize(lender, s_current, r->next) < 0 || set_ssize(r->ring, s_next, (r->next + 1) % r->depth) < 0)
        return -1;
    return 0;
}

/* rotate_lent(arena, lender) -> bool: StagingArena.rotate for an arena staging into a kernel-guarded lent
 * ring, when the next slot is released and big enough (True, done); False, having changed nothing, otherwise
 * (the Python rotation then waits or grows). */
static PyObject *rotate_lent(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyObject_TypeCheck(args[0], &ArenaFieldsType)) {
        PyErr_SetString(PyExc_TypeError, "rotate_lent(arena, lender)");
        return NULL;
    }
    ArenaFields *arena = (ArenaFields *)args[0];
    RingView r;
    PyObject *result = NULL, *lent = NULL;
    int rc = ring_view(args[1], &r);
    if (rc < 0)
        goto done;
    if (rc == 0 || (rc = slot_released(&r, r.next)) <= 0) {
        result = rc < 0 ? NULL : Py_NewRef(Py_False);
        goto done;
    }
    lent = slot_lent(&r, r.next, arena);
    if (lent == NULL) {
        result = PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
        goto done;
    }
    result = use_slot(arena, args[1], &r, lent) < 0 ? NULL : Py_NewRef(Py_True);
done:
    Py_XDECREF(lent);
    ring_view_release(&r);
    return result;
}

/* The header ring's layout (backends/triton_graph.py; GraphStage checks these against its own at import): */
#define HEADER_WORDS 8 /* H_SEQ, H_META, H_VALUES, H_BOUNDS, H_DONE, H_TOKEN, H_COUNTS, H_NUM_VALUES */
#define INLINE_WRITES 256 /* FEW_WRITES: most writes of a batch committed inline into its entry */
#define INLINE_VALUES 256 /* PRELOADED_VALUES: most values of such a batch */
#define ENTRY_WORDS (HEADER_WORDS + (INLINE_WRITES * 5 + INLINE_VALUES) / 2) /* int64 words of one entry */
#define INLINE_BIT 63 /* INLINE_BIT: in H_COUNTS, the batch is in the entry, not in a ring slot */
#define INLINE_FLAG INT64_MIN /* bit 63, the sign bit: num_rounds keeps bits 32-62 (31 bits) */

/* commit_graph(graph, arena, epoch_addr) -> header index, or None having changed nothing: GraphStage.commit
 * (backends/triton_graph.py) in its common case (the header ring has room, no overlapping writes; a batch of
 * at most INLINE_WRITES writes and INLINE_VALUES values is copied into its entry and the arena keeps its slot,
 * a bigger one needs the next ring slot released and big enough), followed by the BlockTables' epoch bump
 * (`epoch_addr`: its int64 word). None: the caller runs the Python commit, which waits, reorders overlapping
 * writes or grows. The arena's values are int32 (graph mode's tables are). */
static PyObject *commit_graph(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyObject_TypeCheck(args[1], &ArenaFieldsType) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "commit_graph(graph, arena, epoch_addr)");
        return NULL;
    }
    PyObject *graph = args[0], *lender = NULL, *lent = NULL, *result = NULL;
    ArenaFields *arena = (ArenaFields *)args[1];
    int64_t *epoch = (int64_t *)PyLong_AsVoidPtr(args[2]);
    Py_ssize_t h, depth, headers_addr, mirror_addr, i = 0;
    RingView r;
    memset(&r, 0, sizeof(r));
    if (epoch == NULL || get_ssize(graph, s_published, &h) < 0 || get_ssize(graph, s_depth, &depth) < 0 ||
        get_ssize(graph, s_headers_addr, &headers_addr) < 0 || get_ssize(graph, s_mirror_addr, &mirror_addr) < 0 ||
        (lender = PyObject_GetAttr(graph, s_lender)) == NULL)
        goto done;
    const Py_ssize_t w = arena->num_writes, num_values = arena->num_values;
    const int inline_batch = w > 0 && !arena->may_overlap && w <= INLINE_WRITES && num_values <= INLINE_VALUES;
    int rc = 1;
    if (w && !inline_batch) {
        if (arena->may_overlap || (rc = ring_view(lender, &r)) <= 0 || get_ssize(lender, s_current, &i) < 0 ||
            i < 0 || i >= r.depth || r.next != (i + 1) % r.depth || (rc = slot_released(&r, r.next)) <= 0 ||
            (lent = slot_lent(&r, r.next, arena)) == NULL) {
            result = PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
            goto done;
        }
    }
    if (((volatile int64_t *)(intptr_t)mirror_addr)[0] < h - depth + 1) { /* the header ring is full */
        result = Py_NewRef(Py_None);
        goto done;
    }
    int64_t *hv = (int64_t *)(intptr_t)headers_addr + (h % depth) * ENTRY_WORDS;
    if (inline_batch) {
        /* The metadata as five columns of INLINE_WRITES cells, then the values; the token word holds their
         * checksum (triton_graph.inline_checksum: each int32 times its position in the batch area plus one). */
        int32_t *batch = (int32_t *)(hv + HEADER_WORDS);
        const int32_t *meta = (const int32_t *)arena->meta_addr, *values = (const int32_t *)arena->values_addr;
        int64_t checksum = 0;
        for (Py_ssize_t c = 0; c < 5; c++)
            for (Py_ssize_t j = 0; j < w; j++) {
                const int32_t x = meta[j * 5 + c];
                batch[c * INLINE_WRITES + j] = x;
                checksum += (int64_t)x * (c * INLINE_WRITES + j + 1);
            }
        for (Py_ssize_t k = 0; k < num_values; k++) {
            batch[INLINE_WRITES * 5 + k] = values[k];
            checksum += (int64_t)values[k] * (INLINE_WRITES * 5 + k + 1);
        }
        hv[1] = hv[2] = hv[3] = hv[4] = 0;
        hv[5] = checksum;
        hv[6] = (int64_t)w | (int64_t)1 << 32 | INLINE_FLAG;
        hv[7] = num_values;
    } else if (w) {
        long long token = PyLong_AsLongLong(PyList_GET_ITEM(r.tokens, i)) % 0x7FFFFFFF + 1;
        Py_ssize_t done_word = PyLong_AsSsize_t(PyList_GET_ITEM(r.done_addr, i)), bounds_addr;
        if (PyErr_Occurred() || get_ssize(PyList_GET_ITEM(r.slots, i), s_bounds_addr, &bounds_addr) < 0)
            goto done;
        PyObject *boxed = PyLong_FromLongLong(token);
        if (boxed == NULL || PyList_SetItem(r.tokens, i, boxed) < 0) /* (steals boxed) */
            goto done;
        hv[1] = arena->meta_addr;
        hv[2] = arena->values_addr;
        hv[3] = bounds_addr;
        hv[4] = done_word;
        hv[5] = token;
        hv[6] = (int64_t)w | (int64_t)1 << 32; /* one round: no overlapping writes */
        hv[7] = arena->num_values;
    } else {
        hv[4] = 0;
        hv[6] = 0;
        hv[7] = 0;
    }
    /* Last: the sequence word publishes the header (the device may read it any time). */
    __atomic_store_n(&hv[0], (int64_t)h + 1, __ATOMIC_RELEASE);
    if (set_ssize(graph, s_published, h + 1) < 0)
        goto done;
    if (inline_batch ? clear_arena(arena) < 0 : w && (clear_arena(arena) < 0 || use_slot(arena, lender, &r, lent) < 0))
        goto done;
    *epoch += 1; /* a new batch: every (table, row) is free again */
    result = PyLong_FromSsize_t(h);
done:
    Py_XDECREF(lender);
    Py_XDECREF(lent);
    ring_view_release(&r);
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
    {"bind_clock", (PyCFunction)(void (*)(void))bind_clock, METH_FASTCALL,
     "bind_clock(clock_array, address): the staging clock (staging.STAGE_CLOCK) the compiled paths keep."},
    {"rotate_lent", (PyCFunction)(void (*)(void))rotate_lent, METH_FASTCALL,
     "rotate_lent(arena, lender) -> bool: the arena into its lent ring's next slot, when released and big enough."},
    {"commit_graph", (PyCFunction)(void (*)(void))commit_graph, METH_FASTCALL,
     "commit_graph(graph, arena, epoch_addr) -> header index or None: graph mode's commit, common case."},
    {"scatter_writes", (PyCFunction)(void (*)(void))scatter_writes, METH_FASTCALL,
     "scatter_writes(meta, values, tables[, check_only]): apply a WriteBatch to host-memory tables in "
     "staging order, every write checked first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "multiwrite._cstaging",
                                    "Compiled staging hot paths of multiwrite.", -1, methods};

#define INTERN(var, text)                                \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;

PyMODINIT_FUNC PyInit__cstaging(void) {
    INTERN(s_runs, "runs");
    INTERN(s_rows_seen, "rows_seen");
    INTERN(s_meta, "meta");
    INTERN(s_values, "values");
    INTERN(s_meta_bytes, "meta_bytes");
    INTERN(s_values_flat, "values_flat");
    INTERN(s_ring, "ring");
    INTERN(s_current, "current");
    INTERN(s_next, "next");
    INTERN(s_slots, "slots");
    INTERN(s_lent, "lent");
    INTERN(s_tokens, "tokens");
    INTERN(s_done_addr, "done_addr");
    INTERN(s_depth, "depth");
    INTERN(s_kernel_guard, "kernel_guard");
    INTERN(s_reserve, "reserve");
    INTERN(s_published, "published");
    INTERN(s_lender, "lender");
    INTERN(s_headers_addr, "headers_addr");
    INTERN(s_mirror_addr, "mirror_addr");
    INTERN(s_bounds_addr, "bounds_addr");
    INTERN(s_k_req, "req_index");
    INTERN(s_k_reqs, "req_indices");
    INTERN(s_k_ids, "new_block_ids");
    INTERN(s_k_overwrite, "overwrite");
    if (PyType_Ready(&ArenaFieldsType) < 0 || PyType_Ready(&StagerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "ArenaFields", (PyObject *)&ArenaFieldsType) < 0 ||
        PyModule_AddObjectRef(m, "Stager", (PyObject *)&StagerType) < 0 ||
        PyModule_AddIntConstant(m, "GRAPH_ENTRY_WORDS", ENTRY_WORDS) < 0 ||
        PyModule_AddIntConstant(m, "GRAPH_INLINE_WRITES", INLINE_WRITES) < 0 ||
        PyModule_AddIntConstant(m, "GRAPH_INLINE_VALUES", INLINE_VALUES) < 0 ||
        PyModule_AddIntConstant(m, "GRAPH_INLINE_BIT", INLINE_BIT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

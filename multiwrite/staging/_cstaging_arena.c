/*
 * multiwrite.staging._cstaging, part: the types LeaseFields and ArenaFields (their structs are in _cstaging.h).
 *
 * LeaseFields is one piece of staging memory (addresses, capacities, and for memory a kernel reads in place its
 * completion word and token), the base class of staging.arena.Lease. ArenaFields is a staging arena's counters, the
 * addresses and capacities of its current lease, its batch number (the overlap epoch) and its list of runs on the
 * staging clock, the base class of staging.arena.StagingArena. Its C-level steps (mw_arena_clear, mw_arena_adopt,
 * mw_arena_begin_run) are shared: block-id staging (_cstaging_block_ids.c) and graph mode's publish
 * (_cstaging_headers.c) take them too. Their Python twins: multiwrite/staging/fields.py.
 */
#include "_cstaging.h"

/* ---- LeaseFields ---------------------------------------------------------------------------------------- */

static PyMemberDef lease_members[] = {
    {"meta_addr", T_PYSSIZET, offsetof(LeaseFields, meta_addr), 0, "address of the int32 [meta_cap, 5] metadata"},
    {"values_addr", T_PYSSIZET, offsetof(LeaseFields, values_addr), 0, "address of the values"},
    {"bounds_addr", T_PYSSIZET, offsetof(LeaseFields, bounds_addr), 0, "address of the int32 round bounds, or 0"},
    {"done_addr", T_PYSSIZET, offsetof(LeaseFields, done_addr), 0, "address of the int32 completion word, or 0"},
    {"meta_cap", T_PYSSIZET, offsetof(LeaseFields, meta_cap), 0, "metadata rows"},
    {"values_cap", T_PYSSIZET, offsetof(LeaseFields, values_cap), 0, "value items"},
    {"slot", T_PYSSIZET, offsetof(LeaseFields, slot), 0, "the lender's index of this memory, or -1"},
    {"token", T_LONGLONG, offsetof(LeaseFields, token), 0, "token of the last launch that read this memory"},
    {NULL},
};

static int lease_released_c(const LeaseFields *lease) {
    if (lease->done_addr == 0)
        return 1;
    return *(volatile int32_t *)(intptr_t)lease->done_addr == (int32_t)lease->token;
}

static PyObject *lease_released(LeaseFields *self, PyObject *unused) { return PyBool_FromLong(lease_released_c(self)); }

static PyObject *lease_next_token(LeaseFields *self, PyObject *unused) {
    self->token = self->token % 0x7FFFFFFF + 1;
    return PyLong_FromLongLong(self->token);
}

static PyObject *lease_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    LeaseFields *self = (LeaseFields *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->slot = -1;
    return (PyObject *)self;
}

static PyMethodDef lease_methods[] = {
    {"released", (PyCFunction)lease_released, METH_NOARGS,
     "released() -> bool: no launched kernel still reads this memory (its completion word holds the token)."},
    {"next_token", (PyCFunction)lease_next_token, METH_NOARGS,
     "next_token() -> int: advance the token (1 .. 2**31 - 1, wrapping) for the launch about to read this memory."},
    {NULL},
};

PyTypeObject mw_LeaseFieldsType = {
    MW_TYPE_HEAD("LeaseFields", LeaseFields, lease, 0,
                 "One piece of staging memory as C fields (base of staging.arena.Lease)."),
    .tp_new = lease_new,
};

/* ---- ArenaFields ---------------------------------------------------------------------------------------- */

static PyMemberDef arena_members[] = {
    {"num_writes", T_PYSSIZET, offsetof(ArenaFields, num_writes), 0, "staged writes"},
    {"num_values", T_PYSSIZET, offsetof(ArenaFields, num_values), 0, "staged values"},
    {"meta_addr", T_PYSSIZET, offsetof(ArenaFields, meta_addr), READONLY, "address of the lease's metadata"},
    {"values_addr", T_PYSSIZET, offsetof(ArenaFields, values_addr), READONLY, "address of the lease's values"},
    {"meta_cap", T_PYSSIZET, offsetof(ArenaFields, meta_cap), READONLY, "metadata rows of the lease"},
    {"values_cap", T_PYSSIZET, offsetof(ArenaFields, values_cap), READONLY, "value items of the lease"},
    {"uid", T_PYSSIZET, offsetof(ArenaFields, uid), 0, "name on the staging clock"},
    {"batch", T_LONGLONG, offsetof(ArenaFields, batch), READONLY, "number of the staged batch (+1 at clear and land)"},
    {"may_overlap", T_BOOL, offsetof(ArenaFields, may_overlap), 0, "two staged writes may touch one row"},
    {"runs", T_OBJECT_EX, offsetof(ArenaFields, runs), READONLY, "(clock, first write) of each run"},
    {"rows_seen", T_OBJECT_EX, offsetof(ArenaFields, rows_seen), READONLY, "row << 16 | table of each write"},
    {"lease", T_OBJECT, offsetof(ArenaFields, lease), READONLY, "the lease staged into"},
    {NULL},
};

int mw_arena_clear(ArenaFields *arena) {
    arena->num_writes = 0;
    arena->num_values = 0;
    arena->may_overlap = 0;
    arena->batch += 1;
    if (mw_clock_words != NULL && mw_clock_words[0] == arena->uid)
        mw_clock_words[0] = 0; /* the next write starts a run of its own */
    if (PySet_GET_SIZE(arena->rows_seen) && PySet_Clear(arena->rows_seen) < 0)
        return -1;
    if (PyList_GET_SIZE(arena->runs) && PyList_SetSlice(arena->runs, 0, PyList_GET_SIZE(arena->runs), NULL) < 0)
        return -1;
    return 0;
}

void mw_arena_adopt(ArenaFields *arena, LeaseFields *lease) {
    Py_INCREF(lease);
    Py_SETREF(arena->lease, (PyObject *)lease);
    arena->meta_addr = lease->meta_addr;
    arena->values_addr = lease->values_addr;
    arena->meta_cap = lease->meta_cap;
    arena->values_cap = lease->values_cap;
}

/* The next write of `arena` (at index num_writes) starts a run on the staging clock. */
int mw_arena_begin_run(ArenaFields *arena) {
    if (mw_clock_words == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "multiwrite staging clock not bound");
        return -1;
    }
    int64_t clock = mw_clock_words[1] + 1;
    PyObject *run = Py_BuildValue("(Ln)", (long long)clock, arena->num_writes);
    int rc = run == NULL ? -1 : PyList_Append(arena->runs, run);
    Py_XDECREF(run);
    if (rc == 0) {
        mw_clock_words[1] = clock;
        mw_clock_words[0] = arena->uid;
    }
    return rc;
}

static PyObject *arena_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    ArenaFields *self = (ArenaFields *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->runs = PyList_New(0);
    self->rows_seen = PySet_New(NULL);
    self->lease = Py_NewRef(Py_None);
    self->batch = 1; /* stamps start at 0: no row is written in the first batch yet */
    if (self->runs == NULL || self->rows_seen == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* The strong references of an ArenaFields: what its traverse visits and its tp_clear drops. */
static const Py_ssize_t arena_refs[] = {offsetof(ArenaFields, runs), offsetof(ArenaFields, rows_seen),
                                        offsetof(ArenaFields, lease), -1};

MW_GC_FUNCS(arena, ArenaFields)

static PyObject *arena_adopt(ArenaFields *self, PyObject *lease) {
    if (!PyObject_TypeCheck(lease, &mw_LeaseFieldsType))
        return mw_usage_error("adopt(lease): a LeaseFields");
    mw_arena_adopt(self, (LeaseFields *)lease);
    Py_RETURN_NONE;
}

static PyObject *arena_clear(ArenaFields *self, PyObject *unused) {
    if (mw_arena_clear(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *arena_land(ArenaFields *self, PyObject *lease) {
    if (lease != Py_None && !PyObject_TypeCheck(lease, &mw_LeaseFieldsType))
        return mw_usage_error("land(lease): a LeaseFields or None");
    if (lease != Py_None)
        mw_arena_adopt(self, (LeaseFields *)lease);
    if (mw_arena_clear(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *arena_begin_run(ArenaFields *self, PyObject *unused) {
    if (mw_arena_begin_run(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef arena_methods[] = {
    {"adopt", (PyCFunction)arena_adopt, METH_O, "adopt(lease): stage into `lease` from now on (nothing is copied)."},
    {"clear", (PyCFunction)arena_clear, METH_NOARGS,
     "clear(): drop every staged write; a new batch number; the next write starts a run."},
    {"land", (PyCFunction)arena_land, METH_O,
     "land(lease): the staged batch has landed: adopt `lease` (None: keep the current one), then clear(). One step."},
    {"begin_run", (PyCFunction)arena_begin_run, METH_NOARGS,
     "begin_run(): the next write starts a run of this arena on the staging clock."},
    {NULL},
};

PyTypeObject mw_ArenaFieldsType = {
    MW_TYPE_HEAD("ArenaFields", ArenaFields, arena, Py_TPFLAGS_HAVE_GC,
                 "A staging arena's counters, lease and batch number as C fields "
                 "(base of staging.arena.StagingArena)."),
    .tp_new = arena_new,
    MW_GC_SLOTS(arena),
};

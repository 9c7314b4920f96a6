/*
 * multiwrite.staging._cstaging, part: CommitEntry, graph mode's BlockTables.commit_staged_writes in one C call.
 *
 * Its commit() is the call's common case: the preamble's (GraphMode.enter: the address check not due, no table or
 * output resized) and then HeaderRingFields.commit's (mw_ring_commit: an inline batch or none, room in the rings, no
 * mis-pairing to report). Where any of them fails it does nothing and returns None, and the call takes its one Python
 * path (GraphMode.commit), which checks in full, waits, orders rounds or reports. multiwrite/tables/graph.py builds it.
 */
#include "_cstaging_entry.h"

typedef struct {
    PyObject_HEAD
    /* the preamble's: its countdown, the guards' bases (guard.base) and guards; the ring and the arena it publishes */
    PyObject *countdown, *storage, *guard, *outputs, *outputs_guard, *ring, *arena;
} CommitEntry;

#define COMMIT_REFS 7

static int commit_init(CommitEntry *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"countdown", "guard", "outputs_guard", "ring", "arena", NULL};
    PyObject *countdown, *guard, *outputs_guard, *ring, *arena;
    if (mw_entry_names() < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOO!O!:CommitEntry", keywords, &mw_CountdownType, &countdown,
                                     &guard, &outputs_guard, &mw_HeaderRingFieldsType, &ring, &mw_ArenaFieldsType,
                                     &arena))
        return -1;
    PyObject *storage = PyObject_GetAttrString(guard, "base");
    PyObject *outputs = storage == NULL ? NULL : PyObject_GetAttrString(outputs_guard, "base");
    if (outputs == NULL) { /* (a failed re-initialization leaves the entry as it was) */
        Py_XDECREF(storage);
        return -1;
    }
    PyObject *got[COMMIT_REFS] = {Py_NewRef(countdown), storage, Py_NewRef(guard), outputs, Py_NewRef(outputs_guard),
                                  Py_NewRef(ring), Py_NewRef(arena)};
    PyObject **fields[COMMIT_REFS] = {&self->countdown, &self->storage, &self->guard, &self->outputs,
                                      &self->outputs_guard, &self->ring, &self->arena};
    for (int i = 0; i < COMMIT_REFS; i++)
        Py_XSETREF(*fields[i], got[i]);
    return 0;
}

static const Py_ssize_t commit_refs[] = {
    offsetof(CommitEntry, countdown), offsetof(CommitEntry, storage), offsetof(CommitEntry, guard),
    offsetof(CommitEntry, outputs),   offsetof(CommitEntry, outputs_guard), offsetof(CommitEntry, ring),
    offsetof(CommitEntry, arena),     -1};

MW_GC_FUNCS(commit, CommitEntry)

/* commit() -> header index (the batch published with a ticket), or None having changed nothing. */
static PyObject *commit_call(CommitEntry *self, PyObject *unused) {
    if (self->ring == NULL) {
        PyErr_SetString(PyExc_TypeError, "CommitEntry: not initialized");
        return NULL;
    }
    const int ok = mw_preamble_holds(self->countdown, self->storage, self->guard, self->outputs, self->outputs_guard);
    if (ok <= 0) {
        if (ok < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    return mw_ring_commit(self->ring, (ArenaFields *)self->arena, 1, &((mw_Countdown *)self->countdown)->left);
}

static PyMemberDef commit_members[] = {
    {"ring", T_OBJECT, offsetof(CommitEntry, ring), READONLY, "the header ring it publishes into"},
    {NULL},
};

static PyMethodDef commit_methods[] = {
    {"commit", (PyCFunction)commit_call, METH_NOARGS,
     "commit() -> header index: the staged batch published with a ticket (commit_staged_writes' common case), or None "
     "(nothing done: the Python path runs)."},
    {NULL},
};

PyTypeObject mw_CommitEntryType = {
    MW_TYPE_HEAD("CommitEntry", CommitEntry, commit, Py_TPFLAGS_HAVE_GC,
                 "CommitEntry(countdown, guard, outputs_guard, ring, arena): graph mode's commit_staged_writes\n"
                 "checked and published in one C call, or None where the Python path must run (multiwrite/tables/graph.py)."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)commit_init,
    MW_GC_SLOTS(commit),
};

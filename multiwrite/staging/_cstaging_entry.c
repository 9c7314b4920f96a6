/*
 * multiwrite.staging._cstaging, part: the type StageEntry itself (its initialization from a StageLaunchSpec, its
 * references, its methods); what the methods do is _cstaging_stage.c's (gather, slots and what every call shares)
 * and _cstaging_prepare.c's (prepare and apply, the calls on the staged batch).
 */
#include "_cstaging_entry.h"

/* An int attribute of the spec into *out: 0, or -1 with an error set. */
static int spec_ll(PyObject *spec, const char *name, long long *out) {
    int ok = mw_as_ll(PyObject_GetAttrString(spec, name), out);
    if (ok == 0)
        PyErr_Format(PyExc_TypeError, "StageEntry: spec.%s must be an int", name);
    return ok > 0 ? 0 : -1;
}

/* The fields a StageEntry holds references to, in its struct's order from `owner` (entry_refs lists them too). */
#define ENTRY_REFS (22 + STAGED_REFS)

static int entry_init(StageEntry *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"owner", "countdown", "guard", "outputs_guard", "failure", "spec", NULL};
    PyObject *given[5], *spec;
    if (mw_entry_names() < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OOOO:StageEntry", keywords, &given[0], &mw_CountdownType,
                                     &given[1], &given[2], &given[3], &given[4], &spec))
        return -1;
    if (!PyCallable_Check(given[4])) {
        PyErr_SetString(PyExc_TypeError, "StageEntry: failure must be callable");
        return -1;
    }
    /* Everything is read and checked into `got` first: a failed (re-)initialization leaves the entry as it was. */
    static const char *const names[] = {"launcher", "get_device", "get_stream", "layout", "tensor_type", "int32",
                                        "int64", "boolean", "cp_size", "cp_interleave", "head"};
    PyObject *got[ENTRY_REFS] = {NULL};
    /* owner, countdown, the tables guard's base (the storage it checks) and the guard, the same of the outputs'
     * guard, failure */
    got[0] = Py_NewRef(given[0]);
    got[1] = Py_NewRef(given[1]);
    got[3] = Py_NewRef(given[2]);
    got[5] = Py_NewRef(given[3]);
    got[6] = Py_NewRef(given[4]);
    int ok = (got[2] = PyObject_GetAttrString(given[2], "base")) == NULL ||
                     (got[4] = PyObject_GetAttrString(given[3], "base")) == NULL
                 ? -1
                 : 0;
    for (int i = 0; i < 11 && ok == 0; i++)
        ok = (got[7 + i] = PyObject_GetAttrString(spec, names[i])) == NULL ? -1 : 0;
    /* then launcher.fire, layout.gathered_views, layout.slot_views and the device index as an int */
    if (ok == 0 && ((got[18] = PyObject_GetAttrString(got[7], "fire")) == NULL ||
                    (got[19] = PyObject_GetAttrString(got[10], "gathered_views")) == NULL ||
                    (got[20] = PyObject_GetAttrString(got[10], "slot_views")) == NULL))
        ok = -1;
    if (ok == 0 &&
        !(PyDict_Check(got[18]) && PyDict_Check(got[19]) && PyDict_Check(got[20]) && PyTuple_Check(got[17]) &&
          PyTuple_GET_SIZE(got[17]) == LEAD_ARGS)) {
        PyErr_SetString(PyExc_TypeError, "StageEntry: launcher.fire, layout.gathered_views and layout.slot_views must "
                                         "be dicts, spec.head a tuple of 12");
        ok = -1;
    }
    long long index = 0, reqs = 0, tokens = 0, groups = 0, splits = 0, fallback = 0;
    int window = 0;
    if (ok == 0 && (spec_ll(spec, "device_index", &index) < 0 || spec_ll(spec, "max_num_reqs", &reqs) < 0 ||
                    spec_ll(spec, "max_num_batched_tokens", &tokens) < 0 || spec_ll(spec, "groups", &groups) < 0 ||
                    spec_ll(spec, "splits", &splits) < 0 || spec_ll(spec, "fallback", &fallback) < 0))
        ok = -1;
    if (ok == 0) {
        PyObject *w = PyObject_GetAttrString(spec, "window");
        ok = w == NULL || (window = PyObject_IsTrue(w)) < 0 ? -1 : 0;
        Py_XDECREF(w);
    }
    if (ok == 0 && (got[21] = PyLong_FromLongLong(index)) == NULL)
        ok = -1;
    long long head[LEAD_ARGS];
    for (Py_ssize_t i = 0; i < LEAD_ARGS && ok == 0; i++)
        if ((ok = mw_as_ll(Py_NewRef(PyTuple_GET_ITEM(got[17], i)), &head[i])) == 0) {
            PyErr_SetString(PyExc_TypeError, "StageEntry: spec.head must hold ints");
            ok = -1;
        } else if (ok > 0)
            ok = 0;
    long long staged[STAGED_INTS] = {0};
    if (ok == 0)
        ok = mw_entry_read_staged(spec, got + 22, staged);
    if (ok < 0) {
        for (int i = 0; i < ENTRY_REFS; i++)
            Py_XDECREF(got[i]);
        return -1;
    }
    PyObject **fields[ENTRY_REFS] = {
        &self->owner, &self->countdown, &self->storage, &self->guard, &self->outputs, &self->outputs_guard,
        &self->failure, &self->launcher, &self->get_device, &self->get_stream, &self->layout, &self->tensor_type,
        &self->int32, &self->int64, &self->boolean, &self->cp_size, &self->cp_interleave, &self->head, &self->fire,
        &self->gathered_views, &self->slot_views, &self->index_obj, &self->arena, &self->ring, &self->ring_leases,
        &self->ring_succ, &self->ring_counters, &self->keep, &self->resolve, &self->is_capturing,
        &self->apply_launcher, &self->apply_fire, &self->apply_keys[0], &self->apply_keys[1]};
    for (int i = 0; i < ENTRY_REFS; i++)
        Py_XSETREF(*fields[i], got[i]);
    self->index = index;
    self->max_num_reqs = reqs;
    self->max_num_batched_tokens = tokens;
    self->groups = groups;
    self->splits = splits;
    self->fallback = fallback;
    self->window = window;
    /* (in the struct's order: the stage tiling, the apply tiling, max_programs, desc_addr, num_tables) */
    memcpy(self->stage_tiling, staged, sizeof(self->stage_tiling));
    memcpy(self->apply_tiling, staged + 5, sizeof(self->apply_tiling));
    self->max_programs = staged[10];
    self->desc_addr = staged[11];
    self->num_tables = staged[12];
    memcpy(self->head_values, head, sizeof(head));
    return 0;
}

static const Py_ssize_t entry_refs[] = {
    offsetof(StageEntry, owner),      offsetof(StageEntry, countdown),      offsetof(StageEntry, storage),
    offsetof(StageEntry, guard),      offsetof(StageEntry, outputs),        offsetof(StageEntry, outputs_guard),
    offsetof(StageEntry, failure),    offsetof(StageEntry, launcher),       offsetof(StageEntry, fire),
    offsetof(StageEntry, get_device), offsetof(StageEntry, get_stream),     offsetof(StageEntry, index_obj),
    offsetof(StageEntry, layout),     offsetof(StageEntry, gathered_views), offsetof(StageEntry, slot_views),
    offsetof(StageEntry, tensor_type), offsetof(StageEntry, int32),         offsetof(StageEntry, int64),
    offsetof(StageEntry, boolean),    offsetof(StageEntry, cp_size),        offsetof(StageEntry, cp_interleave),
    offsetof(StageEntry, head),       offsetof(StageEntry, arena),          offsetof(StageEntry, ring),
    offsetof(StageEntry, ring_leases), offsetof(StageEntry, ring_succ),     offsetof(StageEntry, ring_counters),
    offsetof(StageEntry, keep),       offsetof(StageEntry, resolve),        offsetof(StageEntry, is_capturing),
    offsetof(StageEntry, apply_launcher), offsetof(StageEntry, apply_fire), offsetof(StageEntry, apply_keys[0]),
    offsetof(StageEntry, apply_keys[1]), -1};

MW_GC_FUNCS(entry, StageEntry)

static PyObject *entry_refuse_uninitialized(StageEntry *self) {
    PyErr_SetString(PyExc_TypeError, "StageEntry: not initialized");
    return NULL;
}

static PyObject *entry_gather_call(StageEntry *self, PyObject *const *args, Py_ssize_t nargs) {
    return self->fire == NULL ? entry_refuse_uninitialized(self) : mw_entry_gather(self, args, nargs);
}

static PyObject *entry_slots_call(StageEntry *self, PyObject *const *args, Py_ssize_t nargs) {
    return self->fire == NULL ? entry_refuse_uninitialized(self) : mw_entry_slots(self, args, nargs);
}

static PyObject *entry_prepare_call(StageEntry *self, PyObject *const *args, Py_ssize_t nargs) {
    return self->fire == NULL ? entry_refuse_uninitialized(self) : mw_entry_prepare(self, args, nargs);
}

static PyObject *entry_apply_call(StageEntry *self, PyObject *unused) {
    return self->fire == NULL ? entry_refuse_uninitialized(self) : mw_entry_apply(self, unused);
}

static PyMemberDef entry_members[] = {
    {"owner", T_OBJECT, offsetof(StageEntry, owner), READONLY, "the mode whose dirty_rows the gathers move"},
    {"launcher", T_OBJECT, offsetof(StageEntry, launcher), READONLY, "the stage kernel's Launcher"},
    {NULL},
};

static PyMethodDef entry_methods[] = {
    {"gather", (PyCFunction)(void (*)(void))entry_gather_call, METH_FASTCALL,
     "gather(idx_mapping, num_reqs_padded, num_computed_tokens): the gathered views (launched), or None (nothing "
     "done: the Python path runs)."},
    {"apply", (PyCFunction)entry_apply_call, METH_NOARGS,
     "apply(): True once the staged batch is launched (apply_staged_writes' common case), or None."},
    {"prepare", (PyCFunction)(void (*)(void))entry_prepare_call, METH_FASTCALL,
     "prepare(idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded, is_padding,\n"
     "num_computed_tokens): (gathered views, slot-mapping view) with the staged batch applied (launched), or None."},
    {"slots", (PyCFunction)(void (*)(void))entry_slots_call, METH_FASTCALL,
     "slots(idx_mapping, query_start_loc, positions, num_tokens_padded, is_padding): the slot-mapping view "
     "(launched), or None (nothing done: the Python path runs)."},
    {NULL},
};

PyTypeObject mw_StageEntryType = {
    MW_TYPE_HEAD("StageEntry", StageEntry, entry, Py_TPFLAGS_HAVE_GC,
                 "StageEntry(owner, countdown, guard, outputs_guard, failure, spec): an eager\n"
                 "gather or slot-mapping call checked and launched in one C call, or None where the Python path\n"
                 "must run (multiwrite/stage/entry.py)."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)entry_init,
    MW_GC_SLOTS(entry),
};

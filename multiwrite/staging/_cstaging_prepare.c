/*
 * multiwrite.staging._cstaging, part: StageEntry.prepare, an eager prepare_inputs in one C call, the staged batch
 * applied in the same launch.
 *
 * prepare(idx, qsl, pos, num_reqs_padded, num_tokens_padded, is_padding, num_computed_tokens) returns None, having
 * done nothing, unless the common case holds: the preconditions of gather and slots together (_cstaging_stage.c), no
 * CUDA graph capture on the current stream (eager mode refuses a call that applies during one), a staged batch
 * without overlapping writes in a slot of the arena's ring, and the ring's next slot free (the Python path would wait
 * for it). Then it makes the launch TritonPlan.prepare makes, with the sequence of the one Python path around it
 * (StagingArena.land_after, TritonDevice.launch_on, SlotRing.hand_over): the next lease is chosen first (the ring's
 * next slot, passed by when it is the arena's own), the slot handed over (its token advanced, what the launch keeps
 * alive referenced, the lease recorded as the slot's memory), the kernel fired, the launch counted and the arena
 * landed on the next lease. A launch that raises an Exception frees the slot again and leaves every write staged; an
 * interrupt is resolved by the device (resolve(lease, token): the batch landed exactly when its kernel ran). With
 * nothing staged it is the lease-less launch of gather and slots together.
 */
#include "_cstaging_entry.h"

static PyObject *s_keep, *s_lender, *s_next;

/* What the hand-over and the landing of one launch need (the hooks' context). */
typedef struct {
    StageEntry *self;
    LeaseFields *lease; /* the arena's: the batch's memory */
    PyObject *nxt;      /* the lease the arena lands on (held) */
    Py_ssize_t next;    /* ring.next once landed */
    Py_ssize_t back;    /* ring.next when nothing lands: nxt's slot where the arena's own was passed by
                         * (SlotRing.release steps back once, over the second acquire), else -1 (unchanged) */
    long long token, launches;
} Handover;

static int released(PyObject *lease) {
    LeaseFields *l = (LeaseFields *)lease;
    return l->done_addr == 0 || *(volatile int32_t *)l->done_addr == (int32_t)l->token;
}

/* Nothing lands: ring.next as land_after's release of the next lease leaves it (an error kept as it is). */
static void step_back(Handover *h) {
    if (h->back < 0)
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *back = PyLong_FromSsize_t(h->back);
    if (back == NULL || PyObject_SetAttr(h->self->ring, s_next, back) < 0)
        PyErr_WriteUnraisable(h->self->ring);
    Py_XDECREF(back);
    PyErr_Restore(type, value, tb);
}

/* SlotRing.hand_over: the token, `keep` referenced by the lease, the lease recorded as its slot's memory. */
static int hand_over(void *ctx) {
    Handover *h = ctx;
    StageEntry *self = h->self;
    h->lease->token = h->token;
    if (PyObject_SetAttr((PyObject *)h->lease, s_keep, self->keep) < 0 ||
        PyList_SetItem(self->ring_leases, h->lease->slot, Py_NewRef((PyObject *)h->lease)) < 0) {
        *(volatile int32_t *)h->lease->done_addr = (int32_t)h->token; /* (SlotRing.launch_failed: free again) */
        step_back(h);
        return -1;
    }
    return 0;
}

/* The arena lands on the next lease (StagingArena.land; an error kept as it is): nothing here fails but memory. */
static void land(Handover *h) {
    StageEntry *self = h->self;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *next = PyLong_FromSsize_t(h->next);
    if (next == NULL || PyObject_SetAttr(self->ring, s_next, next) < 0)
        PyErr_WriteUnraisable(self->ring);
    Py_XDECREF(next);
    mw_arena_adopt((ArenaFields *)self->arena, (LeaseFields *)h->nxt);
    if (mw_arena_clear((ArenaFields *)self->arena) < 0)
        PyErr_WriteUnraisable(self->arena);
    PyErr_Restore(type, value, tb);
}

/* After the fire call: launched, count it and land; raised, what launch_on and land_after do with it. */
static void after_fire(void *ctx, int launched) {
    Handover *h = ctx;
    StageEntry *self = h->self;
    if (launched) {
        mw_count_one((PyObject *)h->lease, mw_s_launches);
        land(h);
        return;
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    long long launches = h->launches;
    if (PyErr_GivenExceptionMatches(type, PyExc_Exception)) { /* (nothing launched: the slot is free again) */
        *(volatile int32_t *)h->lease->done_addr = (int32_t)h->token;
    } else { /* an interrupt: the device decides whether the kernel ran */
        PyObject *call[2] = {(PyObject *)h->lease, NULL}, *result = NULL;
        if ((call[1] = PyLong_FromLongLong(h->token)) != NULL)
            result = PyObject_Vectorcall(self->resolve, call, 2, NULL);
        Py_XDECREF(call[1]);
        if (result == NULL) { /* (resolve's own error, a later interrupt, propagates: the first is its context) */
            PyObject *t2, *v2, *tb2;
            PyErr_Fetch(&t2, &v2, &tb2);
            PyErr_NormalizeException(&t2, &v2, &tb2);
            if (v2 != NULL && value != NULL)
                PyException_SetContext(v2, Py_NewRef(value));
            Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(tb);
            type = t2, value = v2, tb = tb2;
        }
        Py_XDECREF(result);
        if (mw_as_ll(PyObject_GetAttr((PyObject *)h->lease, mw_s_launches), &launches) <= 0)
            launches = h->launches;
        PyErr_Clear();
    }
    PyErr_Restore(type, value, tb);
    if (launches != h->launches)
        land(h);
    else
        step_back(h);
}

static const LaunchHooks *hooks_of(Handover *h, LaunchHooks *hooks) {
    hooks->before = hand_over;
    hooks->after = after_fire;
    hooks->ctx = h;
    return hooks;
}

/* The lease to land on (StagingArena.next_lease over SlotRing.acquire): the ring's next slot, passed by when it is the
 * arena's own; each must be free (else 0: the Python path waits). 1 (into h->nxt, h->next), 0, -1 (error). */
static int next_lease(StageEntry *self, Handover *h) {
    long long i;
    int ok = mw_as_ll(PyObject_GetAttr(self->ring, s_next), &i);
    const Py_ssize_t depth = PyList_GET_SIZE(self->ring_leases);
    for (int pass = 0; ok > 0 && pass < 2; pass++) {
        if (!(0 <= i && i < depth && PyList_GET_SIZE(self->ring_succ) == depth))
            return 0;
        PyObject *lease = PyList_GET_ITEM(self->ring_leases, i);
        if (!PyObject_TypeCheck(lease, &mw_LeaseFieldsType) || !released(lease))
            return 0;
        long long succ;
        if ((ok = mw_as_ll(Py_NewRef(PyList_GET_ITEM(self->ring_succ, i)), &succ)) <= 0)
            return ok;
        const int own = lease == (PyObject *)h->lease || ((LeaseFields *)lease)->slot == h->lease->slot;
        if (pass == 1 || !own) {
            h->nxt = lease, h->next = succ, h->back = pass == 1 ? i : -1;
            return 1;
        }
        i = succ;
    }
    return ok;
}

/* The arena's lease h->lease (with a staged batch, no overlapping writes) as a launch reads it: a slot of the ring,
 * the next lease free (into h), the slot's counter address (*counter) and next token (h->token). 1, 0, -1. */
static int staged_slot(StageEntry *self, Handover *h, long long *counter) {
    ArenaFields *arena = (ArenaFields *)self->arena;
    if (!arena->num_writes || arena->may_overlap || !PyObject_TypeCheck(arena->lease, &mw_LeaseFieldsType))
        return 0; /* (overlapping writes: the Python path orders them into rounds) */
    h->lease = (LeaseFields *)arena->lease;
    PyObject *lender = PyObject_GetAttr(arena->lease, s_lender);
    if (lender == NULL)
        return -1;
    Py_DECREF(lender);
    long long slot = h->lease->slot;
    if (lender != self->ring || !(0 <= slot && slot < PyList_GET_SIZE(self->ring_counters)) || !h->lease->done_addr)
        return 0;
    int ok = mw_as_ll(PyObject_GetAttr(arena->lease, mw_s_launches), &h->launches);
    if (ok > 0 && (ok = next_lease(self, h)) > 0)
        ok = mw_as_ll(Py_NewRef(PyList_GET_ITEM(self->ring_counters, slot)), counter);
    h->token = h->lease->token % 0x7FFFFFFF + 1;
    return ok;
}

/* The lead of the launch on the staged batch (TritonPlan._stage with a lease): 1, 0 (not taken), -1 (error). */
static int staged_lead(StageEntry *self, Handover *h, long long w, long long v, long long lead[12], long long *extra) {
    long long counter;
    int ok = staged_slot(self, h, &counter);
    if (ok <= 0)
        return ok;
    const long long sdesc = self->head_values[0]; /* (the stage descriptors' address) */
    long long grid[2];
    mw_apply_grid(w, v, 1, self->stage_tiling, self->max_programs, grid);
    const long long words[12] = {sdesc, h->lease->meta_addr, h->lease->values_addr, h->lease->bounds_addr, counter,
                                 h->lease->done_addr, h->token, w, v, 1, grid[0], grid[0] * grid[1]};
    memcpy(lead, words, sizeof(words));
    *extra = grid[0] * grid[1];
    return 1;
}

/* No capture under way on the current stream (during one, the Python path refuses a call that applies): 1, 0, -1. */
static int not_capturing(StageEntry *self) {
    PyObject *capturing = PyObject_CallNoArgs(self->is_capturing);
    int ok = capturing == NULL ? -1 : capturing == Py_False;
    Py_XDECREF(capturing);
    return ok;
}

/* An int argument into *out: 1, 0 (not an exact int: not taken). */
static int int_arg(PyObject *obj, long long *out) {
    if (!PyLong_CheckExact(obj))
        return 0;
    *out = PyLong_AsLongLong(obj);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

PyObject *mw_entry_prepare(StageEntry *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7)
        return mw_usage_error("prepare(idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded, "
                              "is_padding, num_computed_tokens): seven arguments");
    if (self->arena == Py_None)
        return Py_NewRef(Py_None);
    PyObject *idx = args[0], *qsl = args[1], *pos = args[2], *padded_obj = args[3], *tokens_obj = args[4];
    PyObject *pad = args[5], *nct = args[6];
    const long long f = self->fallback;
    Vector vi, vq, vp, vd = {NULL, 0, f}, vn = {NULL, 0, f};
    long long padded = 0, tokens = 0;
    int ok = mw_entry_preamble(self, 1);
    if (ok > 0)
        ok = not_capturing(self);
    if (ok > 0 && (ok = mw_entry_vector(self, idx, 0, &vi)) > 0 &&
        !(int_arg(padded_obj, &padded) && int_arg(tokens_obj, &tokens) && vi.len <= padded &&
          padded <= self->max_num_reqs && 0 <= tokens && tokens <= self->max_num_batched_tokens))
        ok = 0;
    if (ok > 0 && (ok = mw_entry_vector(self, qsl, 0, &vq)) > 0 && (ok = mw_entry_vector(self, pos, 0, &vp)) > 0 &&
        vq.len <= vi.len)
        ok = 0;
    if (ok > 0 && pad != Py_None && (ok = mw_entry_vector(self, pad, 1, &vd)) > 0 && vd.len < tokens)
        ok = 0;
    if (ok > 0 && nct != Py_None && (ok = mw_entry_vector(self, nct, 0, &vn)) > 0 && vn.len < self->max_num_reqs)
        ok = 0;
    ArenaFields *arena = (ArenaFields *)self->arena;
    if (ok > 0 && arena->may_overlap)
        ok = 0; /* (overlapping writes: the Python path orders them into rounds) */
    Handover h = {self, NULL, NULL, 0, -1, 0, 0};
    long long lead[12], extra = 0;
    const long long w = arena->num_writes, v = arena->num_values;
    if (ok > 0 && w)
        ok = staged_lead(self, &h, w, v, lead, &extra);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    const int window = nct != Py_None && self->window;
    PyObject *key = PyTuple_Pack(12, vi.dtype, vq.dtype, vp.dtype, pad != Py_None ? Py_True : Py_False, Py_True,
                                 Py_True, w ? Py_True : Py_False, Py_False, self->cp_size, self->cp_interleave,
                                 window ? vn.dtype : self->int32, window ? Py_True : Py_False);
    if (key == NULL)
        return NULL;
    const long long ptrs[5] = {vi.ptr, vq.ptr, vp.ptr, vd.ptr, window ? vn.ptr : f};
    LaunchHooks hooks;
    Py_XINCREF(h.nxt); /* (held: the hand-over rewrites the ring's list) */
    ok = mw_entry_launch(self, key, 1, w ? lead : NULL, extra, ptrs, vi.len, padded, vp.len,
                         w ? hooks_of(&h, &hooks) : NULL);
    Py_XDECREF(h.nxt);
    Py_DECREF(key);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *gathered = mw_cached_view(self->gathered_views, self->layout, mw_s_gathered, padded_obj);
    PyObject *slots = gathered == NULL ? NULL : mw_cached_view(self->slot_views, self->layout, mw_s_slots, tokens_obj);
    PyObject *both = slots == NULL ? NULL : PyTuple_Pack(2, gathered, slots);
    Py_XDECREF(gathered);
    Py_XDECREF(slots);
    return both;
}

/* apply(): True once EagerMode.apply's common case is launched (TritonPlan.apply: the apply kernel on the arena's
 * slot, with TritonDevice.launch_apply's grid and arguments), or None (nothing done). */
PyObject *mw_entry_apply(StageEntry *self, PyObject *unused) {
    if (self->arena == Py_None)
        return Py_NewRef(Py_None);
    ArenaFields *arena = (ArenaFields *)self->arena;
    const long long w = arena->num_writes, v = arena->num_values;
    Handover h = {self, NULL, NULL, 0, -1, 0, 0};
    long long counter = 0, grid[2];
    int ok = mw_entry_preamble(self, 0);
    if (ok > 0 && (ok = not_capturing(self)) > 0 && (ok = staged_slot(self, &h, &counter)) > 0)
        ok = mw_entry_current(self);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    const int decode = v <= self->apply_tiling[2]; /* (TritonDevice.launch_apply's variant) */
    mw_apply_grid(w, v, 1, self->apply_tiling, self->max_programs, grid);
    PyObject *fire = PyDict_GetItemWithError(self->apply_fire, self->apply_keys[decode]);
    if (fire == NULL || fire == Py_None)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    const long long words[11] = {self->desc_addr, h.lease->meta_addr, h.lease->values_addr, h.lease->bounds_addr,
                                 counter, h.lease->done_addr, h.token, self->num_tables, w, v, 1};
    LaunchHooks hooks;
    Py_INCREF(fire); /* (held for the call, as the next lease: nothing they run can free them) */
    Py_INCREF(h.nxt);
    if ((ok = mw_entry_fire(self, self->apply_launcher, fire, grid[0], grid[1], words, 11, hooks_of(&h, &hooks))) < 0)
        mw_entry_failure(self);
    Py_DECREF(h.nxt);
    Py_DECREF(fire);
    return ok < 0 ? NULL : Py_NewRef(Py_True);
}

/* StageLaunchSpec.staged (a StagedLaunchSpec, or None: prepare and apply never take the call). */
int mw_entry_read_staged(PyObject *spec, PyObject **got, long long *ints) {
    if (s_keep == NULL && ((s_keep = PyUnicode_InternFromString("keep")) == NULL ||
                           (s_lender = PyUnicode_InternFromString("lender")) == NULL ||
                           (s_next = PyUnicode_InternFromString("next")) == NULL))
        return -1;
    PyObject *staged = PyObject_GetAttrString(spec, "staged");
    if (staged == NULL)
        return -1;
    if (staged == Py_None) {
        for (int i = 0; i < STAGED_REFS; i++)
            got[i] = Py_NewRef(Py_None);
        Py_DECREF(staged);
        return 0;
    }
    /* got: arena, ring, its leases, succ and counter_addrs, keep, resolve, is_capturing, apply_launcher, its fire,
     * the two apply keys; ints: spec.staged.stage_tiling, apply_tiling and max_programs, keep.addr, keep.num_tables */
    static const char *const names[] = {"arena", "ring", "keep", "resolve", "is_capturing", "apply_launcher"};
    static const int where[] = {0, 1, 5, 6, 7, 8};
    int ok = 0;
    for (int i = 0; i < 6 && ok == 0; i++)
        ok = (got[where[i]] = PyObject_GetAttrString(staged, names[i])) == NULL ? -1 : 0;
    static const char *const lists[] = {"leases", "succ", "counter_addrs"};
    for (int i = 0; i < 3 && ok == 0; i++)
        ok = (got[2 + i] = PyObject_GetAttrString(got[1], lists[i])) == NULL ? -1 : 0;
    PyObject *chr = NULL, *tilings[2] = {NULL, NULL};
    if (ok == 0 && ((got[9] = PyObject_GetAttrString(got[8], "fire")) == NULL ||
                    (chr = PyObject_GetAttrString(staged, "values_char")) == NULL ||
                    (got[10] = PyTuple_Pack(2, chr, Py_False)) == NULL ||
                    (got[11] = PyTuple_Pack(2, chr, Py_True)) == NULL ||
                    (tilings[0] = PyObject_GetAttrString(staged, "stage_tiling")) == NULL ||
                    (tilings[1] = PyObject_GetAttrString(staged, "apply_tiling")) == NULL))
        ok = -1;
    Py_XDECREF(chr);
    static const char *const named[] = {"stage_tiling", "apply_tiling", "max_programs", "keep"};
    for (int i = 0; i < STAGED_INTS && ok == 0; i++) {
        const int which = i < 10 ? i / 5 : i == 10 ? 2 : 3; /* (which of `named` the int is read from) */
        PyObject *tiling = which < 2 ? tilings[which] : NULL, *value;
        if (which < 2)
            value = PyTuple_Check(tiling) && PyTuple_GET_SIZE(tiling) == 5 ? Py_NewRef(PyTuple_GET_ITEM(tiling, i % 5))
                                                                            : Py_NewRef(Py_None);
        else
            value = which == 2 ? PyObject_GetAttrString(staged, "max_programs")
                               : PyObject_GetAttrString(got[5], i == 11 ? "addr" : "num_tables");
        int got_int = mw_as_ll(value, &ints[i]);
        if (got_int == 0 || (got_int > 0 && ints[i] < 1))
            PyErr_Format(PyExc_TypeError, "StageEntry: spec.staged.%s must be %s", named[which],
                         which < 2    ? "a tuple of five positive ints"
                         : which == 2 ? "a positive int"
                                      : "descriptors (addr, num_tables)");
        ok = got_int > 0 && ints[i] >= 1 ? 0 : -1;
    }
    Py_XDECREF(tilings[0]);
    Py_XDECREF(tilings[1]);
    if (ok == 0 && !(PyObject_TypeCheck(got[0], &mw_ArenaFieldsType) && PyList_Check(got[2]) && PyList_Check(got[3]) &&
                     PyList_Check(got[4]) && PyCallable_Check(got[6]) && PyCallable_Check(got[7]) &&
                     PyDict_Check(got[9]))) {
        PyErr_SetString(PyExc_TypeError, "StageEntry: spec.staged needs an ArenaFields arena, a ring whose leases, "
                                         "succ and counter_addrs are lists, callable resolve and is_capturing, and an "
                                         "apply_launcher whose fire is a dict");
        ok = -1;
    }
    Py_DECREF(staged);
    return ok;
}

/*
 * multiwrite.staging._cstaging, part: StageEntry's gather and slots, an eager gather or slot-mapping call in one C
 * call, and what every call of the entry shares (the preamble, the inputs, the launch); the type is _cstaging_entry.c's.
 *
 * StageEntry(owner, countdown, guard, outputs_guard, failure, spec) sits in front of the one Python
 * path of a `BlockTables` stage call that applies nothing (multiwrite/tables/mode.py, TablesMode.stage_call): its
 * gather(idx, num_reqs_padded, num_computed_tokens) and slots(idx, query_start_loc, positions, num_tokens_padded,
 * is_padding) return None, having done nothing, unless every precondition of the common case holds: the countdown of
 * the address check is not due, neither guard's version counter moved, the inputs are contiguous 1-D tensors of
 * accepted dtypes on the tables' device with counts in range (the Python path's StepInputs.on_device), the stage
 * kernel's variant has a bound fast launcher and the current device is the tables'. Then it launches the stage kernel
 * with the arguments TritonPlan._stage passes for that step (multiwrite/stage/entry.py's StageLaunchSpec holds the
 * fixed ones), moves the owner's dirty_rows as stage_call does, and returns what the call returns: the views of
 * input_block_tables or of slot_mappings. A launch that raises an Exception is raised as failure(exc) (from exc), the
 * dirty rows unchanged; any other exception (an interrupt) moves them to the larger of both counts. Its prepare, the
 * call that applies the staged batch in the same launch, is _cstaging_prepare.c's.
 */
#include "_cstaging_entry.h"

static PyObject *s_version, *s_guard_version, *s_dirty_rows, *s_get_device, *s_stride, *s_data_ptr, *s_dtype,
    *s_shape;
PyObject *mw_s_launches, *mw_s_gathered, *mw_s_slots;

int mw_entry_names(void) {
    if (s_version != NULL)
        return 0;
    return (s_version = PyUnicode_InternFromString("_version")) == NULL ||
                   (s_guard_version = PyUnicode_InternFromString("version")) == NULL ||
                   (s_dirty_rows = PyUnicode_InternFromString("dirty_rows")) == NULL ||
                   (mw_s_launches = PyUnicode_InternFromString("launches")) == NULL ||
                   (s_get_device = PyUnicode_InternFromString("get_device")) == NULL ||
                   (s_stride = PyUnicode_InternFromString("stride")) == NULL ||
                   (s_data_ptr = PyUnicode_InternFromString("data_ptr")) == NULL ||
                   (s_dtype = PyUnicode_InternFromString("dtype")) == NULL ||
                   (s_shape = PyUnicode_InternFromString("shape")) == NULL ||
                   (mw_s_gathered = PyUnicode_InternFromString("gathered")) == NULL ||
                   (mw_s_slots = PyUnicode_InternFromString("slots")) == NULL
               ? -1
               : 0;
}

int mw_as_ll(PyObject *value, long long *out) {
    if (value == NULL)
        return -1;
    int ok = PyLong_CheckExact(value);
    if (ok) {
        *out = PyLong_AsLongLong(value);
        if (*out == -1 && PyErr_Occurred())
            ok = -1;
    }
    Py_DECREF(value);
    return ok;
}

static int call_ll(PyObject *obj, PyObject *name, long long *out) {
    return mw_as_ll(PyObject_VectorcallMethod(name, &obj, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL), out);
}


/* `t` a torch.Tensor (exactly) on the tables' device, 1-D contiguous (stride (1,)), of dtype int32/int64 (`flag`:
 * torch.bool): 1 (into *v), 0 (anything else: not taken), -1 (error). */
int mw_entry_vector(StageEntry *self, PyObject *t, int flag, Vector *v) {
    if ((PyObject *)Py_TYPE(t) != self->tensor_type)
        return 0;
    long long device;
    int ok = call_ll(t, s_get_device, &device);
    if (ok <= 0 || device != self->index) /* (a host input, or one on another device: the Python path copies it) */
        return ok < 0 ? -1 : 0;
    PyObject *dtype = PyObject_GetAttr(t, s_dtype);
    if (dtype == NULL)
        return -1;
    Py_DECREF(dtype); /* (dtype objects live as long as torch: compared by identity) */
    if (flag ? dtype != self->boolean : dtype != self->int32 && dtype != self->int64)
        return 0;
    v->dtype = dtype;
    PyObject *stride = PyObject_VectorcallMethod(s_stride, &t, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (stride == NULL)
        return -1;
    ok = PyTuple_Check(stride) && PyTuple_GET_SIZE(stride) == 1 && PyLong_CheckExact(PyTuple_GET_ITEM(stride, 0)) &&
         PyLong_AsLongLong(PyTuple_GET_ITEM(stride, 0)) == 1;
    Py_DECREF(stride);
    if (!ok)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *shape = PyObject_GetAttr(t, s_shape);
    if (shape == NULL)
        return -1;
    ok = PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == 1;
    if (ok) {
        Py_INCREF(PyTuple_GET_ITEM(shape, 0));
        ok = mw_as_ll(PyTuple_GET_ITEM(shape, 0), &v->len);
    }
    Py_DECREF(shape);
    if (ok <= 0)
        return ok;
    ok = call_ll(t, s_data_ptr, &v->ptr);
    if (ok > 0 && v->ptr == 0)
        v->ptr = self->fallback; /* (an empty tensor's address, 0, would read as an int32 under the interpreter) */
    return ok;
}

int mw_preamble_holds(PyObject *countdown, PyObject *storage, PyObject *guard, PyObject *outputs,
                      PyObject *outputs_guard) {
    if (((mw_Countdown *)countdown)->left <= 1) /* (due: the Python path checks the addresses) */
        return 0;
    PyObject *pairs[2][2] = {{storage, guard}, {outputs, outputs_guard}};
    for (int i = 0; i < 1 + (outputs != NULL); i++) {
        long long now, then;
        int ok = mw_as_ll(PyObject_GetAttr(pairs[i][0], s_version), &now);
        if (ok > 0)
            ok = mw_as_ll(PyObject_GetAttr(pairs[i][1], s_guard_version), &then);
        if (ok <= 0 || now != then)
            return ok < 0 ? -1 : 0;
    }
    return 1;
}

int mw_entry_preamble(StageEntry *self, int outputs) {
    return mw_preamble_holds(self->countdown, self->storage, self->guard, outputs ? self->outputs : NULL,
                             self->outputs_guard);
}

/* (`raise failure(exc) from exc`) */
void mw_entry_failure(StageEntry *self) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    if (!PyErr_GivenExceptionMatches(type, PyExc_Exception)) {
        PyErr_Restore(type, value, tb);
        return;
    }
    PyObject *raised = PyObject_CallOneArg(self->failure, value);
    if (raised == NULL || raised == value || !PyExceptionInstance_Check(raised)) {
        if (raised != NULL && raised != value)
            PyErr_SetString(PyExc_TypeError, "StageEntry: failure(exc) must return an exception");
        if (raised == value) {
            Py_DECREF(raised);
            PyErr_Restore(type, value, tb);
            return;
        }
        Py_XDECREF(raised);
        PyObject *t2, *v2, *tb2; /* (failure's own error, raised while handling the launch's: its context) */
        PyErr_Fetch(&t2, &v2, &tb2);
        PyErr_NormalizeException(&t2, &v2, &tb2);
        if (tb2 != NULL)
            PyException_SetTraceback(v2, tb2);
        PyException_SetContext(v2, value); /* (steals value) */
        Py_XDECREF(type);
        Py_XDECREF(tb);
        PyErr_Restore(t2, v2, tb2);
        return;
    }
    PyException_SetContext(raised, Py_NewRef(value));
    PyException_SetCause(raised, value); /* (steals value; sets __suppress_context__) */
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(raised)), raised, NULL);
}

void mw_entry_set_dirty(StageEntry *self, long long rows) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *n = PyLong_FromLongLong(rows);
    if (n == NULL || PyObject_SetAttr(self->owner, s_dirty_rows, n) < 0)
        PyErr_WriteUnraisable(self->owner);
    Py_XDECREF(n);
    PyErr_Restore(type, value, tb);
}

/* The step's arguments after the lead: groups, idx, qsl, pos, pad, nct, num_reqs, rows, tokens, splits. */
#define STEP_ARGS 10

static int launch_with(StageEntry *self, PyObject *fire, int gather, const long long *lead, long long extra,
                       const long long ptrs[5], long long n, long long padded, long long tokens,
                       const LaunchHooks *hooks);

int mw_entry_launch(StageEntry *self, PyObject *key, int gather, const long long *lead, long long extra,
                    const long long ptrs[5], long long n, long long padded, long long tokens,
                    const LaunchHooks *hooks) {
    PyObject *fire = PyDict_GetItemWithError(self->fire, key);
    if (fire == NULL || fire == Py_None)
        return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(fire); /* (held for the call: nothing it runs can free it) */
    int ok = launch_with(self, fire, gather, lead, extra, ptrs, n, padded, tokens, hooks);
    Py_DECREF(fire);
    return ok;
}

static int launch_with(StageEntry *self, PyObject *fire, int gather, const long long *lead, long long extra,
                       const long long ptrs[5], long long n, long long padded, long long tokens,
                       const LaunchHooks *hooks) {
    long long dirty = 0;
    int ok = mw_entry_current(self);
    if (ok <= 0)
        return ok;
    if (gather) {
        if ((ok = mw_as_ll(PyObject_GetAttr(self->owner, s_dirty_rows), &dirty)) <= 0)
            return ok;
        if (dirty > padded)
            padded = dirty;
    }
    /* the arguments: the lead (the staged batch's words; the spec's head: none), then the step's */
    const long long items[STEP_ARGS] = {self->groups, ptrs[0], ptrs[1], ptrs[2], ptrs[3], ptrs[4], n, padded, tokens,
                                        self->splits};
    long long values[LEAD_ARGS + STEP_ARGS];
    memcpy(values, lead == NULL ? self->head_values : lead, sizeof(long long) * LEAD_ARGS);
    memcpy(values + LEAD_ARGS, items, sizeof(items));
    if (mw_entry_fire(self, self->launcher, fire, self->groups * (padded + 1) * self->splits + extra, 1, values,
                      LEAD_ARGS + STEP_ARGS, hooks) < 0) {
        if (gather && !PyErr_ExceptionMatches(PyExc_Exception))
            mw_entry_set_dirty(self, dirty > n ? dirty : n); /* (an interrupt: the launch may have been issued) */
        mw_entry_failure(self);
        return -1;
    }
    if (gather)
        mw_entry_set_dirty(self, n);
    return 1;
}

int mw_entry_current(StageEntry *self) {
    long long current;
    PyObject *noargs = NULL;
    int ok = mw_as_ll(PyObject_Vectorcall(self->get_device, &noargs, 0, NULL), &current);
    if (ok < 0 && PyErr_ExceptionMatches(PyExc_Exception)) { /* (the Python path asks again, after its hand-over) */
        PyErr_Clear();
        return 0;
    }
    return ok <= 0 ? ok : current == self->index; /* (another device: the Python path switches to the tables') */
}

/* fire(grid0, grid1, stream, args) with `args` the `values` as Python ints: 1, or -1 (the error as raised). */
static int fire_with_objects(PyObject *fire, long long grid0, long long grid1, PyObject *stream,
                             const long long *values, Py_ssize_t n) {
    PyObject *args = PyTuple_New(n), *g0 = PyLong_FromLongLong(grid0), *g1 = PyLong_FromLongLong(grid1);
    int ok = args != NULL && g0 != NULL && g1 != NULL ? 0 : -1;
    for (Py_ssize_t i = 0; i < n && ok == 0; i++) {
        PyObject *item = PyLong_FromLongLong(values[i]);
        if (item == NULL)
            ok = -1;
        else
            PyTuple_SET_ITEM(args, i, item);
    }
    if (ok == 0) {
        PyObject *call[4] = {g0, g1, stream, args};
        PyObject *result = PyObject_Vectorcall(fire, call, 4, NULL);
        ok = result == NULL ? -1 : 1;
        Py_XDECREF(result);
    }
    Py_XDECREF(args);
    Py_XDECREF(g0);
    Py_XDECREF(g1);
    return ok;
}

int mw_entry_fire(StageEntry *self, PyObject *launcher, PyObject *fire, long long grid0, long long grid1,
                  const long long *values, Py_ssize_t n, const LaunchHooks *hooks) {
    ((mw_Countdown *)self->countdown)->left--; /* (the preamble's truth test: false, as mw_entry_preamble found) */
    if (hooks != NULL && hooks->before(hooks->ctx) < 0)
        return -1;
    /* (the stream after the hand-over, as TritonDevice.launch_on asks for it) */
    PyObject *stream = PyObject_CallOneArg(self->get_stream, self->index_obj), *target = fire;
    int ok = stream == NULL ? -1 : 0;
    long long raw;
    if (ok == 0 && Py_TYPE(fire) == &mw_DriverLaunchType) {
        ok = mw_as_ll(Py_NewRef(stream), &raw);
        if (ok < 0 && PyErr_ExceptionMatches(PyExc_OverflowError)) /* (a stream past a long long: Triton's) */
            PyErr_Clear(), ok = 0;
        if (ok > 0)
            ok = mw_driver_launch(fire, grid0, grid1, raw, values, n);
        if (ok == 0) /* (not taken: Triton's launcher, without asking the driver again) */
            target = mw_driver_fallback(fire);
    }
    if (ok == 0)
        ok = fire_with_objects(target, grid0, grid1, stream, values, n);
    Py_XDECREF(stream);
    if (ok < 0) {
        if (hooks != NULL)
            hooks->after(hooks->ctx, 0);
        return -1;
    }
    mw_count_one(launcher, mw_s_launches); /* (a statistic, as Launcher.launch counts it) */
    if (hooks != NULL)
        hooks->after(hooks->ctx, 1);
    return 1;
}

PyObject *mw_cached_view(PyObject *views, PyObject *layout, PyObject *name, PyObject *n) {
    PyObject *view = PyDict_GetItemWithError(views, n);
    if (view != NULL)
        return Py_NewRef(view);
    if (PyErr_Occurred())
        return NULL;
    PyObject *call[2] = {layout, n};
    return PyObject_VectorcallMethod(name, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* gather(idx_mapping, num_reqs_padded, num_computed_tokens): input_block_tables[g][:num_reqs_padded] per group
 * (launched), or None (nothing done). */
PyObject *mw_entry_gather(StageEntry *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return mw_usage_error("gather(idx_mapping, num_reqs_padded, num_computed_tokens): three arguments");
    PyObject *idx = args[0], *padded_obj = args[1], *nct = args[2];
    Vector vi, vn = {NULL, 0, self->fallback};
    long long padded;
    int ok = mw_entry_preamble(self, 1);
    if (ok > 0)
        ok = mw_entry_vector(self, idx, 0, &vi);
    if (ok > 0 && !(vi.len <= self->max_num_reqs && PyLong_CheckExact(padded_obj)))
        ok = 0;
    if (ok > 0) {
        padded = PyLong_AsLongLong(padded_obj);
        if (padded == -1 && PyErr_Occurred())
            PyErr_Clear(), ok = 0;
        else if (!(vi.len <= padded && padded <= self->max_num_reqs))
            ok = 0;
    }
    if (ok > 0 && nct != Py_None && (ok = mw_entry_vector(self, nct, 0, &vn)) > 0 && vn.len < self->max_num_reqs)
        ok = 0;
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    const int window = nct != Py_None && self->window;
    PyObject *key = PyTuple_Pack(12, vi.dtype, self->int64, self->int64, Py_False, Py_True, Py_False, Py_False,
                                 Py_False, self->cp_size, self->cp_interleave, window ? vn.dtype : self->int32,
                                 window ? Py_True : Py_False);
    if (key == NULL)
        return NULL;
    const long long f = self->fallback, ptrs[5] = {vi.ptr, f, f, f, window ? vn.ptr : f};
    ok = mw_entry_launch(self, key, 1, NULL, 0, ptrs, vi.len, padded, 0, NULL);
    Py_DECREF(key);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    return mw_cached_view(self->gathered_views, self->layout, mw_s_gathered, padded_obj);
}

/* slots(idx_mapping, query_start_loc, positions, num_tokens_padded, is_padding): slot_mappings[:, :num_tokens_padded]
 * (launched), or None (nothing done). */
PyObject *mw_entry_slots(StageEntry *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5)
        return mw_usage_error("slots(idx_mapping, query_start_loc, positions, num_tokens_padded, is_padding): five "
                              "arguments");
    PyObject *idx = args[0], *qsl = args[1], *pos = args[2], *tokens_obj = args[3], *pad = args[4];
    Vector vi, vq, vp, vd = {NULL, 0, self->fallback};
    long long tokens;
    int ok = mw_entry_preamble(self, 1);
    if (ok > 0)
        ok = mw_entry_vector(self, idx, 0, &vi);
    if (ok > 0 && !(vi.len <= self->max_num_reqs && self->max_num_batched_tokens >= 0 && PyLong_CheckExact(tokens_obj)))
        ok = 0;
    if (ok > 0 && (ok = mw_entry_vector(self, qsl, 0, &vq)) > 0 && (ok = mw_entry_vector(self, pos, 0, &vp)) > 0) {
        tokens = PyLong_AsLongLong(tokens_obj);
        if (tokens == -1 && PyErr_Occurred())
            PyErr_Clear(), ok = 0;
        else if (!(vq.len > vi.len && 0 <= tokens && tokens <= self->max_num_batched_tokens))
            ok = 0;
    }
    if (ok > 0 && pad != Py_None && (ok = mw_entry_vector(self, pad, 1, &vd)) > 0 && vd.len < tokens)
        ok = 0;
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *key = PyTuple_Pack(12, vi.dtype, vq.dtype, vp.dtype, pad != Py_None ? Py_True : Py_False, Py_False,
                                 Py_True, Py_False, Py_False, self->cp_size, self->cp_interleave, self->int32,
                                 Py_False);
    if (key == NULL)
        return NULL;
    const long long ptrs[5] = {vi.ptr, vq.ptr, vp.ptr, vd.ptr, self->fallback};
    ok = mw_entry_launch(self, key, 0, NULL, 0, ptrs, vi.len, vi.len, vp.len, NULL);
    Py_DECREF(key);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    return mw_cached_view(self->slot_views, self->layout, mw_s_slots, tokens_obj);
}

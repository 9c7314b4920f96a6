/*
 * multiwrite.staging._cstaging, part: VllmStaging, the base class of multiwrite.vllm.BlockTables.
 *
 * Its append_block_ids is vLLM's (entries of new_block_ids past the groups are ignored; with the instance's
 * redirect_writes_to_null_block true every id stages as the null block 0), staged straight into the core's
 * compiled staging (mw_stage_block_ids, with MW_EXTRA_GROUPS and MW_NULL_BLOCK). _bind_vllm(core) hands it the
 * core's BlockIdStaging once (None: every call takes the Python path). A call it does not take exactly (anything
 * unusual, any error, no room) goes to the instance's _append_block_ids (multiwrite/vllm/block_tables.py), which
 * stages it or raises the adapter's error.
 */
#include "_cstaging.h"

typedef struct {
    PyObject_HEAD
    PyObject *core; /* the core's BlockIdStaging (strong), or NULL: the Python path only */
} VllmStaging;

static PyObject *redirect_name, *fallback_name; /* interned at the first call */

static PyMemberDef vllm_members[] = {
    {"staging_core", T_OBJECT, offsetof(VllmStaging, core), READONLY, "the core BlockTables staged into, or None"},
    {NULL},
};

static PyObject *vllm_fallback(VllmStaging *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *fn = PyObject_GetAttr((PyObject *)Py_TYPE(self), fallback_name);
    if (fn == NULL)
        return NULL;
    PyObject *result = mw_call_fallback(fn, (PyObject *)self, args, nargsf, kwnames);
    Py_DECREF(fn);
    return result;
}

static PyObject *vllm_append(VllmStaging *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (redirect_name == NULL &&
        ((redirect_name = PyUnicode_InternFromString("redirect_writes_to_null_block")) == NULL ||
         (fallback_name = PyUnicode_InternFromString("_append_block_ids")) == NULL))
        return NULL;
    PyObject *p[3];
    if (self->core != NULL && mw_bind_params(args, nargsf, kwnames, "req_index", p) &&
        (p[2] == Py_True || p[2] == Py_False)) {
        PyObject *redirect = PyObject_GetAttr((PyObject *)self, redirect_name);
        if (redirect == NULL)
            return NULL;
        const int null = redirect == Py_True ? 1 : redirect == Py_False ? 0 : -1;
        Py_DECREF(redirect);
        if (null >= 0) {
            const int flags = MW_EXTRA_GROUPS | (null ? MW_NULL_BLOCK : 0);
            const int status = mw_stage_block_ids(self->core, p[0], p[1], p[2] == Py_True, flags);
            if (status <= 0)
                return status < 0 ? NULL : Py_NewRef(Py_None);
        }
    }
    return vllm_fallback(self, args, nargsf, kwnames);
}

/* _bind_vllm(core): the core BlockTables (a BlockIdStaging whose append_block_ids is the compiled one) or None. */
static PyObject *vllm_bind(VllmStaging *self, PyObject *core) {
    if (core != Py_None && !PyObject_TypeCheck(core, &mw_BlockIdStagingType))
        return mw_usage_error("_bind_vllm(core): a BlockIdStaging or None");
    Py_XSETREF(self->core, core == Py_None ? NULL : Py_NewRef(core));
    Py_RETURN_NONE;
}

static const Py_ssize_t vllm_refs[] = {offsetof(VllmStaging, core), -1};

MW_GC_FUNCS(vllm, VllmStaging)

static PyMethodDef vllm_methods[] = {
    {"append_block_ids", (PyCFunction)(void (*)(void))vllm_append, METH_FASTCALL | METH_KEYWORDS,
     "append_block_ids($self, req_index, new_block_ids, overwrite)\n--\n\n"
     "Stage request row `req_index`'s new block ids, one list per group (entries past the groups are ignored;\n"
     "every id stages as the null block 0 while redirect_writes_to_null_block is true); `overwrite`: from column 0.\n"
     "Counts (`num_blocks.np`) change at once. Compiled; the full documentation and the path of every call it does\n"
     "not take: multiwrite.vllm.BlockTables._append_block_ids.\n\n"
     "Raises:\n"
     "    BlockTableWriteError: a write past a row's capacity (naming request, group and capacity), a row outside\n"
     "        the tables, ids that are not integers; nothing of the call is staged, for any group."},
    {"_bind_vllm", (PyCFunction)vllm_bind, METH_O,
     "_bind_vllm(core): the core BlockTables staged into (a BlockIdStaging), or None: the Python path only."},
    {NULL},
};

PyTypeObject mw_VllmStagingType = {
    MW_TYPE_HEAD("VllmStaging", VllmStaging, vllm, Py_TPFLAGS_HAVE_GC,
                 "append_block_ids of multiwrite.vllm.BlockTables, compiled (its base class)."),
    .tp_new = PyType_GenericNew,
    MW_GC_SLOTS(vllm),
};

/*
 * multiwrite.staging._cstaging, part: the type FastLaunch, a compiled kernel's launch as one C call.
 *
 * FastLaunch(launch, head, consts, packed) is the `fire(grid0, grid1, stream, args)` that the Triton backends' launcher
 * binds to a compiled kernel (multiwrite/backends/triton/launcher.py, bind_fast_launcher): it calls Triton's compiled C
 * launcher `launch` with (grid0, grid1, 1, stream, *head, *args, *consts), or with packed true (Triton 3.9's calling
 * convention) (grid0, grid1, 1, stream, *head, (*args, *consts)). It does what that function's Python twin does, in
 * one vectorcall and no Python frame: every launch of a stage call passes through it.
 */
#include "_cstaging.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *launch; /* Triton's compiled launcher (a builtin) */
    PyObject *head;   /* tuple: the arguments between the stream and the kernel's */
    PyObject *consts; /* tuple: the constexprs, after the kernel's arguments */
    int packed;       /* the kernel's arguments and the constexprs go as one tuple */
} FastLaunch;

/* Arguments of a launch kept on the C stack; a longer one is allocated. */
#define STACK_ARGS 64

static PyObject *fast_launch_call(FastLaunch *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (self->head == NULL) {
        PyErr_SetString(PyExc_TypeError, "FastLaunch: not initialized");
        return NULL;
    }
    if (nargs != 4 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) || !PyTuple_Check(args[3]))
        return mw_usage_error("fire(grid0, grid1, stream, args): four positional arguments, args a tuple");
    PyObject *kernel_args = args[3];
    Py_ssize_t nhead = PyTuple_GET_SIZE(self->head), nk = PyTuple_GET_SIZE(kernel_args);
    Py_ssize_t nconsts = PyTuple_GET_SIZE(self->consts);
    Py_ssize_t total = 4 + nhead + (self->packed ? 1 : nk + nconsts);
    PyObject *small[STACK_ARGS], **stack = small;
    if (total > STACK_ARGS) {
        stack = PyMem_Malloc(sizeof(PyObject *) * (size_t)total);
        if (stack == NULL)
            return PyErr_NoMemory();
    }
    static PyObject *one = NULL;
    if (one == NULL && (one = PyLong_FromLong(1)) == NULL)
        goto fail;
    PyObject *packed = NULL;
    stack[0] = args[0];
    stack[1] = args[1];
    stack[2] = one;
    stack[3] = args[2];
    Py_ssize_t at = 4;
    for (Py_ssize_t i = 0; i < nhead; i++)
        stack[at++] = PyTuple_GET_ITEM(self->head, i);
    if (self->packed) {
        packed = PyTuple_New(nk + nconsts);
        if (packed == NULL)
            goto fail;
        for (Py_ssize_t i = 0; i < nk; i++)
            PyTuple_SET_ITEM(packed, i, Py_NewRef(PyTuple_GET_ITEM(kernel_args, i)));
        for (Py_ssize_t i = 0; i < nconsts; i++)
            PyTuple_SET_ITEM(packed, nk + i, Py_NewRef(PyTuple_GET_ITEM(self->consts, i)));
        stack[at++] = packed;
    } else {
        for (Py_ssize_t i = 0; i < nk; i++)
            stack[at++] = PyTuple_GET_ITEM(kernel_args, i);
        for (Py_ssize_t i = 0; i < nconsts; i++)
            stack[at++] = PyTuple_GET_ITEM(self->consts, i);
    }
    PyObject *result = PyObject_Vectorcall(self->launch, stack, (size_t)total, NULL);
    Py_XDECREF(packed);
    if (stack != small)
        PyMem_Free(stack);
    return result;
fail:
    if (stack != small)
        PyMem_Free(stack);
    return NULL;
}

static int fast_launch_init(FastLaunch *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"launch", "head", "consts", "packed", NULL};
    PyObject *launch, *head, *consts;
    int packed;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!p:FastLaunch", keywords, &launch, &PyTuple_Type, &head,
                                     &PyTuple_Type, &consts, &packed))
        return -1;
    if (!PyCallable_Check(launch)) {
        PyErr_SetString(PyExc_TypeError, "FastLaunch: launch must be callable");
        return -1;
    }
    Py_XSETREF(self->launch, Py_NewRef(launch));
    Py_XSETREF(self->head, Py_NewRef(head));
    Py_XSETREF(self->consts, Py_NewRef(consts));
    self->packed = packed;
    self->vectorcall = (vectorcallfunc)fast_launch_call;
    return 0;
}

MW_VECTORCALL_NEW(fast_launch, FastLaunch, fast_launch_call) /* (refuses until init: head is NULL) */

static const Py_ssize_t fast_launch_refs[] = {offsetof(FastLaunch, launch), offsetof(FastLaunch, head),
                                              offsetof(FastLaunch, consts), -1};

MW_GC_FUNCS(fast_launch, FastLaunch)

static PyMemberDef fast_launch_members[] = {
    {"launch", T_OBJECT, offsetof(FastLaunch, launch), READONLY, "Triton's compiled launcher"},
    {"head", T_OBJECT, offsetof(FastLaunch, head), READONLY, "the arguments between the stream and the kernel's"},
    {"consts", T_OBJECT, offsetof(FastLaunch, consts), READONLY, "the constexprs, after the kernel's arguments"},
    {"packed", T_INT, offsetof(FastLaunch, packed), READONLY, "the kernel's arguments and constexprs go as one tuple"},
    {NULL},
};

static PyMethodDef fast_launch_methods[] = {{NULL}};

PyTypeObject mw_FastLaunchType = {
    MW_TYPE_HEAD("FastLaunch", FastLaunch, fast_launch, Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
                 "FastLaunch(launch, head, consts, packed): fire(grid0, grid1, stream, args) calls\n"
                 "launch(grid0, grid1, 1, stream, *head, *args, *consts), or with packed\n"
                 "launch(grid0, grid1, 1, stream, *head, (*args, *consts)). Python twin: the closures of\n"
                 "multiwrite.backends.triton.launcher.bind_fast_launcher."),
    MW_VECTORCALL_SLOTS(fast_launch, FastLaunch),
};

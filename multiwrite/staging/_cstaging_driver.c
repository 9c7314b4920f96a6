/*
 * multiwrite.staging._cstaging, part: the type DriverLaunch, a compiled kernel's launch as one call of the CUDA
 * driver's cuLaunchKernelEx.
 *
 * DriverLaunch(launch_ex, function, block_x, shared, pdl, kinds, extra, fallback) is the `fire(grid0, grid1, stream,
 * args)` that the Triton backends' launcher binds first on NVIDIA (multiwrite/backends/triton/launcher.py,
 * driver_launcher): `launch_ex` the address of cuLaunchKernelEx, `function` the kernel's CUfunction, `kinds` one byte
 * per entry of `args` (0: a compile-time constant, not passed; 4: an int32 parameter; 8: an int64 or a pointer, in order),
 * then `extra` pointer parameters passed as 0 (Triton's scratch memory, which these kernels do not use). It does what
 * Triton's compiled launcher does for such a kernel without parsing a Python argument list: grid (grid0, grid1, 1),
 * 32 x warps threads, `shared` bytes, the programmatic-stream-serialization attribute with `pdl`, the GIL released
 * during the call, nothing launched for an empty grid. Whatever it does not take exactly (an argument that is not an
 * int in range, a grid past the driver's limits) and every launch the driver refuses (no current context on this
 * thread, say) goes to `fallback`, Triton's own launcher, whose errors are the ones raised.
 */
#include "_cstaging.h"

/* The driver's types, as cuda.h declares them (CUDA 12 and newer): no CUDA header is needed to build. */
typedef struct {
    unsigned int grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
    void *stream;
    void *attrs;
    unsigned int num_attrs;
} mw_LaunchConfig;

typedef struct {
    int id;
    char pad[4];
    union {
        char pad[64];
        int value;
        void *align; /* (the union's pointer members: 8-byte alignment, as cuda.h's) */
    } value;
} mw_LaunchAttribute;

#if UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu /* (CUDA's driver launch: 64-bit hosts) */
_Static_assert(sizeof(mw_LaunchConfig) == 56 && offsetof(mw_LaunchConfig, stream) == 32 &&
                   offsetof(mw_LaunchConfig, attrs) == 40 && offsetof(mw_LaunchConfig, num_attrs) == 48,
               "CUlaunchConfig's layout (cuda.h, 64-bit)");
_Static_assert(sizeof(mw_LaunchAttribute) == 72 && offsetof(mw_LaunchAttribute, value) == 8 &&
                   _Alignof(mw_LaunchAttribute) == 8,
               "CUlaunchAttribute's layout (cuda.h, 64-bit)");
#endif

typedef int (*mw_launch_ex_t)(const mw_LaunchConfig *config, void *function, void **params, void **extra);

/* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION */
#define MW_ATTR_PDL 6
/* Parameters of a launch (the kernel's and the trailing zero pointers) kept on the C stack. */
#define DRIVER_PARAMS 64

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    mw_launch_ex_t launch_ex;
    void *function;
    unsigned int block_x, shared;
    int pdl;
    Py_ssize_t num_kinds, extra;
    unsigned char kinds[DRIVER_PARAMS];
    PyObject *fallback; /* fire(grid0, grid1, stream, args) through Triton's launcher */
} DriverLaunch;

/* The launch with `values` (one per kind; a kind 0's is ignored): 1 (launched, or an empty grid: nothing to launch),
 * 0 (not taken, nothing launched: a count or value outside what the driver takes, or the driver refused). */
static int launch_values(DriverLaunch *self, long long grid0, long long grid1, long long stream,
                         const long long *values) {
    if (grid0 < 0 || grid0 > 0x7FFFFFFF || grid1 < 0 || grid1 > 65535 || stream < 0)
        return 0;
    if (grid0 == 0 || grid1 == 0)
        return 1; /* (Triton's launcher launches nothing for an empty grid) */
    uint64_t slots[DRIVER_PARAMS];
    void *params[DRIVER_PARAMS];
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < self->num_kinds; i++) {
        const unsigned char kind = self->kinds[i];
        const long long v = values[i];
        if (kind == 0)
            continue;
        if (kind == 4) {
            if (v < INT32_MIN || v > INT32_MAX)
                return 0;
            const int32_t word = (int32_t)v;
            memcpy(&slots[n], &word, sizeof(word));
        } else {
            memcpy(&slots[n], &v, sizeof(v));
        }
        params[n] = &slots[n];
        n++;
    }
    for (Py_ssize_t i = 0; i < self->extra; i++, n++) {
        slots[n] = 0;
        params[n] = &slots[n];
    }
    mw_LaunchAttribute attr;
    memset(&attr, 0, sizeof(attr));
    attr.id = MW_ATTR_PDL;
    attr.value.value = 1;
    const mw_LaunchConfig config = {(unsigned int)grid0, (unsigned int)grid1, 1, self->block_x, 1, 1, self->shared,
                                    (void *)(uintptr_t)stream, self->pdl ? &attr : NULL, self->pdl ? 1 : 0};
    int result;
    Py_BEGIN_ALLOW_THREADS;
    result = self->launch_ex(&config, self->function, params, NULL);
    Py_END_ALLOW_THREADS;
    return result == 0;
}

int mw_driver_launch(PyObject *fire, long long grid0, long long grid1, long long stream, const long long *values,
                     Py_ssize_t n) {
    DriverLaunch *self = (DriverLaunch *)fire;
    return self->fallback != NULL && n == self->num_kinds && launch_values(self, grid0, grid1, stream, values);
}

PyObject *mw_driver_fallback(PyObject *fire) {
    PyObject *fallback = ((DriverLaunch *)fire)->fallback;
    return fallback != NULL ? fallback : fire; /* (uninitialized: its own call refuses) */
}

/* An exact int into *out: 1, or 0 (not taken: no error left set). */
static int exact_ll(PyObject *value, long long *out) {
    if (!PyLong_CheckExact(value))
        return 0;
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static PyObject *driver_launch_call(DriverLaunch *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (self->fallback == NULL) {
        PyErr_SetString(PyExc_TypeError, "DriverLaunch: not initialized");
        return NULL;
    }
    if (PyVectorcall_NARGS(nargsf) != 4 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) || !PyTuple_Check(args[3]))
        return mw_usage_error("fire(grid0, grid1, stream, args): four positional arguments, args a tuple");
    PyObject *kernel_args = args[3];
    if (PyTuple_GET_SIZE(kernel_args) != self->num_kinds) {
        PyErr_Format(PyExc_TypeError, "DriverLaunch: %zd kernel arguments, the kernel takes %zd",
                     PyTuple_GET_SIZE(kernel_args), self->num_kinds);
        return NULL;
    }
    long long grid0, grid1, stream, values[DRIVER_PARAMS];
    int taken = exact_ll(args[0], &grid0) && exact_ll(args[1], &grid1) && exact_ll(args[2], &stream);
    for (Py_ssize_t i = 0; i < self->num_kinds && taken; i++)
        taken = self->kinds[i] == 0 ? (values[i] = 0, 1) : exact_ll(PyTuple_GET_ITEM(kernel_args, i), &values[i]);
    if (taken && launch_values(self, grid0, grid1, stream, values))
        Py_RETURN_NONE;
    /* (Triton's launcher: it sets up a missing context, or raises its own error) */
    return PyObject_Vectorcall(self->fallback, args, 4, NULL);
}

static int driver_launch_init(DriverLaunch *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"launch_ex", "function", "block_x", "shared", "pdl", "kinds", "extra", "fallback",
                               NULL};
    unsigned long long launch_ex, function;
    unsigned int block_x, shared;
    int pdl;
    Py_buffer kinds;
    Py_ssize_t extra;
    PyObject *fallback;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKIIpy*nO:DriverLaunch", keywords, &launch_ex, &function,
                                     &block_x, &shared, &pdl, &kinds, &extra, &fallback))
        return -1;
    int ok = -1;
    Py_ssize_t passed = 0;
    for (Py_ssize_t i = 0; i < kinds.len; i++) {
        const unsigned char kind = ((const unsigned char *)kinds.buf)[i];
        if (kind != 0 && kind != 4 && kind != 8) {
            PyErr_Format(PyExc_ValueError, "DriverLaunch: kinds[%zd] is %d (0, 4 or 8)", i, (int)kind);
            goto done;
        }
        passed += kind != 0;
    }
    if (launch_ex == 0 || !PyCallable_Check(fallback) || extra < 0 || block_x == 0) {
        PyErr_SetString(PyExc_ValueError, "DriverLaunch: launch_ex must be an address, fallback callable, extra >= 0 "
                                          "and block_x > 0");
        goto done;
    }
    if (kinds.len > DRIVER_PARAMS || passed + extra > DRIVER_PARAMS) {
        PyErr_Format(PyExc_ValueError, "DriverLaunch: at most %d arguments and parameters", DRIVER_PARAMS);
        goto done;
    }
    memcpy(self->kinds, kinds.buf, (size_t)kinds.len);
    self->num_kinds = kinds.len;
    self->launch_ex = (mw_launch_ex_t)(uintptr_t)launch_ex;
    self->function = (void *)(uintptr_t)function;
    self->block_x = block_x;
    self->shared = shared;
    self->pdl = pdl;
    self->extra = extra;
    Py_XSETREF(self->fallback, Py_NewRef(fallback));
    ok = 0;
done:
    PyBuffer_Release(&kinds);
    return ok;
}

MW_VECTORCALL_NEW(driver_launch, DriverLaunch, driver_launch_call) /* (refuses until init: fallback is NULL) */

static const Py_ssize_t driver_launch_refs[] = {offsetof(DriverLaunch, fallback), -1};

MW_GC_FUNCS(driver_launch, DriverLaunch)

static PyMemberDef driver_launch_members[] = {
    {"fallback", T_OBJECT, offsetof(DriverLaunch, fallback), READONLY, "fire through Triton's launcher"}, {NULL}};
static PyMethodDef driver_launch_methods[] = {{NULL}};

PyTypeObject mw_DriverLaunchType = {
    MW_TYPE_HEAD("DriverLaunch", DriverLaunch, driver_launch, Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
                 "DriverLaunch(launch_ex, function, block_x, shared, pdl, kinds, extra, fallback):\n"
                 "fire(grid0, grid1, stream, args) as one cuLaunchKernelEx of `function` (kinds: per entry of args\n"
                 "0 skipped, 4 or 8 bytes; then `extra` zero pointers); what it does not take goes to fallback."),
    MW_VECTORCALL_SLOTS(driver_launch, DriverLaunch),
};

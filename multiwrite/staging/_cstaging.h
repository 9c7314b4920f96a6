/*
 * multiwrite/staging/_cstaging.h: what the source files of the one extension module multiwrite.staging._cstaging
 * share (private: only its .c files include it, and nothing here is a Python-visible name of its own). It holds the
 * two structs more than one file reads (LeaseFields and ArenaFields; their types are in _cstaging_arena.c), the
 * header ring's layout (constants PyInit also exports), the type objects shared between files, the module's globals
 * (the staging clock, the Python twin's fallbacks; defined in _cstaging.c), what the type objects share (MW_TYPE_HEAD
 * and MW_GC_SLOTS, and helpers defined in _cstaging.c), and the arena's C-level steps that block-id
 * staging and graph mode's publish take (defined in _cstaging_arena.c). Every name shared between files starts with
 * mw_ and stays inside the extension (MW_INTERNAL): PyInit__cstaging remains its only exported symbol. The files:
 * - _cstaging.c: the module (PyInit, bind_clock, set_fallbacks, scatter_writes, Countdown), the globals, the
 *   types' helpers.
 * - _cstaging_arena.c: LeaseFields and ArenaFields.
 * - _cstaging_block_ids.c: BlockIdStaging (append_block_ids, append_block_ids_batch, _bind_staging).
 * - _cstaging_headers.c: HeaderRingFields (publish, commit).
 * - _cstaging_commit.c: CommitEntry (graph mode's BlockTables.commit_staged_writes in one C call).
 * - _cstaging_vllm.c: VllmStaging (multiwrite.vllm.BlockTables.append_block_ids).
 * - _cstaging_launch.c: FastLaunch (a compiled Triton kernel's launch, multiwrite/backends/triton/launcher.py).
 * - _cstaging_driver.c: DriverLaunch (the same launch as one call of the CUDA driver's cuLaunchKernelEx).
 * - _cstaging_grid.c: apply_grid, the apply programs' tiling (the Triton backends' and the stage entry's).
 * - _cstaging_entry.c, _cstaging_stage.c, _cstaging_prepare.c: StageEntry (an eager stage call checked and launched
 *   in one C call, multiwrite/stage/entry.py; _cstaging_entry.h says which file holds what).
 */
#ifndef MULTIWRITE_STAGING_CSTAGING_H
#define MULTIWRITE_STAGING_CSTAGING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

/* Shared between the module's files, hidden from everything outside it. */
#if defined(__GNUC__) || defined(__clang__)
#define MW_INTERNAL __attribute__((visibility("hidden")))
#else
#define MW_INTERNAL
#endif

/* ---- what the types share (the helpers: _cstaging.c) ---------------------------------------------- */

/* The fields every one of the module's type objects sets: its name in the module, its struct, the flags besides
 * Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE (each type is the base class of a Python class), its doc, and its tables
 * prefix_members and prefix_methods. */
#define MW_TYPE_HEAD(name, type, prefix, flags, doc)                                                                  \
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "multiwrite.staging._cstaging." name, .tp_basicsize = sizeof(type),      \
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | (flags), .tp_doc = (doc),                                  \
    .tp_members = prefix##_members, .tp_methods = prefix##_methods

/* The garbage collector's slots of a Py_TPFLAGS_HAVE_GC type: its functions prefix_traverse, prefix_tp_clear and
 * prefix_dealloc. */
#define MW_GC_SLOTS(prefix)                                                                                           \
    .tp_traverse = (traverseproc)prefix##_traverse, .tp_clear = (inquiry)prefix##_tp_clear,                           \
    .tp_dealloc = (destructor)prefix##_dealloc

/* A vectorcall type (a struct `type` with a `vectorcall` field, a tp_init prefix_init and the GC functions of
 * MW_GC_FUNCS): MW_VECTORCALL_NEW defines its tp_new prefix_new, which sets `vectorcall` to `call` (a call that
 * refuses until prefix_init ran), MW_VECTORCALL_SLOTS its type object's slots after MW_TYPE_HEAD. */
#define MW_VECTORCALL_NEW(prefix, type, call)                                                                         \
    static PyObject *prefix##_new(PyTypeObject *cls, PyObject *args, PyObject *kwargs) {                              \
        type *self = (type *)cls->tp_alloc(cls, 0);                                                                   \
        if (self != NULL)                                                                                             \
            self->vectorcall = (vectorcallfunc)(call);                                                                \
        return (PyObject *)self;                                                                                      \
    }
#define MW_VECTORCALL_SLOTS(prefix, type)                                                                             \
    .tp_new = prefix##_new, .tp_init = (initproc)prefix##_init, .tp_vectorcall_offset = offsetof(type, vectorcall),   \
    .tp_call = PyVectorcall_Call, MW_GC_SLOTS(prefix)

/* A GC type's strong references are the PyObject * fields at `refs` (their offsets, ended by -1): its traverse visits
 * them (mw_visit_refs), its tp_clear drops them (mw_clear_refs), and its dealloc untracks the object, runs its
 * tp_clear `clear` and frees it (mw_gc_dealloc). */
/* The three functions of MW_GC_SLOTS(prefix) for a struct `type` whose strong references are listed in the array
 * prefix_refs (offsets ended by -1), built from the helpers below. */
#define MW_GC_FUNCS(prefix, type)                                                                                     \
    static int prefix##_traverse(type *self, visitproc visit, void *arg) {                                            \
        return mw_visit_refs((PyObject *)self, prefix##_refs, visit, arg);                                            \
    }                                                                                                                 \
    static int prefix##_tp_clear(type *self) {                                                                        \
        mw_clear_refs((PyObject *)self, prefix##_refs);                                                               \
        return 0;                                                                                                     \
    }                                                                                                                 \
    static void prefix##_dealloc(type *self) { mw_gc_dealloc((PyObject *)self, (inquiry)prefix##_tp_clear); }
MW_INTERNAL int mw_visit_refs(PyObject *self, const Py_ssize_t *refs, visitproc visit, void *arg);
MW_INTERNAL void mw_clear_refs(PyObject *self, const Py_ssize_t *refs);
MW_INTERNAL void mw_gc_dealloc(PyObject *self, inquiry clear);
/* A call whose arguments do not bind: TypeError(`usage`), the call's signature and what it takes; returns NULL. */
MW_INTERNAL PyObject *mw_usage_error(const char *usage);
/* obj.<name> += 1, a statistic: errors are cleared. */
MW_INTERNAL void mw_count_one(PyObject *obj, PyObject *name);

/* ---- the staging clock and the Python twin (defined in _cstaging.c) ------------------------------------- */

/* (uid of the arena that staged last, runs started): staging.arena.STAGE_CLOCK, bound by bind_clock; NULL before. */
MW_INTERNAL extern int64_t *mw_clock_words;
/* set_fallbacks(append, append_batch, batch_failure): the Python twin's functions for calls C does not take. */
MW_INTERNAL extern PyObject *mw_fallback_append, *mw_fallback_batch, *mw_batch_failure_fn;

/* ---- LeaseFields ---------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_ssize_t meta_addr;   /* int32 [meta_cap, 5] */
    Py_ssize_t values_addr; /* values_cap items */
    Py_ssize_t bounds_addr; /* int32 [meta_cap + 1]: first write of each overlap round (0: none) */
    Py_ssize_t done_addr;   /* int32 word a kernel stores `token` into when it has read this memory (0: none) */
    Py_ssize_t meta_cap;
    Py_ssize_t values_cap;
    Py_ssize_t slot;        /* the lender's name for it (-1: not lent) */
    long long token;        /* the token of the last launch that read it */
} LeaseFields;

MW_INTERNAL extern PyTypeObject mw_LeaseFieldsType;

/* ---- ArenaFields ---------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_ssize_t num_writes;  /* staged writes: metadata rows [0, num_writes) */
    Py_ssize_t num_values;  /* staged values [0, num_values) */
    Py_ssize_t meta_addr;   /* of the current lease */
    Py_ssize_t values_addr;
    Py_ssize_t meta_cap;
    Py_ssize_t values_cap;
    Py_ssize_t uid;         /* the arena's name on the staging clock */
    long long batch;        /* the staged batch's number: +1 at every clear and land (the overlap epoch) */
    char may_overlap;       /* two staged writes may touch one row of one table */
    PyObject *runs;         /* list of (clock, first write) of each run staged now */
    PyObject *rows_seen;    /* set of row << 16 | table staged now (arenas of standalone tables) */
    PyObject *lease;        /* the LeaseFields staged into, or None */
} ArenaFields;

MW_INTERNAL extern PyTypeObject mw_ArenaFieldsType;

/* clear(): drop every staged write, a new batch number, the next write starts a run. 0, or -1 with an error set. */
MW_INTERNAL int mw_arena_clear(ArenaFields *arena);
/* adopt(lease): stage into `lease` from now on (nothing is copied). */
MW_INTERNAL void mw_arena_adopt(ArenaFields *arena, LeaseFields *lease);
/* The next write of `arena` (at index num_writes) starts a run on the staging clock. 0, or -1 with an error set. */
MW_INTERNAL int mw_arena_begin_run(ArenaFields *arena);

/* ---- BlockIdStaging (_cstaging_block_ids.c) ------------------------------------------------------------- */

#define MAX_GROUPS 64

MW_INTERNAL extern PyTypeObject mw_BlockIdStagingType;

#define STATUS_FALLBACK 1   /* unusual input, an error, or no room: the Python twin stages it or raises */
#define MW_EXTRA_GROUPS 1   /* staging flag: entries of new_block_ids past the groups are ignored */
#define MW_NULL_BLOCK 2     /* staging flag: every id stages as the null block 0 (only the lengths are read) */
/* One append_block_ids call into `staging` (a bound BlockIdStaging), with `flags`: 0 (staged), STATUS_FALLBACK
 * (nothing changed: not taken exactly), -1 (an error set). */
MW_INTERNAL int mw_stage_block_ids(PyObject *staging, PyObject *req, PyObject *groups, int overwrite, int flags);
/* The three parameters of a vectorcall (the first named `first`, then new_block_ids, overwrite) into params; 0 when
 * they do not bind. */
MW_INTERNAL int mw_bind_params(PyObject *const *args, size_t nargsf, PyObject *kwnames, const char *first,
                               PyObject **params);
/* fn(self, *args, **kwargs) of a vectorcall. */
MW_INTERNAL PyObject *mw_call_fallback(PyObject *fn, PyObject *self, PyObject *const *args, size_t nargsf,
                                       PyObject *kwnames);

/* ---- VllmStaging (_cstaging_vllm.c) --------------------------------------------------------------------- */

MW_INTERNAL extern PyTypeObject mw_VllmStagingType;

/* ---- FastLaunch (_cstaging_launch.c) -------------------------------------------------------------------- */

MW_INTERNAL extern PyTypeObject mw_FastLaunchType;

/* ---- DriverLaunch (_cstaging_driver.c) ------------------------------------------------------------------ */

MW_INTERNAL extern PyTypeObject mw_DriverLaunchType;
/* A DriverLaunch `fire` launching (grid0, grid1) on `stream` with the `n` ints `values` (one per entry of its args):
 * 1 (launched, or an empty grid: nothing to launch), 0 (not taken, nothing launched: a count or value outside what
 * it passes, or the driver refused; the caller calls fire with these arguments as Python ints). No error is set. */
MW_INTERNAL int mw_driver_launch(PyObject *fire, long long grid0, long long grid1, long long stream,
                                 const long long *values, Py_ssize_t n);
/* A DriverLaunch's fallback (borrowed): where a launch it did not take goes. */
MW_INTERNAL PyObject *mw_driver_fallback(PyObject *fire);

/* ---- StageEntry (_cstaging_stage.c) --------------------------------------------------------------------- */

MW_INTERNAL extern PyTypeObject mw_StageEntryType;

/* ---- Countdown (_cstaging.c) ---------------------------------------------------------------------------- */

/* Its truth test is false while `left > 1` (and counts one down), then true until restart() sets left = period. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t period;
    Py_ssize_t left;
} mw_Countdown;

MW_INTERNAL extern PyTypeObject mw_CountdownType;

/* ---- HeaderRingFields (_cstaging_headers.c) ------------------------------------------------------------- */

/* The layout every reader of the header ring shares (staging/headers.py exports these; the Triton consume kernel
 * reads them from there). An entry: HEADER_WORDS int64 words, then an inline batch (INLINE_WRITES x 5 int32
 * metadata columns, then INLINE_VALUES int32 values). */
#define HEADER_WORDS 8 /* SEQ, META, VALUES, BOUNDS, DONE, TOKEN, COUNTS, NUM_VALUES */
#define INLINE_WRITES 256
#define INLINE_VALUES 1024
#define ENTRY_WORDS (HEADER_WORDS + (INLINE_WRITES * 5 + INLINE_VALUES) / 2)
#define INLINE_FLAG INT64_MIN /* the sign bit of COUNTS: the batch is in the entry */
/* Words of the device's counts the kernel stores into the pinned mirror (staging/headers.py: M_APPLIED ...): headers
 * applied, captured runs, idle runs, re-reads, runs that found their ticket unpublished (MISSED) and the last such
 * run, tickets an eager run found without a run (EXTRA) and the first of the last such find. */
#define MIRROR_WORDS 8
#define M_APPLIED 0
#define M_RUNS 1
#define M_MISSED 4
#define M_EXTRA 6

MW_INTERNAL extern PyTypeObject mw_HeaderRingFieldsType;

/* HeaderRingFields.commit(arena, ticketed) of `ring`: `publish` in its common case, checked first (no overlapping
 * writes, a batch that travels inline or none, a free header entry and ticket, no mis-pairing the device recorded that
 * the host has not reported); the header index, or None having changed nothing. Anything else (a report, rounds to
 * order, a wait, a batch that stays in its lease and needs the next one) is the caller's to prepare. With
 * `countdown`, a preamble's countdown (mw_Countdown.left) is counted down once the publish is taken. */
MW_INTERNAL PyObject *mw_ring_commit(PyObject *ring, ArenaFields *arena, int ticketed, Py_ssize_t *countdown);

/* ---- CommitEntry (_cstaging_commit.c) ------------------------------------------------------------------- */

MW_INTERNAL extern PyTypeObject mw_CommitEntryType;

#endif /* MULTIWRITE_STAGING_CSTAGING_H */

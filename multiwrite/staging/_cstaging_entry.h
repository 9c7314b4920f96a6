/*
 * multiwrite.staging._cstaging: what the three files of StageEntry share (_cstaging_entry.c: the type;
 * _cstaging_stage.c: its preamble, inputs and launch, gather and slots; _cstaging_prepare.c: the calls on the staged
 * batch, prepare_inputs and apply_staged_writes, with the ring slot's hand-over and the landing).
 */
#ifndef MW_CSTAGING_ENTRY_H
#define MW_CSTAGING_ENTRY_H

#include "_cstaging.h"
#include "_cstaging_grid.h"

/* The stage kernel's arguments before the step's (the staged batch's words, or the spec's head without one). */
#define LEAD_ARGS 12

typedef struct {
    PyObject_HEAD
    /* the preamble's: the mode (its dirty_rows), its countdown, the guards' bases (guard.base) and guards */
    PyObject *owner, *countdown, *storage, *guard, *outputs, *outputs_guard, *failure;
    /* the launch's (StageLaunchSpec) */
    PyObject *launcher, *fire, *get_device, *get_stream, *index_obj, *layout, *gathered_views, *slot_views;
    PyObject *tensor_type, *int32, *int64, *boolean, *cp_size, *cp_interleave, *head;
    /* the staged batch's (StageLaunchSpec.staged, None: prepare never takes a staged batch): the arena, its ring
     * (SlotRing) and that ring's lists of slot leases, successors and counter addresses, what a launch keeps alive,
     * the device's resolve(lease, token) after an interrupt, and torch's capture test of the current stream */
    PyObject *arena, *ring, *ring_leases, *ring_succ, *ring_counters, *keep, *resolve, *is_capturing;
    /* the apply kernel's (apply): its Launcher, that one's fire dict and the variant keys (values dtype, decode) */
    PyObject *apply_launcher, *apply_fire, *apply_keys[2];
    long long index, max_num_reqs, max_num_batched_tokens, groups, splits, fallback;
    /* the tilings (mw_apply_grid) of the stage kernel's apply programs and of the apply kernel, the programs in
     * flight at most, and the apply descriptors' address and tables */
    long long stage_tiling[5], apply_tiling[5], max_programs, desc_addr, num_tables;
    /* spec.head as ints (the stage kernel's arguments before the step's, no staged batch) */
    long long head_values[LEAD_ARGS];
    int window;
} StageEntry;

/* What the stage kernel reads of one input tensor. */
typedef struct {
    PyObject *dtype; /* borrowed: one of the spec's dtype objects */
    long long len, ptr;
} Vector;

/* Interned attribute names (mw_entry_names() binds them; 0, or -1 with an error set). */
MW_INTERNAL extern PyObject *mw_s_launches, *mw_s_gathered, *mw_s_slots;
MW_INTERNAL int mw_entry_names(void);

/* An int (a new reference, consumed) as a long long: 1 (into *out), 0 (not an int), -1 (error, or value NULL). */
MW_INTERNAL int mw_as_ll(PyObject *value, long long *out);
/* TablesMode.enter's common case: the address check not due (`countdown`, a Countdown) and the tables guard's
 * `storage` (and, unless `outputs` is NULL, the outputs') at the version its guard last checked: 1 (holds), 0 (not
 * taken), -1 (error). The interned names it reads must be bound (mw_entry_names). */
MW_INTERNAL int mw_preamble_holds(PyObject *countdown, PyObject *storage, PyObject *guard, PyObject *outputs,
                                  PyObject *outputs_guard);
/* The preamble's preconditions (TablesMode.enter's common case; `outputs`: the outputs' guard too): 1 (hold), 0 (not
 * taken), -1 (error). */
MW_INTERNAL int mw_entry_preamble(StageEntry *self, int outputs);
/* `t` an input as StepInputs.on_device accepts it (`flag`: torch.bool): 1 (into *v), 0 (not taken), -1 (error). */
MW_INTERNAL int mw_entry_vector(StageEntry *self, PyObject *t, int flag, Vector *v);
/* The raised Exception as failure(exc), raised from it; anything else as it is. */
MW_INTERNAL void mw_entry_failure(StageEntry *self);
/* owner.dirty_rows = rows, keeping a raised exception as it is. */
MW_INTERNAL void mw_entry_set_dirty(StageEntry *self, long long rows);
/* views[n] of a cache dict, else layout.<name>(n): a new reference or NULL. */
MW_INTERNAL PyObject *mw_cached_view(PyObject *views, PyObject *layout, PyObject *name, PyObject *n);

/* Around the fire call of a launch reading a staged batch (_cstaging_prepare.c): `before` right before it (0, or -1
 * with an error set: nothing launched), `after` once it returned (`launched` 1) or raised (0, the error set: `after`
 * resolves it and leaves an error set). */
typedef struct {
    int (*before)(void *ctx);
    void (*after)(void *ctx, int launched);
    void *ctx;
} LaunchHooks;

/* The stage kernel's launch of one step (TritonPlan._stage): the variant `key` bound to a fast launcher and the
 * tables' device current, else 0 (nothing done). Its arguments: `lead` (12 ints: the staged batch's words, NULL for
 * the spec's head, no batch), then the step's; `extra` programs past the stage's (the apply's). 1 (launched), 0, -1
 * (error set: failure's). A gather (`gather`) reads and moves the owner's dirty_rows. */
MW_INTERNAL int mw_entry_launch(StageEntry *self, PyObject *key, int gather, const long long *lead, long long extra,
                                const long long ptrs[5], long long n, long long padded, long long tokens,
                                const LaunchHooks *hooks);

/* Whether the current device is the tables': 1, 0 (another, or the query raised an Exception: not taken, the Python
 * path asks again where it asks, after its hand-over), -1 (an interrupt, as raised). */
MW_INTERNAL int mw_entry_current(StageEntry *self);
/* fire(grid0, grid1, stream, args) on the current stream of the tables' device, `args` the `n` ints `values` (a
 * DriverLaunch takes them as they are, without a Python object made), counted on `launcher`, the countdown counted,
 * `hooks` around it: 1, or -1 with the error as raised (not yet failure's). */
MW_INTERNAL int mw_entry_fire(StageEntry *self, PyObject *launcher, PyObject *fire, long long grid0, long long grid1,
                              const long long *values, Py_ssize_t n, const LaunchHooks *hooks);

/* gather(...) and slots(...), the methods (_cstaging_stage.c). */
MW_INTERNAL PyObject *mw_entry_gather(StageEntry *self, PyObject *const *args, Py_ssize_t nargs);
MW_INTERNAL PyObject *mw_entry_slots(StageEntry *self, PyObject *const *args, Py_ssize_t nargs);
/* prepare(...) and apply(), the methods (_cstaging_prepare.c). */
MW_INTERNAL PyObject *mw_entry_prepare(StageEntry *self, PyObject *const *args, Py_ssize_t nargs);
MW_INTERNAL PyObject *mw_entry_apply(StageEntry *self, PyObject *unused);
/* The staged batch's fields of `spec.staged` into got[0..STAGED_REFS) (new references, in the struct's order) and
 * its ints (STAGED_INTS, in the struct's order); 0, or -1 (error set, got holding what was read). */
MW_INTERNAL int mw_entry_read_staged(PyObject *spec, PyObject **got, long long *ints);
#define STAGED_REFS 12
#define STAGED_INTS 13

#endif

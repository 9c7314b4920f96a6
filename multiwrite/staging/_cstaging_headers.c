/*
 * multiwrite.staging._cstaging, part: HeaderRingFields, the base class of staging.headers.HeaderRing.
 *
 * Graph mode's ring of published batches: publish() writes one header entry (an inline copy of a small batch with
 * its checksum, or the addresses of the lease a bigger one stays in), then its sequence word and ticket, and clears
 * the arena; commit() is publish in its common case, or None having changed nothing. The entry's layout
 * (HEADER_WORDS, INLINE_WRITES, INLINE_VALUES, ENTRY_WORDS, INLINE_FLAG) is in _cstaging.h. Graph mode's publish has
 * no Python twin: without this module graph mode reports that it needs it.
 */
#include "_cstaging.h"

/* ---- HeaderRingFields: graph mode's published batches --------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_ssize_t depth;        /* entries of the header ring and of the ticket ring, a power of two */
    Py_ssize_t published;    /* headers published */
    Py_ssize_t tickets;      /* tickets published: commits meant for one replay each */
    Py_ssize_t headers_addr; /* int64 [depth, ENTRY_WORDS] */
    Py_ssize_t tickets_addr; /* int64 [depth]: (ticket + 1) << 32 | (header index & 0xFFFFFFFF) */
    Py_ssize_t mirror_addr;  /* int64 [MIRROR_WORDS] the device stores: headers applied, captured runs, ... */
    long long missed_seen;   /* the mirror's MISSED and EXTRA words as the host last reported them: a commit */
    long long extra_seen;    /* that finds them changed leaves the report (and the commit) to the caller */
} HeaderRingFields;

static PyMemberDef ring_members[] = {
    {"depth", T_PYSSIZET, offsetof(HeaderRingFields, depth), 0, "entries, a power of two"},
    {"published", T_PYSSIZET, offsetof(HeaderRingFields, published), READONLY, "headers published"},
    {"tickets_published", T_PYSSIZET, offsetof(HeaderRingFields, tickets), READONLY, "tickets published"},
    {"headers_addr", T_PYSSIZET, offsetof(HeaderRingFields, headers_addr), 0, "address of the headers"},
    {"tickets_addr", T_PYSSIZET, offsetof(HeaderRingFields, tickets_addr), 0, "address of the tickets"},
    {"mirror_addr", T_PYSSIZET, offsetof(HeaderRingFields, mirror_addr), 0, "address of the device's counts"},
    {"missed_seen", T_LONGLONG, offsetof(HeaderRingFields, missed_seen), 0,
     "replays without a published ticket the host has reported"},
    {"extra_seen", T_LONGLONG, offsetof(HeaderRingFields, extra_seen), 0,
     "tickets without a replay (found by eager runs) the host has reported"},
    {NULL},
};

/* publish(arena, next_lease, ticketed, num_rounds) -> header index. The caller has checked that the entry (and
 * the ticket) are free and, for a batch that stays in its lease, that `next_lease` is released and large
 * enough. Inline batches (one round, at most INLINE_WRITES writes and INLINE_VALUES values) are copied into the
 * entry with a checksum and the arena keeps its lease; a bigger one stays in the arena's lease (its completion
 * word and the next token in the header) and the arena adopts `next_lease`. Last, the sequence word (and the
 * ticket) publish it; then the arena is cleared. One step: nothing in between can be interrupted. */
static PyObject *publish_c(HeaderRingFields *self, ArenaFields *arena, PyObject *next, int ticketed, long long rounds);

static PyObject *ring_publish(HeaderRingFields *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyObject_TypeCheck(args[0], &mw_ArenaFieldsType) ||
        !(args[1] == Py_None || PyObject_TypeCheck(args[1], &mw_LeaseFieldsType)))
        return mw_usage_error("publish(arena, next_lease, ticketed, num_rounds)");
    int ticketed = PyObject_IsTrue(args[2]);
    long long rounds = PyLong_AsLongLong(args[3]);
    if (ticketed < 0 || (rounds == -1 && PyErr_Occurred()))
        return NULL;
    return publish_c(self, (ArenaFields *)args[0], args[1], ticketed, rounds);
}

/* commit(arena, ticketed) -> header index, or None having changed nothing: mw_ring_commit (_cstaging.h). */
PyObject *mw_ring_commit(PyObject *ring, ArenaFields *arena, int ticketed, Py_ssize_t *countdown) {
    HeaderRingFields *self = (HeaderRingFields *)ring;
    const Py_ssize_t w = arena->num_writes;
    if (arena->may_overlap || w > INLINE_WRITES || arena->num_values > INLINE_VALUES || self->mirror_addr == 0 ||
        self->depth <= 0)
        Py_RETURN_NONE;
    const volatile int64_t *mirror = (const volatile int64_t *)(intptr_t)self->mirror_addr;
    if (mirror[M_MISSED] != self->missed_seen || mirror[M_EXTRA] != self->extra_seen) /* a mis-pairing to report */
        Py_RETURN_NONE;
    if (mirror[M_APPLIED] < (int64_t)self->published - self->depth + 1) /* the entry holds a header not applied */
        Py_RETURN_NONE;
    if (ticketed) {
        const int64_t runs = mirror[M_RUNS];
        const int64_t t = self->tickets > runs ? self->tickets : runs;
        if (runs < t - self->depth + 1) /* the ticket's word holds a ticket whose replay has not run */
            Py_RETURN_NONE;
    }
    if (countdown != NULL)
        *countdown -= 1; /* (the preamble's truth test: false, as its caller found) */
    return publish_c(self, arena, Py_None, ticketed, 1);
}

static PyObject *ring_commit(HeaderRingFields *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyObject_TypeCheck(args[0], &mw_ArenaFieldsType))
        return mw_usage_error("commit(arena, ticketed)");
    const int ticketed = PyObject_IsTrue(args[1]); /* (as `publish` reads it) */
    if (ticketed < 0)
        return NULL;
    return mw_ring_commit((PyObject *)self, (ArenaFields *)args[0], ticketed, NULL);
}

static PyObject *publish_c(HeaderRingFields *self, ArenaFields *arena, PyObject *next, int ticketed, long long rounds) {
    if (self->headers_addr == 0 || self->tickets_addr == 0 || self->depth <= 0 || (self->depth & (self->depth - 1))) {
        PyErr_SetString(PyExc_RuntimeError, "publish: the header ring is not bound");
        return NULL;
    }
    const Py_ssize_t h = self->published, w = arena->num_writes, nv = arena->num_values;
    const int inline_batch = w > 0 && rounds == 1 && w <= INLINE_WRITES && nv <= INLINE_VALUES;
    LeaseFields *lease = PyObject_TypeCheck(arena->lease, &mw_LeaseFieldsType) ? (LeaseFields *)arena->lease : NULL;
    if (w && !inline_batch && (next == Py_None || lease == NULL)) {
        PyErr_SetString(PyExc_ValueError, "publish: a batch that stays in its lease needs the next lease");
        return NULL;
    }
    if (rounds < 1 || rounds > 0x7FFFFFFF || (rounds > 1 && (lease == NULL || lease->bounds_addr == 0 || w == 0))) {
        PyErr_SetString(PyExc_ValueError, "publish: num_rounds must be >= 1 (and > 1 only with round bounds)");
        return NULL;
    }
    int64_t *hv = (int64_t *)(intptr_t)self->headers_addr + (h % self->depth) * ENTRY_WORDS;
    if (inline_batch) {
        /* The metadata as five columns of INLINE_WRITES cells, then the values; the token word holds their
         * checksum: each int32 times its position in the entry's batch area, plus one. */
        int32_t *batch = (int32_t *)(hv + HEADER_WORDS);
        const int32_t *meta = (const int32_t *)(intptr_t)arena->meta_addr;
        const int32_t *values = (const int32_t *)(intptr_t)arena->values_addr;
        int64_t checksum = 0;
        for (Py_ssize_t c = 0; c < 5; c++)
            for (Py_ssize_t j = 0; j < w; j++) {
                const int32_t x = meta[j * 5 + c];
                batch[c * INLINE_WRITES + j] = x;
                checksum += (int64_t)x * (c * INLINE_WRITES + j + 1);
            }
        for (Py_ssize_t k = 0; k < nv; k++) {
            batch[INLINE_WRITES * 5 + k] = values[k];
            checksum += (int64_t)values[k] * (INLINE_WRITES * 5 + k + 1);
        }
        hv[1] = hv[2] = hv[3] = hv[4] = 0;
        hv[5] = checksum;
        hv[6] = (int64_t)w | (int64_t)1 << 32 | INLINE_FLAG;
        hv[7] = nv;
    } else if (w) {
        lease->token = lease->token % 0x7FFFFFFF + 1;
        hv[1] = arena->meta_addr;
        hv[2] = arena->values_addr;
        hv[3] = lease->bounds_addr;
        hv[4] = lease->done_addr;
        hv[5] = lease->token;
        hv[6] = (int64_t)w | (int64_t)rounds << 32;
        hv[7] = nv;
    } else {
        hv[4] = 0;
        hv[6] = 0;
        hv[7] = 0;
    }
    /* Last: the sequence word publishes the header; then the ticket names it. */
    __atomic_store_n(&hv[0], (int64_t)h + 1, __ATOMIC_RELEASE);
    if (ticketed) {
        /* The ticket of the next replay: never behind the replays already run (one replayed without a commit has
         * used up its ticket; the next commit belongs to the replay after it). */
        int64_t *tv = (int64_t *)(intptr_t)self->tickets_addr;
        const int64_t runs = self->mirror_addr ? ((volatile int64_t *)(intptr_t)self->mirror_addr)[M_RUNS] : 0;
        const int64_t t = self->tickets > runs ? self->tickets : runs;
        __atomic_store_n(&tv[t % self->depth], (int64_t)((t + 1) & 0x7FFFFFFF) << 32 | ((int64_t)h & 0xFFFFFFFF),
                         __ATOMIC_RELEASE);
        self->tickets = t + 1;
    }
    self->published = h + 1;
    if (w && !inline_batch)
        mw_arena_adopt(arena, (LeaseFields *)next);
    if (mw_arena_clear(arena) < 0)
        return NULL;
    return PyLong_FromSsize_t(h);
}

static PyMethodDef ring_methods[] = {
    {"publish", (PyCFunction)(void (*)(void))ring_publish, METH_FASTCALL,
     "publish(arena, next_lease, ticketed, num_rounds) -> header index: publish the arena's staged batch."},
    {"commit", (PyCFunction)(void (*)(void))ring_commit, METH_FASTCALL,
     "commit(arena, ticketed) -> header index or None: publish in its common case, or None having changed nothing."},
    {NULL},
};

PyTypeObject mw_HeaderRingFieldsType = {
    MW_TYPE_HEAD("HeaderRingFields", HeaderRingFields, ring, 0,
                 "Graph mode's header ring as C fields, and its publish (base of staging.headers.HeaderRing)."),
    .tp_new = PyType_GenericNew,
};

"""CUDA-graph mode of `BlockTables` (`cuda_graphs=True`): the consume kernel and its pinned header ring.

Why a header ring. A captured launch replays with the arguments it was captured with, so the kernel
cannot be told per step where that step's writes are; and it cannot simply read "whatever is staged"
either: a replay runs asynchronously, long after `graph.replay()` returned, while the host is already
staging the next step into the arena. So the host closes each step's batch with ONE host call,
`BlockTables.commit_staged_writes()`, which writes a header into the next entry of a pinned header ring.
A decode-sized batch (one round, at most `FEW_WRITES` writes and `PRELOADED_VALUES` values: every decode step
of the real trace at C=40 and C=256) is copied INTO the entry, after the header words, and the arena keeps
its slot. A bigger one (a prefill) stays in the pinned ring slot it was staged into: the header says where
its metadata and values sit, with the slot's completion word and token, and the arena rotates to a fresh
slot. No launch, no driver call: host work per step is staging plus writing that entry.

Which headers a run consumes. The captured kernel keeps a device-side count of consumed headers and, per
run, applies exactly ONE header: the next one, if the host has published it (its sequence word says so),
else nothing. One header per replay is what makes replays exact when the host runs ahead of the device
(the normal pipelined case): if a replay applied every header published when it RUNS, a replay queued
behind a busy stream would also apply the writes the host committed for the NEXT step meanwhile (e.g. a
freed row already overwritten by a new request) before the step it belongs to reads the tables. Hence
the rule: commit once before each replay (an empty commit publishes an empty header, so a replay then
applies nothing and the count stays in step). An eager `apply_staged_writes()` (e.g. a prefill run outside
the graph) commits and launches the same kernel with an explicit limit: it applies every header committed
so far, in order; a later replay finding no new header does nothing.

The slot guard stays exact: the kernel stores each consumed header's token into the completion word of
the ring slot a batch was left in (the lent ring of `triton_kernel`), so the host reuses a slot only once
the batch in it has been applied; and the host rewrites a header entry only once the device's consumed count
(a pinned word the kernel stores after its last read of the entry) has passed it. A commit that finds the
ring full of committed batches no run has consumed yet (all `depth` entries, or for a batch left in its
slot, the next slot) waits, warns (`RingWaitWarning`, saying that a replay or an
eager apply is needed), and after the writer's timeout synchronizes the device and raises `RingStallError`.

The kernel is one program (writes of one header in parallel lanes, headers and overlap rounds one after
the other, separated by barriers). It reads its consumed count from device memory, then the whole entry of
the next header over unified virtual addressing. Every dependent load from host memory waits for a round
trip over PCIe, about 1.5 us on the H200 for a wide load, 4 us for a one-word volatile load replicated over
the program's threads (`benchmarks/h200-2026-12-01b/uva-latency.txt`), so an inline batch costs ONE round
trip: count -> entry -> stores. A decode-sized batch in a ring slot loads its metadata and values together
(both addresses are in the header): two round trips; this module's commits put every such batch inline, but the
kernel takes any header. Bigger batches and batches with several rounds go tile by tile (16 writes a tile, one
round trip each). It finds each write's
table through a descriptor table built once: a graph-mode `BlockTables` can never replace or resize its
tables, so the descriptors' address is fixed for good.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import numpy as np
import torch
import triton
import triton.language as tl
from multiwrite.backends.triton_kernel import (
    _INTERPRETER_LOCK,
    DESC_COLUMNS,
    INTERPRETED,
    RingStallError,
    RingWaitWarning,
    TritonWriter,
    _LentRing,
    overlap_rounds,
)
from multiwrite.backends.triton_stage import _descriptor_table, launch_stage

from multiwrite.errors import BackendUnavailableError
from multiwrite.stage import StageInputs
from multiwrite.staging import StagingArena

#: int64 words of a header: (sequence, meta address, values address, bounds address, completion word address,
#: token, num_writes | num_rounds << 32 | INLINE, num_values). Sequence `h + 1` publishes header `h`. The counts
#: word: num_writes in bits 0-31, num_rounds in bits 32-62 (rounds <= writes: any batch's round count fits), the
#: INLINE flag in bit 63 (the sign bit): a flag inside the rounds' bits would turn a batch of 65,536 rounds into
#: an "inline" one of 0 rounds, which a run would drop.
HEADER_WORDS: tl.constexpr = tl.constexpr(8)
(H_SEQ, H_META, H_VALUES, H_BOUNDS, H_DONE, H_TOKEN, H_COUNTS, H_NUM_VALUES) = range(8)
(H_SEQ_WORD, H_META_WORD, H_VALUES_WORD, H_BOUNDS_WORD, H_DONE_WORD, H_TOKEN_WORD, H_COUNTS_WORD,
 H_NUM_VALUES_WORD) = (tl.constexpr(i) for i in range(8))  # (the same, for the kernel)  # fmt: skip
#: Values of at most this many cells (a decode step) are loaded whole, with the metadata.
PRELOADED_VALUES: tl.constexpr = tl.constexpr(256)
#: A batch of one round with at most this many writes (and at most PRELOADED_VALUES values: a decode step, e.g.
#: 85 writes (median; at most 129) at C=256 on G3) has all its metadata loaded at once, with its values; its writes
#: are done FEW_CELLS cells at a time from registers (decode writes are 1-3 cells).
FEW_WRITES: tl.constexpr = tl.constexpr(256)
FEW_CELLS: tl.constexpr = tl.constexpr(4)
#: Such a batch without overlapping writes is committed INLINE: its metadata (int32 [num_writes, 5]) is copied
#: into the header's entry as five columns of FEW_WRITES cells (table, row, start, length, value offset; each
#: column one contiguous load), then its values at int32 offset INLINE_META, after the header words; the header's
#: token word holds `inline_checksum` of them. The kernel gets header and batch in one round trip and never reads
#: the ring slot (which the arena keeps).
INLINE_META: tl.constexpr = tl.constexpr(FEW_WRITES * 5)
#: Bit 63 of the H_COUNTS word, as the int64 a store into the pinned ring takes (`-(1 << 63)`).
INLINE_BIT = 63
INLINE = -(1 << INLINE_BIT)
#: int64 words of one entry of the header ring: the header, then the inline batch.
ENTRY_WORDS: tl.constexpr = tl.constexpr(8 + (FEW_WRITES * 5 + PRELOADED_VALUES) // 2)


@triton.jit
def _inline_batch(batch, lanes_f, lanes_v):
    """The inline batch of an entry (`batch`: int32 pointer to its area): its five metadata columns and its values,
    each one contiguous load."""
    t = tl.load(batch + lanes_f, cache_modifier=".cv")
    row = tl.load(batch + FEW_WRITES + lanes_f, cache_modifier=".cv")
    start = tl.load(batch + 2 * FEW_WRITES + lanes_f, cache_modifier=".cv")
    length = tl.load(batch + 3 * FEW_WRITES + lanes_f, cache_modifier=".cv")
    voff = tl.load(batch + 4 * FEW_WRITES + lanes_f, cache_modifier=".cv")
    values = tl.load(batch + INLINE_META + lanes_v, cache_modifier=".cv")
    return t, row, start, length, voff, values


@triton.jit
def _inline_checksum(t, row, start, length, voff, values, lanes_f, lanes_v, num_writes, num_values):
    """`inline_checksum` of an inline batch as loaded (int64): each live int32 of the entry's batch area times its
    position there plus one."""
    live = lanes_f < num_writes
    w = lanes_f.to(tl.int64) + 1
    cols = (t.to(tl.int64) * w + row.to(tl.int64) * (w + FEW_WRITES) + start.to(tl.int64) * (w + 2 * FEW_WRITES)
            + length.to(tl.int64) * (w + 3 * FEW_WRITES) + voff.to(tl.int64) * (w + 4 * FEW_WRITES))  # fmt: skip
    vals = values.to(tl.int64) * (lanes_v.to(tl.int64) + INLINE_META + 1)
    # (one reduction: FEW_WRITES == PRELOADED_VALUES, asserted at import)
    return tl.sum(tl.where(live, cols, 0) + tl.where(lanes_v < num_values, vals, 0), axis=0)


assert FEW_WRITES.value == PRELOADED_VALUES.value  # `_inline_checksum` sums both in one reduction


def inline_checksum(meta: np.ndarray, values: np.ndarray) -> int:
    """The checksum of an inline batch (`meta` int32 [w, 5] in staging layout, `values` int32 [v]) the commit
    stores in the header's token word: the sum of each int32 of the entry's batch area times its position there
    (columns of FEW_WRITES cells, then the values) plus one, exact in int64. The kernel recomputes it from what it
    loaded; a mismatch means the entry was being written while it was read."""
    w = meta.shape[0]
    pos = np.arange(5, dtype=np.int64)[None, :] * FEW_WRITES.value + np.arange(w, dtype=np.int64)[:, None] + 1
    vpos = np.arange(values.shape[0], dtype=np.int64) + INLINE_META.value + 1
    return int((meta.astype(np.int64) * pos).sum() + (values.astype(np.int64) * vpos).sum())
DO_NOT_SPECIALIZE = ("desc_addr", "headers_addr", "state_addr", "mirror_addr", "limit", "num_tables")
BLOCK_W, BLOCK_L, NUM_WARPS = 16, 64, 4


def _consume_kernel_fn(
    desc_addr: tl.int64,  # device int64 [num_tables, 5]: base address, row stride, column stride, rows, columns
    headers_addr: tl.int64,  # pinned int64 [DEPTH, ENTRY_WORDS]
    state_addr: tl.int64,  # device int64 [3]: headers consumed, runs that found no header, inline batches re-read
    mirror_addr: tl.int64,  # pinned int64 [3]: the same three counts, for the host
    limit: tl.int64,  # consume headers up to this count (eager launch), or -1: the next header only (captured)
    num_tables: tl.int32,
    DEPTH: tl.constexpr,  # header ring entries, a power of two
    NT: tl.constexpr,  # a power of two >= num_tables: every descriptor is loaded up front
    BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,  # let a programmatic dependent launch (the captured stage kernel) start now
):
    """Apply the published, unconsumed headers' batches in order (see the module docstring)."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    desc = desc_addr.to(tl.pointer_type(tl.int64))
    headers = headers_addr.to(tl.pointer_type(tl.int64))
    state = state_addr.to(tl.pointer_type(tl.int64))
    mirror = mirror_addr.to(tl.pointer_type(tl.int64))
    lanes_t = tl.arange(0, NT)
    t_ok = lanes_t < num_tables
    d_all = desc + lanes_t.to(tl.int64) * 5
    base_all = tl.load(d_all + 0, mask=t_ok, other=0)
    row_stride_all = tl.load(d_all + 1, mask=t_ok, other=0)
    col_stride_all = tl.load(d_all + 2, mask=t_ok, other=0)
    rows_all = tl.load(d_all + 3, mask=t_ok, other=0)
    cols_all = tl.load(d_all + 4, mask=t_ok, other=0)
    lanes_h = tl.arange(0, HEADER_WORDS)
    lanes_w = tl.arange(0, BLOCK_W)
    lanes_l = tl.arange(0, BLOCK_L)
    lanes_v = tl.arange(0, PRELOADED_VALUES)
    lanes_f = tl.arange(0, FEW_WRITES)
    lanes_c = tl.arange(0, FEW_CELLS)
    first = tl.load(state)
    idle = tl.load(state + 1)
    rereads = tl.load(state + 2)
    end = tl.where(limit < 0, first + 1, limit)
    ok = first < end
    n = first * 0
    for h in range(first, end):
        # Header h's entry: its words and the inline batch a decode-sized commit copied into it (metadata as five
        # contiguous columns, then the values), all in ONE set of loads (one round trip over PCIe), issued once
        # the consumed count (device memory) is known. Plain loads: a run reads only entries published before it
        # was issued (each replay consumes the header committed before it), and a new launch reads host memory
        # afresh, as for ring slots. A header committed while this run reads it (a replay issued before its
        # commit) could be read half old, half new: the inline batch's checksum catches that (below).
        entry = headers + (h % DEPTH) * ENTRY_WORDS
        # The header words as one 8-lane load (a scalar load per word measured 1.2 us slower on the H200), picked
        # out by reductions that stay within a warp.
        head = tl.load(entry + lanes_h, cache_modifier=".cv")
        seq = tl.sum(tl.where(lanes_h == H_SEQ_WORD, head, 0), axis=0)
        meta_word = tl.sum(tl.where(lanes_h == H_META_WORD, head, 0), axis=0)
        values_word = tl.sum(tl.where(lanes_h == H_VALUES_WORD, head, 0), axis=0)
        bounds_word = tl.sum(tl.where(lanes_h == H_BOUNDS_WORD, head, 0), axis=0)
        done_word = tl.sum(tl.where(lanes_h == H_DONE_WORD, head, 0), axis=0)
        token_word = tl.sum(tl.where(lanes_h == H_TOKEN_WORD, head, 0), axis=0)
        counts = tl.sum(tl.where(lanes_h == H_COUNTS_WORD, head, 0), axis=0)
        num_values = tl.sum(tl.where(lanes_h == H_NUM_VALUES_WORD, head, 0), axis=0).to(tl.int32)
        batch = (entry + HEADER_WORDS).to(tl.pointer_type(tl.int32))
        i_t, i_row, i_start, i_length, i_voff, i_values = _inline_batch(batch, lanes_f, lanes_v)
        ok = ok & (seq == h + 1)
        if ok:
            meta = meta_word.to(tl.pointer_type(tl.int32))
            values = values_word.to(tl.pointer_type(tl.int32))
            bounds = bounds_word.to(tl.pointer_type(tl.int32))
            token = token_word.to(tl.int32)
            num_writes = (counts & 0xFFFFFFFF).to(tl.int32)
            num_rounds = ((counts >> 32) & 0x7FFFFFFF).to(tl.int32)
            inline = counts < 0  # the INLINE flag is the sign bit
            multi = num_rounds > 1
            small = num_values <= PRELOADED_VALUES
            if inline:
                # The batch as read must be the one the header describes (see `inline_checksum`); if it is not
                # (the host was writing the entry), read it again, now ordered after the sequence word: the host
                # writes the batch before it publishes the header, so that read needs no second check. The
                # header words themselves are one 64-byte line of the entry, read as one snapshot.
                if _inline_checksum(i_t, i_row, i_start, i_length, i_voff, i_values, lanes_f, lanes_v, num_writes,
                                    num_values) != token_word:  # fmt: skip
                    rereads += 1
                    again = batch + (seq - seq).to(tl.int32)  # an address that exists only once `seq` has arrived
                    i_t, i_row, i_start, i_length, i_voff, i_values = _inline_batch(again, lanes_f, lanes_v)
            # A decode-sized batch (one round, few writes, few values): ALL its metadata at once, with its values,
            # and its writes done from registers. Inline (the common case), both came with the header; else both
            # are loaded from the ring slot together (both addresses come from the header: one more round trip).
            # Anything else: the rounds and tiles below.
            few = small & (num_rounds == 1) & (num_writes <= FEW_WRITES)
            f_live = lanes_f < num_writes * few.to(tl.int32)  # (a scalar mask factor trips the interpreter)
            from_slot = f_live & (lanes_f < num_writes * (1 - inline.to(tl.int32)))
            f_meta = meta + lanes_f * 5
            f_t = tl.where(inline, i_t, tl.load(f_meta + 0, mask=from_slot, other=-1, cache_modifier=".cv"))
            f_row = tl.where(inline, i_row, tl.load(f_meta + 1, mask=from_slot, other=-1, cache_modifier=".cv"))
            f_start = tl.where(inline, i_start, tl.load(f_meta + 2, mask=from_slot, other=-1, cache_modifier=".cv"))
            f_length = tl.where(inline, i_length, tl.load(f_meta + 3, mask=from_slot, other=0, cache_modifier=".cv"))
            f_voff = tl.where(inline, i_voff, tl.load(f_meta + 4, mask=from_slot, other=0, cache_modifier=".cv"))
            preload = num_values * small.to(tl.int32) * (1 - inline.to(tl.int32))
            values_all = tl.load(values + lanes_v, mask=lanes_v < preload, other=0, cache_modifier=".cv")
            values_all = tl.where(inline, i_values, values_all)
            if few:
                live = f_live & (f_t >= 0) & (f_t < num_tables) & (f_row >= 0) & (f_start >= 0) & (f_length > 0)
                pick = f_t[:, None] == lanes_t[None, :]
                base = tl.sum(tl.where(pick, base_all[None, :], 0), axis=1)
                row_stride = tl.sum(tl.where(pick, row_stride_all[None, :], 0), axis=1)
                col_stride = tl.sum(tl.where(pick, col_stride_all[None, :], 0), axis=1)
                rows = tl.sum(tl.where(pick, rows_all[None, :], 0), axis=1)
                cols = tl.sum(tl.where(pick, cols_all[None, :], 0), axis=1)
                live = live & (f_row.to(tl.int64) < rows)
                cells = tl.where(live, f_length, 0)
                dst = base.to(tl.pointer_type(tl.int32)) + f_row.to(tl.int64) * row_stride
                max_cells = tl.max(cells, axis=0)
                for c0 in range(0, max_cells, FEW_CELLS):
                    pos = c0 + lanes_c
                    col = f_start[:, None].to(tl.int64) + pos[None, :]
                    vidx = f_voff[:, None] + pos[None, :]
                    keep = (pos[None, :] < cells[:, None]) & (col < cols[:, None]) & (vidx < num_values)
                    flat = tl.reshape(tl.where(keep, vidx, 0), [FEW_WRITES * FEW_CELLS])
                    v = tl.reshape(tl.gather(values_all, flat, 0), [FEW_WRITES, FEW_CELLS])
                    tl.store(dst[:, None] + col * col_stride[:, None], v, mask=keep)
                tl.debug_barrier()  # this header's writes land before the next header's
            for r in range(0, num_rounds * (1 - few.to(tl.int32))):
                w_begin = tl.load(bounds + r, mask=multi, other=0, cache_modifier=".cv")
                w_end = tl.load(bounds + r + 1, mask=multi, other=num_writes, cache_modifier=".cv")
                for w0 in range(w_begin, w_end, BLOCK_W):
                    w = w0 + lanes_w
                    live = w < w_end
                    m = meta + w * 5
                    t = tl.load(m + 0, mask=live, other=-1, cache_modifier=".cv")
                    row = tl.load(m + 1, mask=live, other=-1, cache_modifier=".cv")
                    start = tl.load(m + 2, mask=live, other=-1, cache_modifier=".cv")
                    length = tl.load(m + 3, mask=live, other=0, cache_modifier=".cv")
                    voff = tl.load(m + 4, mask=live, other=0, cache_modifier=".cv")
                    live = live & (t >= 0) & (t < num_tables) & (row >= 0) & (start >= 0) & (length > 0)
                    pick = t[:, None] == lanes_t[None, :]
                    base = tl.sum(tl.where(pick, base_all[None, :], 0), axis=1)
                    row_stride = tl.sum(tl.where(pick, row_stride_all[None, :], 0), axis=1)
                    col_stride = tl.sum(tl.where(pick, col_stride_all[None, :], 0), axis=1)
                    rows = tl.sum(tl.where(pick, rows_all[None, :], 0), axis=1)
                    cols = tl.sum(tl.where(pick, cols_all[None, :], 0), axis=1)
                    live = live & (row.to(tl.int64) < rows)
                    cells = tl.where(live, length, 0)
                    dst = base.to(tl.pointer_type(tl.int32)) + row.to(tl.int64) * row_stride
                    max_cells = tl.max(cells, axis=0)
                    for c0 in range(0, max_cells, BLOCK_L):
                        pos = c0 + lanes_l
                        col = start[:, None].to(tl.int64) + pos[None, :]
                        vidx = voff[:, None] + pos[None, :]
                        keep = (pos[None, :] < cells[:, None]) & (col < cols[:, None]) & (vidx < num_values)
                        if small:
                            flat = tl.reshape(tl.where(keep, vidx, 0), [BLOCK_W * BLOCK_L])
                            v = tl.reshape(tl.gather(values_all, flat, 0), [BLOCK_W, BLOCK_L])
                        else:
                            v = tl.load(values + vidx, mask=keep, other=0, cache_modifier=".cv")
                        tl.store(dst[:, None] + col * col_stride[:, None], v, mask=keep)
                tl.debug_barrier()  # round r's (and this header's) writes land before the next ones
            # Every load of the batch's slot is done: hand the slot back to the host.
            tl.store(done_word.to(tl.pointer_type(tl.int32)), token, mask=done_word != 0, cache_modifier=".wt")
        n += ok.to(tl.int64)
    tl.debug_barrier()
    consumed = first + n
    idle = idle + ((limit < 0) & (n == 0)).to(tl.int64)
    tl.store(state, consumed)
    tl.store(state + 1, idle)
    tl.store(state + 2, rereads)
    tl.store(mirror, consumed, cache_modifier=".wt")
    tl.store(mirror + 1, idle, cache_modifier=".wt")
    tl.store(mirror + 2, rereads, cache_modifier=".wt")


#: The runtime kernel (an `InterpretedFunction` under TRITON_INTERPRET, like the apply kernel).
_consume_kernel = triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)(_consume_kernel_fn)


def compilable_consume_kernel() -> triton.runtime.JITFunction:
    """The consume kernel as a `JITFunction`, even under the interpreter (for `triton.compile` tests)."""
    if not INTERPRETED:
        return _consume_kernel
    return triton.runtime.JITFunction(_consume_kernel_fn, do_not_specialize=DO_NOT_SPECIALIZE)


_NO_GUARD = contextlib.nullcontext()


def _c_layout() -> bool:
    """Whether the built `multiwrite._cstaging` lays out header entries as this module does (an extension built
    from an older source falls back to the Python commit)."""
    try:
        from multiwrite import _cstaging
    except ImportError:
        return False
    layout = (ENTRY_WORDS.value, FEW_WRITES.value, PRELOADED_VALUES.value, INLINE_BIT)
    return layout == tuple(getattr(_cstaging, n, None) for n in ("GRAPH_ENTRY_WORDS", "GRAPH_INLINE_WRITES",
                                                                "GRAPH_INLINE_VALUES", "GRAPH_INLINE_BIT"))  # fmt: skip


_C_LAYOUT = _c_layout()


def _pdl_capable(writer: TritonWriter) -> bool:
    """Whether the captured stage kernel may be a programmatic dependent launch of the consume kernel: compiled
    code (not the interpreter) for an NVIDIA GPU of compute capability 9.0 or newer (`griddepcontrol`, PTX ISA 7.8),
    with a Triton that has `gdc_wait` and the `launch_pdl` option (3.4 and newer)."""
    if INTERPRETED or not writer.is_gpu or torch.version.hip is not None:
        return False
    if not hasattr(tl.extra.cuda, "gdc_wait"):  # pragma: no cover - Triton < 3.4
        return False
    return torch.cuda.get_device_capability(writer._index) >= (9, 0)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class CapturedStage:
    """What one capture of a graph-mode stage call recorded; kept alive by its `GraphStage` (so by the
    `BlockTables`, which must outlive its graphs).

    `launch()` is exactly what the capture recorded and what every replay runs: with `consume` (a captured
    `prepare_inputs`), the consume kernel for the next committed batch (`GraphStage.launch(-1)`), then ONE
    launch of the stage kernel (`triton_stage.launch_stage`: gather and/or slot mappings) with the
    `GraphStage`'s own stage descriptors and scratch buffer. After the consume kernel, on an sm_90+ GPU
    (`GraphStage.pdl`), the stage kernel is a programmatic dependent launch: its programs start while the
    consume kernel runs, read the step's inputs, and wait (`griddepcontrol.wait`) only before reading the tables.
    Every argument of both launches is fixed: addresses of the tables, the persistent outputs, and the step's
    input tensors given at capture (their VALUES are read when the launch runs: the engine's persistent input
    buffers), plus `num_reqs`, `num_reqs_padded`, `num_tokens_padded` and the input lengths, fixed at capture.

    Attributes:
        graph: the `GraphStage`.
        stage: the `StageInputs` of the capture (holds the input tensors, so their memory stays valid).
        consume: whether the launch first consumes the next committed batch.
    """

    __slots__ = ("graph", "stage", "consume")

    def __init__(self, graph: GraphStage, stage: StageInputs, consume: bool):
        self.graph = graph
        self.stage = stage
        self.consume = consume

    def launch(self) -> None:
        """The recorded launches, on the current stream (what a replay runs)."""
        graph = self.graph
        if self.consume:
            graph.launch(-1)
        with graph.device_guard():
            pdl = self.consume and graph.pdl
            launch_stage(self.stage, desc=graph.stage_desc, scratch=graph.stage_scratch, pdl=pdl)


class GraphStage:
    """The graph-mode apply of one `BlockTables`: its header ring, fixed descriptors and the consume kernel.

    `commit` has a compiled twin for its common case (`multiwrite._cstaging.commit_graph`, `C_COMMIT`), which
    writes the same header words and hands the arena the same next slot.

    Args:
        writer: the `TritonWriter` of the tables' device (its wait timeouts, kernel slot guard).
        tables: the 2-D int32 tables of the `BlockTables`, in its arena's table order (fixed for good).
        lender: the arena's lent ring (`TritonWriter.lend`); the header ring has its depth rounded up to a
            power of two entries.

    Attributes:
        published: headers committed so far (host count).
        consumed: headers the device has consumed, as last stored into a pinned word (may lag).
        idle_runs: captured runs (replays) that found no new header (as last stored).
        rereads: inline batches read again because what was read did not match the header's checksum (the host
            was writing the entry while a run read it: a replay issued before its commit); as last stored.
        pdl: whether captures launch the stage kernel as a programmatic dependent launch of the consume kernel
            (NVIDIA, compute capability 9.0 or newer, compiled Triton). Read at each capture: setting it to False
            before a capture records the stage kernel as a plain launch (for A/B measurements). The consume
            kernel built with it true always lets a dependent launch start early, which a plain launch after it
            ignores.

    Raises:
        BackendUnavailableError: the writer guards its slots with CUDA events (`guard="event"`): a captured
            launch cannot record one, so graph mode needs the kernel guard; or its ring depth is below 2.
    """

    #: `BlockTables.commit_staged_writes` may use `multiwrite._cstaging.commit_graph` on this object (it writes
    #: the entries this module lays out: only where the built extension has the same layout).
    C_COMMIT = _C_LAYOUT

    def __init__(self, writer: TritonWriter, tables: list[torch.Tensor], lender: _LentRing):
        if not writer._kernel_guard:
            raise BackendUnavailableError(
                f"BlockTables(cuda_graphs=True) needs the Triton writer's kernel slot guard; this one uses "
                f"guard={writer.guard!r} (MULTIWRITE_TRITON_GUARD): a replayed kernel cannot record CUDA events"
            )
        self.writer = writer
        self.lender = lender
        self.ring = lender.ring
        lender.graph_stage = self  # marks the arena as graph-mode: plain writer applies refuse it
        if self.ring.depth < 2:
            raise BackendUnavailableError(
                f"BlockTables(cuda_graphs=True) needs a Triton ring depth of at least 2 "
                f"(MULTIWRITE_TRITON_RING_DEPTH), got {self.ring.depth}: a commit hands the arena the next slot"
            )
        # Header entries: a power of two >= the slots of the ring. Committed, unconsumed batches: at most `depth`
        # (entries), and at most `ring.depth - 1` of them left in ring slots.
        self.depth = depth = _pow2(self.ring.depth)
        pin = writer.is_gpu
        device = writer.device
        # Each entry's 8 header words sit in one 64-byte line, which a device read sees as one snapshot: the ring
        # starts on a 64-byte boundary (entries are a multiple of 64 bytes long).
        backing = torch.zeros(depth * ENTRY_WORDS.value + 8, dtype=torch.int64, pin_memory=pin)
        skip = (-backing.data_ptr() % 64) // 8
        self.headers_t = backing[skip : skip + depth * ENTRY_WORDS.value]
        self.headers = self.headers_t.numpy()
        # Each entry's inline batch (see INLINE_META), as int32 views: metadata columns [5, FEW_WRITES], values.
        entries32 = self.headers.reshape(depth, ENTRY_WORDS.value).view(np.int32)[:, 2 * HEADER_WORDS.value :]
        self.inline_meta = entries32[:, : INLINE_META.value].reshape(depth, 5, FEW_WRITES.value)  # columns
        self.inline_values = entries32[:, INLINE_META.value : INLINE_META.value + PRELOADED_VALUES.value]
        assert np.shares_memory(self.inline_meta, self.headers)  # views, never copies: commits write through them
        self._hv = memoryview(self.headers)  # type: ignore[arg-type]  # int64 stores without numpy scalars
        self.mirror_t = torch.zeros(3, dtype=torch.int64, pin_memory=pin)
        self.mirror = self.mirror_t.numpy()
        self._mirror_mv = memoryview(self.mirror)  # type: ignore[arg-type]
        # What the compiled commit (`multiwrite._cstaging.commit_graph`) reads besides `published`, `depth`, `lender`.
        self.headers_addr, self.mirror_addr = self.headers_t.data_ptr(), self.mirror_t.data_ptr()
        assert self.headers_addr % 64 == 0 and ENTRY_WORDS.value * 8 % 64 == 0
        self.state = torch.zeros(3, dtype=torch.int64, device=device)
        rows = [(t.data_ptr(), t.stride(0), t.stride(1), t.shape[0], t.shape[1]) for t in tables]
        assert len(rows[0]) == DESC_COLUMNS
        # Fixed for the life of the tables (a graph-mode BlockTables never replaces or resizes them); this
        # object keeps the tensor alive as long as the BlockTables, which must outlive its graphs.
        self.descriptors = torch.tensor(rows, dtype=torch.int64).to(device)
        if writer.is_gpu:
            torch.cuda.synchronize(device)  # zeroed state and descriptors complete whatever stream launches next
        self.num_tables = len(rows)
        self.published = 0
        self._eager_limit = 0  # headers an eager launch has already been asked to consume
        self._args = (
            self.descriptors.data_ptr(),
            self.headers_t.data_ptr(),
            self.state.data_ptr(),
            self.mirror_t.data_ptr(),
        )
        self.pdl = _pdl_capable(writer)
        self._consts = {
            "DEPTH": depth, "NT": max(2, _pow2(self.num_tables)), "BLOCK_W": BLOCK_W, "BLOCK_L": BLOCK_L,
            "LAUNCH_DEPENDENTS": self.pdl,
        }  # fmt: skip
        # The stage (gather, slot mappings) of captured stage calls: descriptors and scratch of its own, built
        # once outside any capture (`bind_stage`), and every capture's inputs, alive as long as this object.
        self.stage_desc: torch.Tensor | None = None
        self.stage_scratch: torch.Tensor | None = None
        self.captured: list[CapturedStage] = []
        if writer.is_gpu:
            self.launch(0)  # compile and load now: never inside a capture
            torch.cuda.synchronize(device)

    @property
    def consumed(self) -> int:
        return int(self._mirror_mv[0])

    @property
    def idle_runs(self) -> int:
        return int(self._mirror_mv[1])

    @property
    def rereads(self) -> int:
        return int(self._mirror_mv[2])

    # -- host side ---------------------------------------------------------------------------------
    def commit(self, arena: StagingArena) -> int:
        """Publish the arena's staged writes as the next header and rotate the arena to a fresh slot.

        Returns the header's index. An empty arena publishes an empty header (a run consuming it applies
        nothing). Host work only: a few stores into pinned memory, no launch, no driver call. Waits (and
        warns, then raises) while the ring is full of committed batches that no run consumed yet;
        nothing is published or dropped then.
        """
        h = self.published
        ring = self.ring
        w = arena.num_writes
        num_values = arena.num_values
        rounds = 1
        if w and arena.may_overlap:  # writes of one (table, row) land in staging order: rounds, as the writer does
            meta, bounds = overlap_rounds(arena.meta[:w])
            arena.meta[:w] = meta
            rounds = bounds.shape[0] - 1
        inline = 0 < w and rounds == 1 and w <= FEW_WRITES.value and num_values <= PRELOADED_VALUES.value
        if w and not inline:
            i = self.lender.current
            nxt = ring.succ[i]
            if ring.done_mv[nxt] != ring.tokens[nxt]:  # the slot the arena rotates into holds an unconsumed batch
                self._wait(lambda: ring._released(nxt), h)
        if self._mirror_mv[0] < h - self.depth + 1:  # the entry still holds a header no run consumed
            self._wait(lambda: self.consumed >= h - self.depth + 1, h)
        hv = self._hv
        e = h % self.depth
        b = e * ENTRY_WORDS.value
        if inline:  # the batch travels in the entry: the arena keeps its slot (the kernel never reads it)
            self.inline_meta[e, :, :w] = arena.meta[:w].T
            self.inline_values[e, :num_values] = arena.values[:num_values]
            hv[b + H_META] = hv[b + H_VALUES] = hv[b + H_BOUNDS] = hv[b + H_DONE] = 0
            hv[b + H_TOKEN] = inline_checksum(arena.meta[:w], arena.values[:num_values])
            hv[b + H_COUNTS] = w | 1 << 32 | INLINE
            hv[b + H_NUM_VALUES] = num_values
        elif w:
            slot = ring.slots[i]
            if rounds > 1:
                slot.bounds[: rounds + 1] = bounds
            token = ring.tokens[i] % 0x7FFFFFFF + 1  # (`ring.next_token(i)`, inlined)
            ring.tokens[i] = token
            hv[b + H_META] = arena.meta_addr
            hv[b + H_VALUES] = arena.values_addr
            hv[b + H_BOUNDS] = slot.bounds_addr
            hv[b + H_DONE] = ring.done_addr[i]
            hv[b + H_TOKEN] = token
            hv[b + H_COUNTS] = w | rounds << 32
            hv[b + H_NUM_VALUES] = num_values
        else:
            hv[b + H_DONE] = 0
            hv[b + H_COUNTS] = 0
            hv[b + H_NUM_VALUES] = 0
        hv[b + H_SEQ] = h + 1  # last: publishes the header (x86 stores reach the device in program order)
        self.published = h + 1
        if inline:
            arena.clear()
        elif w:
            arena.clear()
            arena.rotate()  # the next slot, free (checked above)
        return h

    def would_wait(self, arena: StagingArena) -> bool:
        """Whether `commit(arena)` would wait now for a run to consume an earlier batch."""
        h = self.published
        if arena.num_writes and not self.ring._released(self.ring.succ[self.lender.current]):
            return True
        return self.consumed < h - self.depth + 1

    def _wait(self, released, h: int) -> None:
        """Poll until `released()`, warn after the writer's `wait_warn_s`, synchronize the device after its
        `wait_timeout_s`, then raise `RingStallError` if still not released."""
        writer = self.writer
        writer.waits += 1
        t0 = time.perf_counter()
        warn_at, deadline = t0 + writer.wait_warn_s, t0 + writer.wait_timeout_s
        warned, pause = False, 0.0
        while not released():
            now = time.perf_counter()
            if not warned and now >= warn_at:
                warnings.warn(RingWaitWarning(self._full(h, f"has waited {now - t0:.1f} s")), stacklevel=3)
                warned = True
            if now >= deadline:
                if writer.is_gpu:
                    torch.cuda.synchronize(writer.device)
                if not released():
                    raise RingStallError(
                        self._full(h, f"gave up after {time.perf_counter() - t0:.1f} s"
                                   + (" and a device synchronization" if writer.is_gpu else ""))
                        + " Nothing was committed; the staged writes stay staged."
                    )
                return
            time.sleep(pause)
            pause = min(pause * 2 or 2e-6, 1e-3)

    def _full(self, h: int, what: str) -> str:
        pending = h - self.consumed
        return (
            f"commit_staged_writes (header {h}) {what} for a free slot of the graph-mode ring (depth "
            f"{self.ring.depth}; {self.depth} header entries) of BlockTables on {self.writer.device}: {pending} "
            "committed batches have not been consumed by any run of the apply kernel. Each graph replay consumes "
            "ONE committed batch and an eager apply_staged_writes() all of them: replay the captured graph (or call "
            "apply_staged_writes()) after each commit; if replays are queued, the stream they run on is held up by "
            "earlier work."
        )

    # -- the captured stage ------------------------------------------------------------------------
    def bind_stage(self, layout: StageInputs) -> None:
        """Build the stage descriptors of the tables and their gather outputs (fixed for good), once, at
        construction of the `BlockTables` (outside any capture: building them copies to the device).

        `layout`: a `StageInputs` with the layout fields set (tables, num_blocks, input_block_tables,
        block and kernel block sizes). `triton_stage`'s descriptor cache may evict its own reference; this
        object keeps one, since captured launches read the descriptors by address at every replay.
        """
        self.stage_desc = _descriptor_table(layout)
        self.stage_scratch = torch.zeros((1, 1), dtype=torch.int64, device=self.writer.device)
        if self.writer.is_gpu:
            torch.cuda.synchronize(self.writer.device)

    def record_stage(self, stage: StageInputs, consume: bool) -> CapturedStage:
        """Launch (under a capture: record) `stage`'s gather/slot mappings, after the consume kernel if
        `consume`, and keep what the launches read by address alive; see `CapturedStage`."""
        if self.stage_desc is None:
            raise BackendUnavailableError("GraphStage.record_stage before bind_stage: no stage descriptors")
        captured = CapturedStage(self, stage, consume)
        captured.launch()
        self.captured.append(captured)
        return captured

    def device_guard(self):
        """A context that makes the tables' GPU current (a no-op context off a GPU)."""
        if self.writer.is_gpu:
            return torch.cuda.device(self.writer._index)
        return _NO_GUARD

    # -- launches ---------------------------------------------------------------------------------
    def launch(self, limit: int) -> None:
        """Launch the consume kernel on the current stream: `limit = -1` (what a capture records) consumes
        the next header if published; `limit >= 0` consumes every published header below `limit`."""
        args = (*self._args, limit, self.num_tables)
        if not self.writer.is_gpu:
            with _INTERPRETER_LOCK:
                _consume_kernel[(1,)](*args, **self._consts, num_warps=NUM_WARPS, num_stages=1)
            return
        with torch.cuda.device(self.writer._index):
            _consume_kernel[(1,)](*args, **self._consts, num_warps=NUM_WARPS, num_stages=1)

    def apply_eager(self) -> None:
        """Consume every header committed so far (one launch), if any was committed since the last call."""
        if self.published > self._eager_limit:
            self.launch(self.published)
            self._eager_limit = self.published

    def pending(self) -> int:
        """Committed headers not yet consumed, as far as the host can tell (the device count may lag)."""
        return self.published - self.consumed


def new_graph_stage(writer: TritonWriter, tables: list[torch.Tensor], arena: StagingArena) -> GraphStage:
    """Attach `arena` (empty) to a lent ring of `writer` and build its `GraphStage`."""
    assert arena.num_writes == 0
    lender = writer.lend(arena.np_dtype)
    arena.attach(lender)
    return GraphStage(writer, tables, lender)


__all__ = ["CapturedStage", "GraphStage", "HEADER_WORDS", "compilable_consume_kernel", "new_graph_stage"]

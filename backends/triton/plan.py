"""`TritonPlan`: the jobs of one `BlockTables` on the Triton backends, eager and in graph mode.

Built once per `BlockTables` (its tables never move): the descriptors of the arena's tables and of the stage, the
fixed kernel arguments, and the arena's own ring of pinned slots, which the kernels read in place. Per call only
the step's values are read: `apply()` is one launch of the apply kernel, `prepare(step)` one launch of the stage
kernel with `HAS_WRITES` (the apply, the gather and the slot mappings together), `stage(step)` one launch of it
without. Every launch that reads the arena's slot goes through `TritonDevice.launch_on`, and the arena lands on
its next slot (`StagingArena.land_after`).
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl

from multiwrite.backends.triton.device import Descriptors, TritonDevice, apply_grid, descriptor_rows
from multiwrite.backends.triton.kernels import stage
from multiwrite.backends.triton.launcher import get_device, get_stream
from multiwrite.capture import current_stream_capturing, settle
from multiwrite.plugins.backend import GraphPlan
from multiwrite.stage.entry import StagedLaunchSpec, StageLaunchSpec
from multiwrite.stage.layout import TablesLayout
from multiwrite.stage.step import StepInputs
from multiwrite.staging.arena import Lease, StagingArena
from multiwrite.staging.headers import HeaderRing

TL_INDEX = {torch.int32: tl.int32, torch.int64: tl.int64}
# The stage kernel's sizes as plain ints (comparing with a constexpr would make a constexpr).
APPLY_W, APPLY_L, PRELOADED = stage.APPLY_W.value, stage.APPLY_L.value, stage.PRELOADED_VALUES.value
#: Column splits of one apply tile at most.
MAX_APPLY_SPLITS = 64
#: The stage kernel's apply programs' tiling (`apply_grid`): one tile width for decode batches and others.
STAGE_TILING = (APPLY_W, APPLY_W, PRELOADED, APPLY_L, MAX_APPLY_SPLITS)


class TritonPlan(GraphPlan):
    """The plan of one `BlockTables` on a Triton backend (module docstring).

    Args:
        backend: the backend.
        device: the `TritonDevice` of the tables' device.
        layout: the tables' memory.
        arena: the staging arena (empty): it stages into a ring of the device from now on.
        graph: built for graph mode (compiles the consume kernel now, never inside a capture).

    Attributes:
        pdl: whether captured stage launches are programmatic dependent launches of the consume kernel (NVIDIA,
            compute capability 9.0 or newer, compiled Triton); read at each capture.
    """

    def __init__(self, backend, device: TritonDevice, layout: TablesLayout, arena: StagingArena, graph: bool):
        self.backend = backend
        self.layout = layout
        self.arena = arena
        self.tables = [*layout.tables, layout.counts_table]
        self.device = device
        arena.attach(device.lend(np.int32))
        rows = descriptor_rows(self.tables)
        assert all(t.stride(1) == 1 for t in (*layout.tables, *layout.input_block_tables))
        # Fixed for the life of the tables: the plan keeps both alive; captured launches read them by address.
        self._desc_rows = torch.tensor(rows, dtype=torch.int64)
        desc = self._desc_rows.to(layout.device)
        self.desc = Descriptors(desc, desc.data_ptr(), len(rows), False)
        slots = layout.slot_mappings
        if slots is None:  # tables without max_num_batched_tokens gather only: any int64 buffer stands in
            slots = torch.zeros((1, 1), dtype=torch.int64, device=layout.device)
        self._slots = slots
        nb = layout.num_blocks
        stage_rows = [
            [src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(0), src.shape[1], bs, kbs, k,
             nb.data_ptr() + 4 * g * nb.stride(0), slots.data_ptr() + 8 * g * slots.stride(0), slots.shape[1],
             nb.shape[1], layout.cp_rank, self.desc.addr,
             stage.FLAG_SLOTS.value * layout.slot_mapping_enabled[g] + stage.FLAG_SHARDED.value * layout.dcp_sharded[g],
             layout.sliding_window_reach[g]]
            for g, (src, dst, bs, kbs, k) in enumerate(zip(layout.tables, layout.input_block_tables,
                                                           layout.block_sizes, layout.kernel_block_sizes,
                                                           layout.kernel_blocks_per_block))
        ]  # fmt: skip
        assert len(stage_rows[0]) == stage.STAGE_DESC_WORDS.value
        self._stage_rows = torch.tensor(stage_rows, dtype=torch.int64)
        self.sdesc = self._stage_rows.to(layout.device)
        self._sdesc_addr = self.sdesc.data_ptr()
        self.splits = max(1, -(-max(layout.widths) // stage.CHUNK.value))
        self._groups = layout.num_groups
        self._fallback = slots.data_ptr()  # an empty tensor's address, 0, would read as an int32 under the interpreter
        f = self._fallback
        # The arguments of a launch that reads no staged batch, before the step's (`_stage`, the compiled entry):
        # the stage descriptors, no batch (meta, values, bounds, counter, done word), token 0, no writes or values,
        # one round, one tile, one program of it, no apply programs.
        self._no_batch = (self._sdesc_addr, f, f, f, f, 0, 0, 0, 0, 1, 1, 0)
        self._consts: dict[tuple, dict] = {}
        self._cp = (layout.cp_size, layout.cp_interleave)
        self._window = any(layout.sliding_window_reach)  # (else num_computed_tokens changes nothing: not read)
        self.pdl = _pdl_capable(device)
        self.header_depth = 1 << max(1, (device.depth - 1).bit_length())
        self._consume_consts = {"DEPTH": self.header_depth, "NT": max(2, 1 << (len(rows) - 1).bit_length()),
                                "LAUNCH_DEPENDENTS": self.pdl}  # fmt: skip
        settle(layout.device)  # the descriptors are complete whatever stream launches next

    # -- the eager jobs ---------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Write both descriptor tables again, in place (their addresses stay: captured launches read them there),
        and wait for the copies on this stream."""
        self.desc.tensor.copy_(self._desc_rows)
        self.sdesc.copy_(self._stage_rows)
        settle(self.layout.device)

    def apply(self) -> None:
        """One launch of the apply kernel on the arena's slot, in place (overlapping writes reordered into rounds)."""
        arena = self.arena
        w, v = arena.num_writes, arena.num_values
        rounds = arena.order_rounds() if arena.may_overlap else 1
        arena.land_after(self.device.launch_apply, self.desc, w, v, rounds, np.int32)

    def stage(self, step: StepInputs) -> None:
        """One launch of the stage kernel (gather and/or slot mappings)."""
        self._stage(None, step, 0, 0, 1, False)

    def prepare(self, step: StepInputs) -> None:
        """The whole step in one launch of the stage kernel with the staged writes; with nothing staged, the stage
        alone; with a row written in more than `stage.MAX_ROUNDS` rounds, the apply, then the stage."""
        arena = self.arena
        w, v = arena.num_writes, arena.num_values
        if not w:
            return self._stage(None, step, 0, 0, 1, False)
        rounds = arena.order_rounds() if arena.may_overlap else 1
        if rounds > stage.MAX_ROUNDS.value:
            arena.land_after(self.device.launch_apply, self.desc, w, v, rounds, np.int32)
            return self._stage(None, step, 0, 0, 1, False)
        arena.land_after(self._stage, step, w, v, rounds, False)

    def _stage(self, lease: Lease | None, step: StepInputs, w: int, v: int, rounds: int, pdl: bool) -> None:
        """Launch the stage kernel for `step`, with the staged batch in `lease` when there is one."""
        if not (step.do_gather or step.do_slots):
            return
        qsl, pos, pad, nct = step.query_start_loc, step.positions, step.is_padding, step.num_computed_tokens
        window = nct is not None and self._window
        # The variant: every constexpr of the launch (the device's launcher is shared by every plan on it, so the
        # layout's constexprs are part of the key: tables with other context parallelism compile their own).
        key = (step.idx_mapping.dtype, torch.int64 if qsl is None else qsl.dtype, torch.int64 if pos is None
               else pos.dtype, pad is not None, step.do_gather, step.do_slots, lease is not None, pdl,
               *self._cp, nct.dtype if window else torch.int32, window)  # fmt: skip
        consts = self._consts.get(key)
        if consts is None:
            consts = self._consts[key] = self.constexprs(key)
        G = self._groups
        padded = step.num_rows  # (>= num_reqs_padded: rows a previous gather left are zeroed too)
        grid0 = G * (padded + 1) * self.splits
        f = self._fallback
        tail = (
            G, step.idx_mapping.data_ptr() or f, f if qsl is None else qsl.data_ptr() or f,
            f if pos is None else pos.data_ptr() or f, f if pad is None else pad.data_ptr() or f,
            nct.data_ptr() or f if window else f, step.num_reqs, padded,
            0 if pos is None else pos.shape[0], self.splits,
        )  # fmt: skip
        device = self.device
        launcher = device.stage_launcher
        if lease is None:  # (no staging memory is read: done word 0)
            args = (*self._no_batch, *tail)
            # (an eager gather or slot-mapping call of an engine does not come here: the compiled entry launches it)
            if pdl:
                return launcher.launch(key, consts, grid0, 1, args, jit=True, launch_pdl=True)
            return launcher.launch(key, consts, grid0, 1, args)
        tiles, splits = apply_grid(w, v, rounds, STAGE_TILING, device.max_programs)
        device.launch_on(lease, launcher, key, consts, grid0 + tiles * splits, 1,
                         (self._sdesc_addr, lease.meta_addr, lease.values_addr, lease.bounds_addr),
                         (w, v, rounds, tiles, tiles * splits, *tail), self.desc)  # fmt: skip

    def constexprs(self, key: tuple) -> dict:
        """The stage kernel's compile-time constants of the variant `key` (`_stage`'s key)."""
        idx, qsl, pos, has_padding, do_gather, do_slots, has_writes, pdl, cp_size, cp_interleave, nct, window = key
        return {
            "IDX_DTYPE": TL_INDEX[idx], "QSL_DTYPE": TL_INDEX[qsl], "POS_DTYPE": TL_INDEX[pos],
            "NCT_DTYPE": TL_INDEX[nct], "HAS_WINDOW": window,
            "CP_SIZE": cp_size, "CP_INTERLEAVE": cp_interleave, "HAS_PADDING": has_padding,
            "DO_GATHER": do_gather, "DO_SLOTS": do_slots, "HAS_WRITES": has_writes, "PDL": pdl,
        }  # fmt: skip

    def stage_launch_spec(self) -> StageLaunchSpec | None:
        """On a GPU, `launch_spec()`: the compiled entry launches this plan's eager stage calls itself; None under the
        interpreter. (A subclass that changes what `_stage` launches must return None here.)"""
        return self.launch_spec() if self.device.is_gpu else None

    def launch_spec(self) -> StageLaunchSpec:
        """What `_stage` fixes of a launch of the stage kernel (`multiwrite.stage.entry`): the entry builds the same
        arguments (`head`: the no-batch arguments `_stage` passes first; `staged`: what a launch on the staged batch
        passes instead and the sequence around it) and variant key from it."""
        layout = self.layout
        mnbt = layout.max_num_batched_tokens
        device, arena = self.device, self.arena
        staged = StagedLaunchSpec(arena, arena.lender, self.desc, device.resolve, current_stream_capturing,
                                  STAGE_TILING, device.apply_tiling, device.max_programs, device.apply_launcher,
                                  np.dtype(np.int32).char)  # fmt: skip
        return StageLaunchSpec(
            device.stage_launcher, device.index, get_device, get_stream, layout, layout.max_num_reqs,
            -1 if mnbt is None else mnbt, self._groups, self.splits, self._no_batch, self._fallback, *self._cp,
            self._window, staged,
        )  # fmt: skip

    # -- graph mode -------------------------------------------------------------------------------------------------
    def consume(self, ring: HeaderRing, limit: int) -> None:
        """One launch of the consume kernel (through the JIT: a launch either captured or rare). An eager one
        (`limit >= 0`) carries the ring's `tickets_published` as of now."""
        tickets = ring.tickets_published if limit >= 0 else 0
        args = (self.desc.addr, ring.headers_addr, ring.tickets_addr, ring.state.data_ptr(), ring.mirror_addr, limit,
                tickets, self.desc.num_tables)  # fmt: skip
        consts = self._consume_consts
        self.device.consume_launcher.launch(("consume", consts["DEPTH"], consts["NT"], self.pdl), consts, 1, 1,
                                            args, jit=True)  # fmt: skip

    def record_stage(self, ring: HeaderRing, step: StepInputs, consume: bool) -> object:
        """The consume launch (if `consume`), then the stage launch reading `step`'s inputs by address; on an sm_90+
        GPU, after the consume launch, a programmatic dependent launch. Returns the step (kept alive)."""
        if consume:
            self.consume(ring, -1)
        self._stage(None, step, 0, 0, 1, consume and self.pdl)
        return step


def _pdl_capable(device: TritonDevice) -> bool:
    """Whether a captured stage launch may be a programmatic dependent launch of the consume kernel: compiled code for
    an NVIDIA GPU of compute capability 9.0 or newer (`griddepcontrol`), with a Triton that has `gdc_wait` and the
    `launch_pdl` option (3.4 and newer)."""
    if not device.is_gpu or torch.version.hip is not None or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device.index) >= (9, 0)

"""The direct path of an eager `BlockTables.prepare_inputs` on `triton-cuda` / `triton-rocm` (issue 10's host
time goal: an eager decode step within 2 empty launches).

The general path of a decode step goes `stage.prepare_inputs` -> `BlockTables.apply_staged_writes` ->
`FusedStagedWriter.apply` (a `WriteBatch`) -> the backend's `prepare_inputs` -> `triton_stage.launch_fused`,
each layer re-deriving what is fixed for the tables. `DirectStage.prepare_inputs` is that same step as ONE
function for the common case, reading what is fixed from one object per `BlockTables`:

- eager tables (not graph mode) on a GPU, whose staging arena stages in place into a pinned ring slot lent by
  this device's `TritonWriter`;
- the same tables as the writer's last apply (its repeat fast path `FusedStagedWriter._fast` holds: no table
  replaced, resized or written in place since, so no check of the general path needs to run again), and the
  fused plan (`triton_stage._FusedPlan`) cached for them;
- writes staged with values, none overlapping (in place, one round), and the step's inputs as an engine passes
  them on a GPU (device tensors of the accepted dtypes, counts in range: `stage._build_common`'s checks).

Anything else returns None before changing anything, and `BlockTables.prepare_inputs` takes the general path,
which handles (or refuses) it as always. The direct path keeps every guarantee of the general one, in the same
order: `GraphCaptureError` first; the launch guarded by the ring slot's completion token (`_Ring.next_token`,
`_Ring.launched`); a launch that raises gives the `BackendError` of `FusedStagedWriter._call_backend` with every
write still staged (and host `num_blocks` as staged, so a retry lands them all); after the launch the arena is
cleared and rotated and the tables' overlap epoch bumped, as `BlockTables.apply_staged_writes` does.
`tests/test_stage_fast_path.py` checks each against the general path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from multiwrite.backends.triton_kernel import TritonWriter, _LentRing, fire_on
from multiwrite.backends.triton_stage import APPLY_L, APPLY_W, _FusedPlan, variant_constants

from multiwrite import capture as _capture
from multiwrite.capture import refuse_capture
from multiwrite.stage import _INDEX_DTYPES, gathered_views, slot_view
from multiwrite.writer import backend_error

if TYPE_CHECKING:
    from multiwrite.block_tables import BlockTables

_WHAT = "BlockTables.prepare_inputs"
_T = torch.Tensor
_BOOL = torch.bool


class DirectStage:
    """What the direct path of one `BlockTables` reuses every call; holds no reference to the `BlockTables`.

    Built by `bind` once the general path has run a fused launch for these tables (so the lent ring, the writer's
    repeat fast path and the fused plan all exist); `prepare_inputs` re-checks each of them at every call.
    """

    __slots__ = (
        "writer", "backend", "twriter", "arena", "lender", "ring", "kernel_guard", "config", "plans", "device",
        "cuda", "index", "context", "epoch", "tensors", "max_num_reqs", "max_tokens", "num_groups", "variants",
        "max_programs", "plan", "batch_tables", "desc", "desc_addr", "sdesc_addr", "slot_addr", "slot_stride",
        "nb_addr", "nb_stride", "max_slots", "cp_rank", "launcher",
    )  # fmt: skip

    def __init__(self, bt: BlockTables, twriter: TritonWriter, epoch: int):
        config = bt._stage_config
        self.writer = bt._writer  # the FusedStagedWriter: its `_fast` says the tables are as last applied
        self.backend = self.writer.backend
        self.twriter = twriter
        self.arena = bt._arena
        self.lender = self.arena.lender
        self.ring = self.lender.ring  # type: ignore[union-attr]
        self.kernel_guard = twriter._kernel_guard
        self.config = config
        self.plans = config.plans
        self.device = config.device
        self.cuda = self.device.type == "cuda"
        self.index = self.device.index  # None only for a bare "cuda" (then every call checks in full)
        self.context = bt._context_view  # int64 stores into the BlockTables' context (its overlap epoch)
        self.epoch = epoch
        self.tensors = list(bt._all)  # for the BackendError's names, as the general path gives them
        self.max_num_reqs = config.max_num_reqs
        self.max_tokens = config.max_num_batched_tokens
        self.num_groups = len(config.tables)
        self.max_programs = twriter._max_programs
        # (idx_mapping, query_start_loc, positions dtypes, has is_padding) -> [the kernel variant's constants, its
        # key, its bound fast launcher or None]
        self.variants: dict[tuple, list] = {}
        self.plan = None

    def adopt(self, plan: _FusedPlan) -> None:
        """Take the fixed kernel arguments from `plan`, the fused plan now cached for these tables."""
        self.plan = plan
        self.batch_tables = plan.batch_tables
        self.desc = plan.desc
        self.desc_addr, self.sdesc_addr = plan.desc.addr, plan.sdesc_addr
        self.slot_addr, self.slot_stride = plan.slot_args
        _, self.nb_addr, self.nb_stride = plan.fixed
        self.max_slots = plan.slots.shape[1]
        _, self.cp_rank = plan.rows_args  # (max_num_reqs, cp_rank)
        self.launcher = plan.launcher
        self.variants = {}  # constants are cached per plan

    def prepare_inputs(
        self,
        idx: torch.Tensor,
        qsl: torch.Tensor,
        pos: torch.Tensor,
        num_reqs_padded: int,
        num_tokens_padded: int,
        pad: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor] | None:
        """`BlockTables.prepare_inputs` (same arguments, same result) in one launch of the fused kernel, or None
        having done nothing when this call is not the common case (module docstring).

        Raises:
            GraphCaptureError: the current stream is capturing (checked first; nothing done).
            BackendError: the launch raised; every staged write stays staged.
            RingStallError: the arena's next ring slot is never released (as the general path's rotation).
        """
        if self.cuda and (_capture._is_capturing() or self.index != _capture._get_device()):
            refuse_capture(self.device, _WHAT)  # capturing: raises; another current device: checks that one too
        # The step's inputs: `stage._build_common`'s checks.
        if not (
            idx.__class__ is _T and qsl.__class__ is _T and pos.__class__ is _T
            and num_reqs_padded.__class__ is int and num_tokens_padded.__class__ is int
        ):  # fmt: skip
            return None
        device = self.device
        shape = idx.shape
        if not (
            len(shape) == 1 and qsl.dim() == 1 and pos.dim() == 1
            and idx.device == device and qsl.device == device and pos.device == device
            and idx.is_contiguous() and qsl.is_contiguous() and pos.is_contiguous()  # (the kernel reads stride 1)
        ):  # fmt: skip
            return None
        n = shape[0]
        if not (n <= num_reqs_padded <= self.max_num_reqs and 0 <= num_tokens_padded <= self.max_tokens):
            return None
        if qsl.shape[0] <= n:
            return None
        if pad is not None and not (
            pad.__class__ is _T and pad.dtype is _BOOL and pad.device == device and pad.dim() == 1
            and pad.shape[0] >= num_tokens_padded and pad.is_contiguous()
        ):  # fmt: skip
            return None
        # The staged batch: in place in the lent ring slot (the arena's lender never changes once attached), one
        # round, the tables as the writer last applied them, the fused plan cached for them.
        arena = self.arena
        w, v = arena.num_writes, arena.num_values
        if not v or arena.may_overlap:
            return None
        fast = self.writer._fast
        if fast is None or fast[1] is not arena or fast[2] != arena.layout_version:
            return None
        try:
            if fast[4][0]._version != fast[5]:
                return None  # written in place since: the general path checks the layouts (and refuses a resize)
        except RuntimeError:  # an inference tensor tracks no version: the general path compares the layouts
            return None
        plan = self.plans.get(self.twriter)
        if plan is not self.plan:
            if plan is None:
                return None
            self.adopt(plan)
        if fast[3] is not self.batch_tables:
            return None
        key = (idx.dtype, qsl.dtype, pos.dtype, pad is not None)
        variant = self.variants.get(key)
        if variant is None:
            if not (key[0] in _INDEX_DTYPES and key[1] in _INDEX_DTYPES and key[2] in _INDEX_DTYPES):
                return None
            config = self.config
            consts, name = variant_constants(plan, (*key, True, True, config.cp_size, config.cp_interleave))
            variant = self.variants[key] = [consts, name, None]
        # The launch: `triton_stage.launch_fused`'s in-place case.
        tiles = (w + APPLY_W - 1) // APPLY_W or 1
        splits = 1 if v <= 256 else max(1, min((v + APPLY_L - 1) // APPLY_L, 64, self.max_programs // tiles))
        ring = self.ring
        i = self.lender.current  # type: ignore[union-attr]
        slot = ring.slots[i]
        token = ring.tokens[i] % 0x7FFFFFFF + 1  # `_Ring.next_token`
        ring.tokens[i] = token
        slot.desc = self.desc  # alive until this launch is seen finished (the slot's next take)
        fallback = self.slot_addr  # an empty input's address 0 would read as an int32: see launch_fused
        args = (
            self.desc_addr, self.sdesc_addr, slot.meta_addr, slot.values_addr, slot.bounds_addr,
            ring.counter_addr[i], ring.done_addr[i], token, w, v, 1, tiles, tiles * splits, self.num_groups,
            self.nb_addr, self.nb_stride, idx.data_ptr() or fallback, qsl.data_ptr() or fallback,
            pos.data_ptr() or fallback, fallback if pad is None else pad.data_ptr() or fallback, fallback,
            self.slot_stride, n, num_reqs_padded, self.max_slots, pos.shape[0], self.max_num_reqs, self.cp_rank,
        )  # fmt: skip
        grid0 = tiles * splits + self.num_groups * (num_reqs_padded + 1)
        try:
            fire = variant[2]
            if fire is None:
                launcher = self.launcher
                fire = variant[2] = launcher.fire.get(variant[1])  # bound after the variant's first (JIT) launch
                if fire is None:  # that first launch, or the interpreter
                    launcher.launch(grid0, args, variant[0], variant[1])
            if fire is not None:
                fire_on(fire, self.index, grid0, 1, args)
            if not self.kernel_guard:
                ring.launched(i)
        except Exception as exc:
            ring.done_mv[i] = token  # nothing was launched: the slot is free; every write stays staged
            raise backend_error(self.backend, device, self.tensors, w, exc) from exc
        except BaseException:
            ring.done_mv[i] = token
            raise
        arena.clear()
        arena.rotate()
        self.context[self.epoch] += 1  # a new batch: every (table, row) is free again
        config = self.config
        views = config.gathered_views.get(num_reqs_padded)
        if views is None:
            views = gathered_views(config, num_reqs_padded)
        slots = config.slot_views.get(num_tokens_padded)
        if slots is None:
            slots = slot_view(config, num_tokens_padded)
        return views, slots


def bind(bt: BlockTables, twriter: TritonWriter, epoch: int) -> Callable | None:
    """`DirectStage(...).prepare_inputs` for `bt` once its general path has set up what the direct path reuses
    (the arena staging into a ring lent by `twriter`, the writer's repeat fast path, the cached fused plan); None
    while something is missing (the caller asks again after a later general call). `epoch`: the index of the
    overlap epoch in `bt._context_view`."""
    config = bt._stage_config
    if bt._graph is not None or not config.gpu or config.max_num_batched_tokens is None:
        return None
    arena = bt._arena
    lender = arena.lender
    if lender.__class__ is not _LentRing or lender.owner is not twriter:  # type: ignore[union-attr]
        return None
    fast = bt._writer._fast
    if fast is None or fast[1] is not arena:
        return None
    plan = config.plans.get(twriter)
    if plan is None or plan.batch_tables is not fast[3]:
        return None
    return DirectStage(bt, twriter, epoch).prepare_inputs

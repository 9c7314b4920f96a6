"""The compiled entry of an eager stage call: `StageLaunchSpec`, what a plan fixes of its stage kernel's launch (with
`StagedLaunchSpec`, its launch on the staged batch), and `stage_entry`, which builds `_cstaging.StageEntry` from it.

An eager `BlockTables.gather_block_tables` or `compute_slot_mappings` that applies nothing, a `prepare_inputs` or an
`apply_staged_writes`, called as an engine calls it on a GPU (its inputs contiguous device tensors, no `out`), is
checked and launched by that one C call: the preconditions of the common case (the mode's preamble: the address check
not due, no table or output resized; the inputs as `StepInputs.on_device` accepts them; the kernel variant bound to a
fast launcher; the current device the tables'; for a call that applies also no capture under way, no overlapping
writes staged and the ring's next slot free), then the launch the plan makes for it (`TritonPlan._stage`,
`TritonDevice.launch_apply`; on the staged batch inside the sequence of `StagingArena.land_after`,
`TritonDevice.launch_on` and `SlotRing.hand_over`). Where any of them fails it does nothing and returns None, and the
call takes its one Python path (`TablesMode.stage_call`, `EagerMode.apply`), which checks in full and names what is
wrong.
docs/lifecycle.md#the-stage-entry says why it exists (the Python around a launch was two thirds of the call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from multiwrite.staging.fields import _cstaging


@dataclass(frozen=True)
class StagedLaunchSpec:
    """What a plan fixes of its launches on the staged batch: the stage kernel's with it (`prepare`) and the apply
    kernel's (`apply`) (`TritonPlan.launch_spec`).

    Attributes:
        arena: the tables' `StagingArena` (staged into a slot of `ring`; it lands on the ring's next slot).
        ring: the arena's `SlotRing`: its `next`, read and moved as `SlotRing.acquire`, `release` and `hand_over`
            move it, and its lists `leases`, `succ` and `counter_addrs`, taken once (the ring changes them in place,
            never replaces them).
        keep: what each launch on a slot keeps alive until the slot is released (the apply's descriptors).
        resolve: `resolve(lease, token)` after an interrupt around a launch (`TritonDevice.resolve`).
        is_capturing: whether the current CUDA stream is capturing (a C function of torch).
        stage_tiling, apply_tiling: the tilings of the stage kernel's apply programs (`TritonPlan._stage`) and of
            the apply kernel (`TritonDevice.launch_apply`): `(decode_w, tile_w, preloaded, tile_l, max_splits)`, the
            entry's grids computed by the same function as theirs (`multiwrite.backends.triton.device.apply_grid`).
        max_programs: the apply programs in flight at most.
        apply_launcher: the apply kernel's `Launcher` (`apply`: its variants `(values_char, decode)`).
        values_char: the numpy dtype char of the staged values.
    """

    arena: Any
    ring: Any
    keep: Any
    resolve: Callable[[Any, int], None]
    is_capturing: Callable[[], bool]
    stage_tiling: tuple[int, int, int, int, int]
    apply_tiling: tuple[int, int, int, int, int]
    max_programs: int
    apply_launcher: Any
    values_char: str


@dataclass(frozen=True)
class StageLaunchSpec:
    """What a plan fixes of its stage kernel's lease-less launch (the Triton backends' `TritonPlan.launch_spec`).

    Attributes:
        launcher: the stage kernel's `Launcher` (its `fire` dict: variant key -> bound fast launcher; `launches`).
        device_index: the tables' CUDA device index (the inputs' `get_device()`).
        get_device, get_stream: torch's current device and raw stream of a device index (C functions).
        layout: the tables' `TablesLayout` (`gathered`, `slots` and their view caches).
        max_num_reqs, max_num_batched_tokens: the tables' sizes (-1: no slot mappings).
        groups, splits: KV-cache groups and programs per row of the stage kernel.
        head: the kernel's arguments before the step's (the stage descriptors and "no staged batch"), as ints.
        fallback: the address passed for an absent input.
        cp_size, cp_interleave: context parallelism (part of the variant key).
        window: whether any group has a sliding window (else num_computed_tokens is not read).
        staged: the launch on the staged batch (`prepare`), or None: `prepare` leaves every call to the Python path.
        tensor_type, int32, int64, boolean: `torch.Tensor` and the dtypes the inputs may have.
    """

    launcher: Any
    device_index: int
    get_device: Callable[[], int]
    get_stream: Callable[[int], int]
    layout: Any
    max_num_reqs: int
    max_num_batched_tokens: int
    groups: int
    splits: int
    head: tuple[int, ...]
    fallback: int
    cp_size: int
    cp_interleave: int
    window: bool
    staged: StagedLaunchSpec | None = None
    tensor_type: type = torch.Tensor
    int32: torch.dtype = torch.int32
    int64: torch.dtype = torch.int64
    boolean: torch.dtype = torch.bool


class StageEntry(Protocol):
    """An eager stage call in one compiled call (`_cstaging.StageEntry`); None from a method: nothing was done."""

    def gather(self, idx_mapping: Any, num_reqs_padded: Any,
               num_computed_tokens: Any) -> tuple[torch.Tensor, ...] | None:  # fmt: skip
        """`input_block_tables[g][:num_reqs_padded]` per group, gathered (one launch), or None."""

    def slots(self, idx_mapping: Any, query_start_loc: Any, positions: Any, num_tokens_padded: Any,
              is_padding: Any) -> torch.Tensor | None:  # fmt: skip
        """`slot_mappings[:, :num_tokens_padded]`, computed (one launch), or None."""

    def prepare(self, idx_mapping: Any, query_start_loc: Any, positions: Any, num_reqs_padded: Any,
                num_tokens_padded: Any, is_padding: Any,
                num_computed_tokens: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor] | None:  # fmt: skip
        """`prepare_inputs`' (gathered views, slot-mapping view), the staged batch applied in the same launch, or
        None."""

    def apply(self) -> bool | None:
        """True once the staged batch is launched (`apply_staged_writes`' common case: one launch), or None."""


def stage_entry(owner: Any, countdown: Any, guard: Any, outputs: Any, failure: Callable[[Exception], Exception],
                spec: StageLaunchSpec | None) -> StageEntry | None:  # fmt: skip
    """The compiled entry for a mode `owner` (its `dirty_rows` moves with each gather), its preamble's `countdown`
    and `LayoutGuard`s (`guard`: the tables and counts, `outputs`: the gather and slot buffers) and `failure` (what a
    failed launch raises, from the launch's error); None where the plan has no `spec` or the helper is not built."""
    if spec is None or _cstaging is None or not isinstance(countdown, _cstaging.Countdown):
        return None
    if not isinstance(spec, StageLaunchSpec):
        raise TypeError(f"TablesPlan.stage_launch_spec() must return a StageLaunchSpec or None, got {spec!r}")
    return _cstaging.StageEntry(owner, countdown, guard, outputs, failure, spec)

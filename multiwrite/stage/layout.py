"""`TablesLayout`: the memory of one `BlockTables`, fixed for its life, and the sizes it was built with: what a
backend's plan is built for (`Backend.plan`).

One int32 allocation holds every group's table and `num_blocks`, so a CPU backend scatters into all of them at
once; the gather outputs (`input_block_tables`) and `slot_mappings` share another (`outputs_storage`). None of them
ever moves: a CUDA graph may read them by address.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from multiwrite.errors import StagedWriteError
from multiwrite.staging.layout import INT32_MAX, strict_index

#: The slot of a token nobody stores (vLLM's `PAD_SLOT_ID`).
PAD_SLOT_ID = -1
#: Most `slot_mappings` views kept (one per distinct `num_tokens_padded`).
_VIEW_CACHE = 1024
#: int32 cells per 128 bytes: where each table starts.
_ALIGN = 32


def _ints(what: str, seq: Any, low: int = 1) -> list[int]:
    if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
        raise StagedWriteError(f"BlockTables: {what} must be a sequence of integers, got {seq!r}")
    try:
        values = [strict_index(x) for x in seq]
    except TypeError:
        raise StagedWriteError(f"BlockTables: {what} must be integers, got {seq!r}") from None
    if any(x < low for x in values):
        raise StagedWriteError(f"BlockTables: {what} must be >= {low}, got {values}")
    return values


def _int(what: str, value: Any, low: int) -> int:
    try:
        value = strict_index(value)
    except TypeError:
        raise StagedWriteError(f"BlockTables: {what} must be an integer, got {value!r}") from None
    if value < low:
        raise StagedWriteError(f"BlockTables: {what} must be >= {low}, got {value}")
    return value


def _flags(what: str, seq: Any, num_groups: int) -> list[bool]:
    if seq is None:
        return [True] * num_groups
    if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or len(seq) != num_groups:
        raise StagedWriteError(f"BlockTables: {what} must be {num_groups} bools, one per KV-cache group, got {seq!r}")
    if not all(isinstance(x, (bool, np.bool_)) for x in seq):
        raise StagedWriteError(f"BlockTables: {what} must be bools, got {seq!r}")
    return [bool(x) for x in seq]


class TablesLayout:
    """The memory and sizes of one `BlockTables` (`build` checks the arguments and allocates).

    Attributes:
        device: where everything lives; device_index: its `Tensor.get_device()` (-1 on the host).
        block_sizes, kernel_block_sizes: tokens per manager block and per kernel block, per group.
        kernel_blocks_per_block: `block_sizes[g] // kernel_block_sizes[g]` (`k`: id `b` is written as `b*k + j`).
        max_num_blocks_per_group: manager blocks a request may hold, per group.
        widths: cells per row, per group (`max_num_blocks_per_group[g] * k`).
        max_num_reqs: rows of every table.
        storage: the int32 allocation of the tables and `num_blocks`.
        tables: per group the int32 `[max_num_reqs, widths[g]]` table of kernel block ids.
        num_blocks: int32 `[num_groups, max_num_reqs]`: kernel blocks held per request, on the device.
        counts_table: `num_blocks.T`, `[max_num_reqs, num_groups]`: the table each request's counts are written
            into (table `num_groups` of the staging arena).
        input_block_tables: per group the persistent int32 `[max_num_reqs, widths[g]]` gather output.
        slot_mappings: the persistent int64 `[num_groups, max_num_batched_tokens]`, or None without
            `max_num_batched_tokens`.
        outputs_storage: the int64 allocation `input_block_tables` (as int32) and `slot_mappings` are views of.
        max_num_batched_tokens, cp_size, cp_rank, cp_interleave: as given (context parallelism: 1, 0, 1 without).
        slot_mapping_enabled: per group, whether its tokens get slots (False: its slot mappings are all PAD).
        dcp_sharded: per group, whether context parallelism shards its KV cache (False: every rank stores every
            token, mapped from the unsharded position).
        sliding_window_reach: per group, the tokens before a request's first scheduled token that attention still
            reads (0: no window); all 0 when `cp_size > 1` (vLLM 0.33 disables the cut there).
        columns: int64 `[max width]` (0, 1, ...), tokens: int64 `[max_num_batched_tokens]` or None: index ranges
            the torch stage reuses.
    """

    device: torch.device
    device_index: int
    block_sizes: list[int]
    kernel_block_sizes: list[int]
    kernel_blocks_per_block: list[int]
    max_num_blocks_per_group: list[int]
    widths: list[int]
    max_num_reqs: int
    max_num_batched_tokens: int | None
    cp_size: int
    cp_rank: int
    cp_interleave: int
    slot_mapping_enabled: list[bool]
    dcp_sharded: list[bool]
    sliding_window_reach: list[int]
    storage: torch.Tensor
    tables: list[torch.Tensor]
    num_blocks: torch.Tensor
    counts_table: torch.Tensor
    input_block_tables: list[torch.Tensor]
    slot_mappings: torch.Tensor | None
    outputs_storage: torch.Tensor
    columns: torch.Tensor
    tokens: torch.Tensor | None

    def __init__(self) -> None:  # use `build`
        self.gathered_views: dict[int, tuple[torch.Tensor, ...]] = {}
        self.slot_views: dict[int, torch.Tensor] = {}

    @classmethod
    def build(
        cls,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_blocks_per_group: Sequence[int],
        device: torch.device,
        kernel_block_sizes: Sequence[int] | None = None,
        max_num_batched_tokens: int | None = None,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        slot_mapping_enabled: Sequence[bool] | None = None,
        dcp_sharded: Sequence[bool] | None = None,
        sliding_window_reach: Sequence[int] | None = None,
    ) -> TablesLayout:
        """Check the sizes and allocate (zeroed; `slot_mappings` all `PAD_SLOT_ID`).

        Raises:
            StagedWriteError: no group, list lengths that differ from the number of groups, a block size not a
                multiple of its kernel block size, sizes that are not positive integers, a row width or row count of
                2**31 or more, `cp_rank` outside `[0, cp_size)`, a block size `cp_interleave` does not divide
                (with `cp_size > 1`, in a group `dcp_sharded` leaves sharded), per-group flags that are not bools or a
                negative reach.
        """
        self = cls()
        num_groups = len(block_sizes) if isinstance(block_sizes, Sequence) else -1
        if num_groups == 0:
            raise StagedWriteError("BlockTables: at least one KV-cache group is needed")
        self.block_sizes = _ints("block_sizes", block_sizes)
        self.kernel_block_sizes = _ints(
            "kernel_block_sizes", block_sizes if kernel_block_sizes is None else kernel_block_sizes
        )
        self.max_num_blocks_per_group = _ints("max_num_blocks_per_group", max_num_blocks_per_group)
        self.max_num_reqs = R = _int("max_num_reqs", max_num_reqs, 1)
        for what, seq in (
            ("max_num_blocks_per_group", self.max_num_blocks_per_group),
            ("kernel_block_sizes", self.kernel_block_sizes),
        ):
            if len(seq) != num_groups:
                raise StagedWriteError(f"BlockTables: {what} has {len(seq)} entries for {num_groups} KV-cache groups")
        self.kernel_blocks_per_block = []
        for g, (bs, kbs) in enumerate(zip(self.block_sizes, self.kernel_block_sizes)):
            if bs % kbs:  # (the wording of `multiwrite.reference.misfit_kernel_block`, which this floor cannot import)
                raise StagedWriteError(
                    f"BlockTables: group {g} block size {bs} is not a positive multiple of its kernel block size {kbs}"
                )
            self.kernel_blocks_per_block.append(bs // kbs)
        self.widths = [m * k for m, k in zip(self.max_num_blocks_per_group, self.kernel_blocks_per_block)]
        for g, w in enumerate(self.widths):
            if w > INT32_MAX:
                raise StagedWriteError(
                    f"BlockTables: group {g} row width {self.max_num_blocks_per_group[g]} blocks x "
                    f"{self.kernel_blocks_per_block[g]} kernel blocks = {w} is past 2**31 - 1"
                )
        if R > INT32_MAX:
            raise StagedWriteError(f"BlockTables: max_num_reqs {R} is past 2**31 - 1")
        self.cp_size = _int("cp_size", cp_size, 1)
        self.cp_rank = _int("cp_rank", cp_rank, 0)
        self.cp_interleave = _int("cp_interleave", cp_interleave, 1)
        if self.cp_rank >= self.cp_size:
            raise StagedWriteError(f"BlockTables: cp_rank {self.cp_rank} is outside [0, cp_size={self.cp_size})")
        self.slot_mapping_enabled = _flags("slot_mapping_enabled", slot_mapping_enabled, num_groups)
        self.dcp_sharded = _flags("dcp_sharded", dcp_sharded, num_groups)
        if self.cp_size > 1:
            for g, bs in enumerate(self.block_sizes):
                if self.dcp_sharded[g] and bs % self.cp_interleave:  # (an unsharded group never uses the interleave)
                    raise StagedWriteError(
                        f"BlockTables: group {g} block size {bs} is not a multiple of cp_interleave "
                        f"{self.cp_interleave} (context parallelism deals whole interleave chunks of a block; a group "
                        "it does not shard, dcp_sharded False, may have any block size)"
                    )
        reach = (
            [0] * num_groups if sliding_window_reach is None else _ints("sliding_window_reach", sliding_window_reach, 0)
        )
        if len(reach) != num_groups:
            raise StagedWriteError(
                f"BlockTables: sliding_window_reach has {len(reach)} entries for {num_groups} KV-cache groups"
            )
        self.sliding_window_reach = [0] * num_groups if self.cp_size > 1 else reach
        self.max_num_batched_tokens = (
            None if max_num_batched_tokens is None else _int("max_num_batched_tokens", max_num_batched_tokens, 1)
        )
        self.device = device
        # `Tensor.get_device()` of a tensor on `device` (-1 on the host): one int compare per input on the hot path.
        self.device_index = -1 if device.type == "cpu" else (0 if device.index is None else device.index)
        widths = self.widths
        # Every table starts on a 128-byte boundary (a kernel may assume 16-byte aligned table addresses, as vLLM's
        # `_load_ptr` does), so the cells between tables are padding.
        offsets = [0]
        for w in widths:
            offsets.append(-(-(offsets[-1] + R * w) // _ALIGN) * _ALIGN)
        self.storage = torch.zeros(offsets[-1] + num_groups * R, dtype=torch.int32, device=device)
        self.tables = [self.storage[offsets[g] : offsets[g] + R * w].view(R, w) for g, w in enumerate(widths)]
        self.num_blocks = self.storage[offsets[-1] :].view(num_groups, R)
        self.counts_table = self.num_blocks.t()
        # The outputs: one int64 allocation, the gathered tables (int32) first, then the slot mappings.
        T = self.max_num_batched_tokens or 0
        half = (offsets[-1] + 1) // 2
        self.outputs_storage = torch.zeros(half + num_groups * T, dtype=torch.int64, device=device)
        gathered = self.outputs_storage[:half].view(torch.int32)
        self.input_block_tables = [gathered[offsets[g] : offsets[g] + R * w].view(R, w) for g, w in enumerate(widths)]
        self.columns = torch.arange(max(widths), device=device)
        if self.max_num_batched_tokens is None:
            self.slot_mappings = self.tokens = None
        else:
            self.slot_mappings = self.outputs_storage[half:].view(num_groups, T)
            self.slot_mappings.fill_(PAD_SLOT_ID)
            self.tokens = torch.arange(T, device=device)
        return self

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups."""
        return len(self.tables)

    def gathered(self, n: int) -> tuple[torch.Tensor, ...]:
        """`input_block_tables[g][:n]` of every group: made once per `n` (views of fixed buffers)."""
        views = self.gathered_views.get(n)
        if views is None:
            views = self.gathered_views[n] = tuple(t[:n] for t in self.input_block_tables)
        return views

    def slots(self, n: int) -> torch.Tensor:
        """`slot_mappings[:, :n]`: made once per `n` (at most 1024 sizes kept)."""
        view = self.slot_views.get(n)
        if view is None:
            assert self.slot_mappings is not None
            if len(self.slot_views) >= _VIEW_CACHE:
                self.slot_views.clear()
            view = self.slot_views[n] = self.slot_mappings[:, :n]
        return view

"""`BlockTables` with vLLM 0.33's constructor, methods and attributes (`vllm/v1/worker/gpu/block_table.py`), over
multiwrite's own `BlockTables`: what `multiwrite.vllm.install()` puts in vLLM's model runner.

Every job runs in the core (`multiwrite.tables.BlockTables`); this class maps vLLM's names onto it. Each call does
what vLLM's does when vLLM's does it: `apply_staged_writes()` applies at once (one launch), the gather and the slot
mappings are launches of their own (docs/vllm.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from multiwrite.errors import BlockTableWriteError, StagedWriteError
from multiwrite.staging.fields import _cstaging
from multiwrite.tables.block_tables import BlockTables as CoreBlockTables


class PyVllmStaging:
    """`append_block_ids` of `BlockTables` where the compiled helper is not built: the Python path alone (the
    compiled one is `_cstaging.VllmStaging`, whose calls it does not take exactly come here too)."""

    def _bind_vllm(self, core: CoreBlockTables | None) -> None:
        """Nothing to bind: every call takes the Python path."""

    def append_block_ids(self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """Stage request row `req_index`'s new block ids (`BlockTables._append_block_ids`)."""
        self._append_block_ids(req_index, new_block_ids, overwrite)  # type: ignore[attr-defined]


#: The base class whose `append_block_ids` is the public one: compiled where the helper is built.
VllmStaging: type = PyVllmStaging if _cstaging is None else _cstaging.VllmStaging
#: The compiled staging of the core, which the compiled `append_block_ids` calls directly when the core uses it.
_COMPILED_APPEND = None if _cstaging is None else _cstaging.BlockIdStaging.append_block_ids


class GroupTable:
    """One KV-cache group's persistent table as vLLM's `StagedWriteTensor` shows it.

    Attributes:
        gpu: int32 `[max_num_reqs, max_num_blocks]` on the tables' device (a fixed address).
    """

    __slots__ = ("gpu",)

    def __init__(self, gpu: torch.Tensor):
        self.gpu = gpu


class BlockCounts:
    """Blocks held per (group, request row), as vLLM's `UvaBackedTensor` shows them.

    Attributes:
        np: host int32 `[num_groups, max_num_reqs]`, as staged (the source of truth).
        cpu: the same memory as a torch tensor.
        gpu: int32 `[num_groups, max_num_reqs]` on the device, as of the last applied batch (a fixed address).
    """

    __slots__ = ("np", "cpu", "gpu")

    def __init__(self, host: np.ndarray, device: torch.Tensor):
        self.np, self.cpu, self.gpu = host, torch.from_numpy(host), device


class BlockTables(VllmStaging):
    """vLLM 0.33's `BlockTables` (same signature, methods and attributes), run by multiwrite (module docstring).

    Args:
        block_sizes: tokens per block of each KV-cache group (vLLM's kernel block sizes).
        max_num_reqs: request rows of every table.
        max_num_batched_tokens: tokens a step may schedule (the width of `slot_mappings`).
        max_num_blocks_per_group: blocks per row, per group.
        device: where the tables live.
        cp_size, cp_rank, cp_interleave: decode context parallelism.
        slot_mapping_enabled: per group whether its tokens get slots (default all True).
        dcp_sharded: per group whether context parallelism shards it (default all True).
        sliding_window_reach: per group the tokens before the first scheduled one attention reads (0: no window;
            ignored when `cp_size > 1`).
        backend: keyword only: force a multiwrite backend by name.
        cuda_graphs: keyword only: multiwrite's graph mode (`commit_staged_writes` before each replay).
        check_addresses: keyword only: the core's (check at every call that no table or output was re-pointed, e.g.
            by `tensor.data = other`); vLLM's runner never passes it: `$MULTIWRITE_CHECK_ADDRESSES=1` turns it on
            there (docs/lifecycle.md).
        defer_apply: keyword only, deprecated and without effect (a DeprecationWarning when given):
            `apply_staged_writes()` always applies at once.

    Attributes:
        As vLLM's: `block_sizes`, `num_kv_cache_groups`, `max_num_reqs`, `max_num_batched_tokens`, `device`,
        `cp_size`, `cp_rank`, `cp_interleave`, `block_tables` (each `.gpu`), `num_blocks` (`.np`, `.cpu`, `.gpu`),
        `input_block_tables`, `slot_mappings` (int64 `[G, max_num_batched_tokens]`), `block_table_ptrs` and
        `input_block_table_ptrs` (uint64 `[G]`), `block_table_strides` (int64), `block_sizes_tensor` (int32),
        `slot_mapping_enabled` and `dcp_sharded` (bool `[G]`), `sliding_window_reach` (int32 `[G]`),
        `has_sliding_window_groups`; and `core`, the multiwrite `BlockTables` (None without groups).

    Raises:
        StagedWriteError: sizes that do not fit together; BackendUnavailableError: no backend for `device`;
        ValueError: `$MULTIWRITE_CHECK_ADDRESSES` neither on nor off.
    """

    #: True on an instance: every staged id lands as the null block 0 (vLLM's elastic-EP warmup sets it).
    redirect_writes_to_null_block = False

    def __init__(
        self,
        block_sizes: list[int],
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_num_blocks_per_group: list[int],
        device: torch.device,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        slot_mapping_enabled: list[bool] | None = None,
        dcp_sharded: list[bool] | None = None,
        sliding_window_reach: list[int] | None = None,
        *,
        backend: str | None = None,
        cuda_graphs: bool = False,
        check_addresses: bool = False,
        defer_apply: bool | None = None,
    ):
        if defer_apply is not None:
            warnings.warn(
                "multiwrite.vllm.BlockTables(defer_apply=...) is deprecated and has no effect: apply_staged_writes() "
                "always applies at once, as vLLM's does (the results never depended on it, only the launch count); "
                "drop the argument",
                DeprecationWarning,
                stacklevel=2,
            )
        G = len(block_sizes)
        self.block_sizes = block_sizes
        self.num_kv_cache_groups = G
        self.max_num_reqs, self.max_num_batched_tokens = max_num_reqs, max_num_batched_tokens
        self.device = torch.device(device)
        self.cp_size, self.cp_rank, self.cp_interleave = cp_size, cp_rank, cp_interleave
        for what, seq in (("max_num_blocks_per_group", max_num_blocks_per_group),
                          ("slot_mapping_enabled", slot_mapping_enabled), ("dcp_sharded", dcp_sharded),
                          ("sliding_window_reach", sliding_window_reach)):  # fmt: skip
            if seq is not None and len(seq) != G:
                raise StagedWriteError(f"BlockTables: {what} has {len(seq)} entries for {G} KV-cache groups")
        enabled = [True] * G if slot_mapping_enabled is None else list(slot_mapping_enabled)
        sharded = [True] * G if dcp_sharded is None else list(dcp_sharded)
        reach = [0] * G if sliding_window_reach is None or cp_size > 1 else list(sliding_window_reach)
        self.core: CoreBlockTables | None = None
        if G:
            self.core = CoreBlockTables(
                block_sizes, max_num_reqs, max_num_blocks_per_group, self.device, backend=backend,
                max_num_batched_tokens=max_num_batched_tokens, cp_size=cp_size, cp_rank=cp_rank,
                cp_interleave=cp_interleave, cuda_graphs=cuda_graphs, slot_mapping_enabled=enabled,
                dcp_sharded=sharded, sliding_window_reach=reach, check_addresses=check_addresses,
            )  # fmt: skip
            self._tables = [GroupTable(t.tensor) for t in self.core.block_tables]
            self._counts = BlockCounts(self.core.num_blocks, self.core.num_blocks_device)
            self.input_block_tables = list(self.core.input_block_tables)
            self.slot_mappings = self.core.slot_mappings
        else:
            self._tables, self.input_block_tables = [], []
            empty = np.zeros((0, max_num_reqs), dtype=np.int32)
            self._counts = BlockCounts(empty, torch.zeros((0, max_num_reqs), dtype=torch.int32, device=self.device))
            self.slot_mappings = torch.zeros((0, max_num_batched_tokens), dtype=torch.int64, device=self.device)
        self.dcp_sharded = torch.tensor(sharded, dtype=torch.bool, device=self.device)
        self._enabled, self._reach = enabled, reach
        self.has_sliding_window_groups = any(r > 0 for r in reach)
        self._address_tensors()
        # The common append goes straight into the core's compiled staging, where the core stages through it.
        core = self.core
        self._bind_vllm(core if core is not None and type(core).append_block_ids is _COMPILED_APPEND else None)

    # -- what vLLM reads ------------------------------------------------------------------------------------------
    @property
    def block_tables(self) -> list[GroupTable]:
        """Per group the persistent table (`.gpu`)."""
        return self._tables

    @property
    def num_blocks(self) -> BlockCounts:
        """Blocks per (group, request row): `.np` as staged, `.gpu` as of the last apply."""
        return self._counts

    def init_block_table_layout_tensors(self) -> None:
        """Rebuild the address tensors (`block_table_ptrs`, `block_table_strides`, `block_sizes_tensor`,
        `slot_mapping_enabled`, `sliding_window_reach`, `input_block_table_ptrs`) and rewrite the backend's
        descriptors of the tables (`BlockTables.refresh_layout`), e.g. after vLLM's memory pool slept and woke."""
        if self.core is not None:
            self.core.refresh_layout()
        self._address_tensors()

    def _address_tensors(self) -> None:
        d = self.device
        tables = [t.gpu for t in self._tables]
        self.block_table_ptrs = torch.tensor([t.data_ptr() for t in tables], dtype=torch.uint64, device=d)
        self.block_table_strides = torch.tensor([t.stride(0) for t in tables], dtype=torch.int64, device=d)
        self.block_sizes_tensor = torch.tensor(self.block_sizes, dtype=torch.int32, device=d)
        self.slot_mapping_enabled = torch.tensor(self._enabled, dtype=torch.bool, device=d)
        self.sliding_window_reach = torch.tensor(self._reach, dtype=torch.int32, device=d)
        self.input_block_table_ptrs = torch.tensor(
            [t.data_ptr() for t in self.input_block_tables], dtype=torch.uint64, device=d
        )

    # -- the step -------------------------------------------------------------------------------------------------
    # (`append_block_ids` is `VllmStaging`'s: compiled, the common call straight into the core's staging; every call
    # it does not take exactly comes here)
    def _append_block_ids(self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """Stage request row `req_index`'s new block ids, one list per group (entries past the groups are ignored;
        every id stages as the null block 0 while `redirect_writes_to_null_block` is true); `overwrite`: from column
        0. Counts (`num_blocks.np`) change at once.

        Raises:
            BlockTableWriteError: a write past a row's capacity (naming request, group and capacity), a row outside
                the tables, ids that are not integers; nothing of the call is staged, for any group.
        """
        core = self.core
        if core is None:
            return
        if self.redirect_writes_to_null_block or len(new_block_ids) != self.num_kv_cache_groups:
            new_block_ids = new_block_ids[: self.num_kv_cache_groups]
            if self.redirect_writes_to_null_block:
                new_block_ids = [[0] * len(ids) for ids in new_block_ids]
        try:
            core.append_block_ids(req_index, new_block_ids, overwrite)
        except StagedWriteError as exc:
            raise BlockTableWriteError(f"append_block_ids for request {req_index}: {exc}") from None

    def apply_staged_writes(self) -> None:
        """Apply every group's staged writes and the new counts at once (the core's `apply_staged_writes`: one launch
        on a GPU; graph mode: see `commit_staged_writes`).

        Raises:
            GraphCaptureError: during a CUDA graph capture without graph mode (nothing changed); and the errors of
                the core's `apply_staged_writes`.
        """
        if self.core is not None:
            self.core.apply_staged_writes()

    def gather_block_tables(
        self,
        idx_mapping: torch.Tensor,
        num_reqs_padded: int,
        out: Sequence[torch.Tensor] | None = None,
        out_ptrs: torch.Tensor | None = None,
        num_computed_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """vLLM's gather (the core's `gather_block_tables`): `input_block_tables[g][:num_reqs_padded]` per group, or
        `out[g][:num_reqs_padded]` (`out_ptrs`, their addresses for vLLM's kernel, is not needed).

        Raises:
            StageInputError: bad inputs (nothing gathered).
        """
        core = self.core
        if core is None:
            return ()
        return core.gather_block_tables(idx_mapping, num_reqs_padded, out, num_computed_tokens)

    def get_dummy_block_tables(self, num_reqs: int) -> tuple[torch.Tensor, ...]:
        """Zero the first `num_reqs` rows of `input_block_tables` (and rows a gather left) and return those views."""
        if self.core is None:
            return ()
        return self.core.get_dummy_block_tables(num_reqs)

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM's slot mappings (`multiwrite.tables.BlockTables.compute_slot_mappings`): int64
        `[num_groups, num_tokens_padded]`, a view of `slot_mappings` (or of `out`).

        Raises:
            StageInputError: bad inputs (nothing written).
        """
        core = self.core
        if core is None:
            return (self.slot_mappings if out is None else out)[:, :num_tokens_padded]
        return core.compute_slot_mappings(idx_mapping, query_start_loc, positions, num_tokens_padded, None, out)

    def get_dummy_slot_mappings(self, num_tokens: int) -> torch.Tensor:
        """Fill the whole `slot_mappings` with PAD (-1) and return `slot_mappings[:, :num_tokens]`."""
        if self.core is None:
            return self.slot_mappings[:, :num_tokens]
        return self.core.get_dummy_slot_mappings(num_tokens)

    # -- multiwrite's extras --------------------------------------------------------------------------------------
    def commit_staged_writes(self) -> int:
        """Graph mode (`cuda_graphs=True`): publish the staged batch for the next replay (see the core's)."""
        assert self.core is not None, "commit_staged_writes: no KV-cache groups"
        return self.core.commit_staged_writes()

    def __reduce_ex__(self, protocol: object) -> object:
        """Refused (`copy`, `pickle`), as the core's: the tables own device and staging memory.

        Raises:
            TypeError: always.
        """
        raise TypeError(
            "a multiwrite.vllm.BlockTables cannot be copied or pickled: it owns device tables and staging memory "
            "that kernels read; build a new one with the same arguments instead"
        )

    def __repr__(self) -> str:
        return f"multiwrite.vllm.BlockTables({self.core!r})"

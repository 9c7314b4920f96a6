"""`BlockTables`: one block table per KV-cache group, updated for all groups in one apply."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from multiwrite.backend import Backend
from multiwrite.errors import StagedWriteError
from multiwrite.staging import StagedWriteTensor, StagingArena, _check_expanded_range, _checked_values
from multiwrite.writer import FusedStagedWriter


class BlockTables:
    """The block tables of every KV-cache group of a model, staged on the host, applied in one call.

    Args:
        block_sizes: tokens per KV-cache block, one per group (e.g. `[16, 32, 8]`).
        max_num_reqs: rows of every table (request slots).
        max_num_blocks_per_group: manager blocks a request may hold, per group.
        device: where the tables live.
        kernel_block_sizes: the attention kernel's block size per group (default: `block_sizes`). Group
            `g` expands each block id `b` into the `k = block_sizes[g] // kernel_block_sizes[g]` kernel
            block ids `b*k .. b*k+k-1`.
        backend: force a backend by name or instance (default: the best available for `device`).

    Attributes:
        block_tables: one `StagedWriteTensor` per group; `block_tables[g].tensor` is group `g`'s int32
            table `[max_num_reqs, max_num_blocks_per_group[g] * k_g]` of kernel block ids.
        num_blocks: host int32 numpy array `[num_groups, max_num_reqs]`: kernel blocks held per request
            and group, updated at staging time.
        num_blocks_device: int32 tensor `[num_groups, max_num_reqs]` on `device`: `num_blocks` as of the
            last `apply_staged_writes()` (it travels in the same backend call as the tables).

    Raises:
        StagedWriteError: list lengths that differ from the number of groups, a block size not divisible
            by its kernel block size, non-positive sizes.
    """

    def __init__(
        self,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_blocks_per_group: Sequence[int],
        device: torch.device | str,
        kernel_block_sizes: Sequence[int] | None = None,
        backend: str | Backend | None = None,
    ):
        num_groups = len(block_sizes)
        kernel_block_sizes = list(block_sizes if kernel_block_sizes is None else kernel_block_sizes)
        if num_groups == 0:
            raise StagedWriteError("BlockTables: at least one KV-cache group is needed")
        for what, seq in (("max_num_blocks_per_group", max_num_blocks_per_group), ("kernel_block_sizes", kernel_block_sizes)):
            if len(seq) != num_groups:
                raise StagedWriteError(f"BlockTables: {what} has {len(seq)} entries for {num_groups} KV-cache groups")
        if max_num_reqs < 1:
            raise StagedWriteError(f"BlockTables: max_num_reqs must be >= 1, got {max_num_reqs}")
        self.block_sizes = [int(b) for b in block_sizes]
        self.kernel_block_sizes = [int(b) for b in kernel_block_sizes]
        self.max_num_reqs = int(max_num_reqs)
        self.kernel_blocks_per_block: list[int] = []
        for g, (bs, kbs) in enumerate(zip(self.block_sizes, self.kernel_block_sizes)):
            if bs < 1 or kbs < 1 or bs % kbs:
                raise StagedWriteError(
                    f"BlockTables: group {g} block size {bs} is not a positive multiple of its kernel block size {kbs}"
                )
            self.kernel_blocks_per_block.append(bs // kbs)
        self.max_num_blocks_per_group = [int(m) for m in max_num_blocks_per_group]
        self._arena = StagingArena(np.int32)
        self.block_tables = [
            StagedWriteTensor._attach(
                torch.zeros(self.max_num_reqs, m * k, dtype=torch.int32, device=device), f"group {g}", k, self._arena
            )
            for g, (m, k) in enumerate(zip(self.max_num_blocks_per_group, self.kernel_blocks_per_block))
        ]
        self.num_blocks = np.zeros((num_groups, self.max_num_reqs), dtype=np.int32)
        self.num_blocks_device = torch.zeros(num_groups, self.max_num_reqs, dtype=torch.int32, device=device)
        # Staged as one more table of the same apply: row = request, columns = groups (a transposed view).
        self._num_blocks_staged = StagedWriteTensor._attach(self.num_blocks_device.t(), "num_blocks", 1, self._arena)
        self._all = [*self.block_tables, self._num_blocks_staged]
        self._writer = FusedStagedWriter(self.block_tables[0].device, backend)
        self._widths = [t._cols for t in self.block_tables]
        self._groups = list(zip(range(num_groups), self.kernel_blocks_per_block, self._widths))

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups (tables)."""
        return len(self.block_tables)

    @property
    def backend(self) -> Backend:
        """The backend that applies the writes."""
        return self._writer.backend

    @property
    def device(self) -> torch.device:
        """Device of the tables."""
        return self._writer.device

    def __getitem__(self, group: int) -> StagedWriteTensor:
        return self.block_tables[group]

    def append_block_ids(
        self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool
    ) -> None:
        """Stage request `req_index`'s new manager block ids, one list per KV-cache group.

        With `overwrite`, each group's row is rewritten from column 0 (a new request); otherwise the
        kernel block ids go after the row's current `num_blocks` (a running request). A group with no new
        ids stages nothing when appending, and resets the row's count when overwriting.

        Args:
            req_index: the request's row, `0 <= req_index < max_num_reqs`.
            new_block_ids: `num_groups` lists (or 1-D int arrays) of manager block ids `>= 0`.
            overwrite: start at column 0 instead of after the current blocks.

        Raises:
            StagedWriteError: wrong number of groups, row outside the tables, a row that would overflow
                its width, ids that are not integers or whose kernel ids overflow int32. Nothing is
                staged for any group then.
        """
        if len(new_block_ids) != len(self._groups):
            raise StagedWriteError(
                f"append_block_ids: request row {req_index}: got block ids for {len(new_block_ids)} KV-cache "
                f"groups, the tables have {len(self._groups)} (block sizes {self.block_sizes})"
            )
        try:
            req = operator.index(req_index)
        except TypeError:
            raise StagedWriteError(f"append_block_ids: request row {req_index!r} is not an integer") from None
        if not 0 <= req < self.max_num_reqs:
            raise StagedWriteError(
                f"append_block_ids: request row {req} is outside [0, {self.max_num_reqs}) "
                f"(tables of shape ({self.max_num_reqs}, ...))"
            )
        num_blocks = self.num_blocks
        staged = []
        for (g, k, width), ids in zip(self._groups, new_block_ids):
            start = 0 if overwrite else int(num_blocks[g, req])
            table = self.block_tables[g]
            if not len(ids):
                if overwrite:
                    staged.append((g, start, ids, 0))
                continue
            ids, n = _checked_values(ids, np.int32, lambda n, t=table, s=start: t._describe(req, s, n))
            if start + n * k > width:
                raise StagedWriteError(
                    f"{table._describe(req, start, n)}: {n} block ids x {k} kernel blocks end at column "
                    f"{start + n * k}, past the row width {width}"
                )
            if isinstance(ids, np.ndarray):
                if n and ids.min() < 0:
                    raise StagedWriteError(f"{table._describe(req, start, n)}: negative block id {int(ids.min())}")
            elif min(ids) < 0:
                raise StagedWriteError(f"{table._describe(req, start, n)}: negative block id {min(ids)}")
            if k > 1:
                _check_expanded_range(ids, k, np.int32, lambda t=table, s=start, n=n: t._describe(req, s, n))
            staged.append((g, start, ids, n))
        push = self._arena.push
        for g, start, ids, n in staged:
            push(g, req, start, ids, n)
            self.block_tables[g]._num_staged += 1
            num_blocks[g, req] = start + n * self._groups[g][1]
        if staged:
            push(len(self._groups), req, 0, num_blocks[:, req], len(self._groups))
            self._num_blocks_staged._num_staged += 1

    def apply_staged_writes(self) -> None:
        """Apply every group's staged writes and the new `num_blocks` in one `FusedStagedWriter` call.

        On a GPU this enqueues one kernel launch on the current stream and returns without waiting.
        """
        self._writer.apply(self._all)

    def clear_staged_writes(self) -> None:
        """Drop every staged write (the host `num_blocks` keeps the counts already staged)."""
        self._arena.clear()

    def __repr__(self) -> str:
        return (
            f"BlockTables(block_sizes={self.block_sizes}, kernel_block_sizes={self.kernel_block_sizes}, "
            f"max_num_reqs={self.max_num_reqs}, widths={self._widths}, device={self.device}, "
            f"backend={self.backend.NAME!r})"
        )

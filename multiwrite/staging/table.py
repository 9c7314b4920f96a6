"""`StagedWriteTensor`: a 2-D device table whose row writes are staged on the host and applied in one batch.

A staged write is `(row, start, values)`: it will set `tensor[row, start:start + len(values) * k]`, where each
value `v` becomes the `k` values `v * k + j` (`k` is `kernel_blocks_per_block`, 1 for a plain table). The
expansion happens here, at staging time, so backends write values exactly as staged. Writes wait in a
`StagingArena` until a `FusedStagedWriter` (or a `BlockTables`) applies them; one arena may serve several tables
of one dtype, so that all the KV-cache groups of a `BlockTables` are packed in staging order.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from multiwrite.errors import StagedWriteError
from multiwrite.staging.arena import StagingArena
from multiwrite.staging.layout import (
    INT32_MAX,
    META_LENGTH,
    META_ROW,
    META_START,
    META_TABLE,
    SUPPORTED_DTYPES,
    check_device,
    check_dtype,
    describe_write,
    dtype_name,
    shape_text,
    strict_index,
)
from multiwrite.staging.values import check_expanded_range, checked_values, expand_kernel_blocks


class StagedWriteTensor:
    """A 2-D device tensor whose row writes are staged on the host and applied in one batch.

    Args:
        size: `(rows, columns)` of the table, e.g. `(max_num_reqs, max_num_blocks)`; an int `n` makes a
            1-D tensor of `n` elements, staged as `n` rows of one column.
        dtype: `torch.int32` (block tables), `torch.int64` or `torch.float32`.
        device: where `.tensor` lives; writes are applied there by a `FusedStagedWriter`.
        name: how errors name this table (default `"table"`).
        kernel_blocks_per_block: `k`; each staged value `v` is written as the `k` values `v * k + j`,
            `j = 0..k-1` (a KV-cache group whose block size is `k` times the attention kernel's).

    `.tensor` starts zero-filled. Staging never touches it; only an apply does
    (`FusedStagedWriter.apply`, or `multiwrite.apply_writes` for the shared writer of the device).

    Not thread-safe: stage and apply from one thread at a time (staging is a hot path with no lock).

    Raises:
        StagedWriteError: unsupported dtype, a size that is not 1-D or 2-D, `kernel_blocks_per_block < 1`.
        BackendUnavailableError: torch cannot allocate on `device` (e.g. `"cuda"` on a CPU-only build);
            raised before allocating.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: torch.dtype = torch.int32,
        device: torch.device | str = "cpu",
        *,
        name: str = "table",
        kernel_blocks_per_block: int = 1,
    ):
        check_dtype(dtype, f"{name}")
        try:
            shape = (strict_index(size),) if not isinstance(size, Sequence) else tuple(map(strict_index, size))
        except TypeError:
            raise StagedWriteError(f"{name}: size must be integers (rows, columns) or n, got {size!r}") from None
        if len(shape) not in (1, 2) or min(shape) < 0 or max(shape) > INT32_MAX:
            raise StagedWriteError(f"{name}: size must be (rows, columns) or n, each in [0, 2**31), got {size!r}")
        device = check_device(device, name)
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        self._init(tensor, name, kernel_blocks_per_block, StagingArena(SUPPORTED_DTYPES[dtype]))

    @classmethod
    def in_arena(
        cls,
        tensor: torch.Tensor,
        arena: StagingArena,
        *,
        name: str,
        kernel_blocks_per_block: int = 1,
        fixed: str | None = None,
    ) -> StagedWriteTensor:
        """A table over an existing 2-D tensor (or view) that stages into a shared `arena`.

        Args:
            fixed: why `.tensor` can never be replaced (an owner such as `BlockTables` that shares one allocation
                between its tables), or None.
        """
        self = cls.__new__(cls)
        self._init(tensor, name, kernel_blocks_per_block, arena)
        self._fixed = fixed
        return self

    def _init(self, tensor: torch.Tensor, name: str, k: int, arena: StagingArena) -> None:
        try:
            k = operator.index(k)
        except TypeError:
            raise StagedWriteError(f"{name}: kernel_blocks_per_block must be an integer, got {k!r}") from None
        if k < 1:
            raise StagedWriteError(f"{name}: kernel_blocks_per_block must be >= 1, got {k}")
        if k > 1 and tensor.dtype.is_floating_point:
            raise StagedWriteError(
                f"{name}: kernel block expansion (kernel_blocks_per_block={k}) needs an integer table"
            )
        self.name = name
        self.kernel_blocks_per_block = int(k)
        self._user_tensor = tensor
        self._table = tensor if tensor.dim() == 2 else tensor.unsqueeze(1)
        refuse_self_overlap(self._table, name, tensor)
        self._rows, self._cols = self._table.shape
        self._np_dtype = SUPPORTED_DTYPES[tensor.dtype]
        self._fixed: str | None = None  # why `.tensor` cannot be replaced (`in_arena`), or None
        self._arena = arena
        self._index = arena.add_target(self)

    # -- the table ---------------------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        """The device tensor the writes land in, `[rows, columns]` (or `[n]` when built from an int).

        A standalone table may be replaced (`t.tensor = new`, e.g. after growing `max_num_reqs`) or
        resized in place (`t.tensor.resize_(...)`, `set_`): the new tensor must have the same dtype and
        number of dimensions, and every staged write must fit its shape; staging checks the shape
        installed now, and every apply re-checks the staged writes against it (shrunk or grown) before
        writing anything. Replacing raises `StagedWriteError` when that fails, keeping the old tensor.

        A group of a `BlockTables` cannot be replaced (`StagedWriteError`): its tables and `num_blocks`
        share one allocation. A resize or `set_` in place of one is refused at the next apply, before
        anything is written, with the staged writes kept.
        """
        return self._user_tensor

    @tensor.setter
    def tensor(self, new: torch.Tensor) -> None:
        # Replacing the table (for example after growing max_num_reqs) is allowed; writes already staged
        # must still fit, and the backends notice the new storage and never write through a stale pointer.
        if self._fixed is not None:
            raise StagedWriteError(f"{self.name} (shape {shape_text(self.shape)}): {self._fixed}")
        if not isinstance(new, torch.Tensor):
            raise StagedWriteError(f"{self.name}: replacement must be a torch.Tensor, got {type(new).__name__}")
        old = self._table
        if new.dtype != old.dtype or new.dim() != self._user_tensor.dim():
            raise StagedWriteError(
                f"{self.name}: replacement tensor must be {self._user_tensor.dim()}-D {dtype_name(old.dtype)}, "
                f"got {new.dim()}-D {dtype_name(new.dtype)}"
            )
        table = new if new.dim() == 2 else new.unsqueeze(1)
        refuse_self_overlap(table, self.name, new)
        if table.numel() and max(table.shape) > INT32_MAX:
            raise StagedWriteError(f"{self.name}: replacement shape {shape_text(new.shape)} has a size past 2**31 - 1")
        self.check_staged_fit((table.shape[0], table.shape[1]))
        self._user_tensor, self._table = new, table
        self._rows, self._cols = table.shape

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of `.tensor`."""
        return tuple(self._user_tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        """dtype of `.tensor`."""
        return self._table.dtype

    @property
    def device(self) -> torch.device:
        """Device of `.tensor`."""
        return self._table.device

    @property
    def num_staged_writes(self) -> int:
        """Writes staged for this table and not yet applied (empty writes count too)."""
        return self._arena.count_for(self._index)

    @property
    def arena(self) -> StagingArena:
        """The staging arena this table's writes wait in (shared with the other tables of a `BlockTables`)."""
        return self._arena

    @property
    def index(self) -> int:
        """This table's index in its arena's metadata (`META_TABLE`)."""
        return self._index

    def installed_table(self) -> torch.Tensor:
        """The 2-D table as installed now, for an apply: after a `resize_` or `set_` in place, the staged writes are
        checked against the new shape first.

        Raises:
            StagedWriteError: a staged write no longer fits; nothing changed.
        """
        table = self._view()
        if table.shape != (self._rows, self._cols):
            self.check_staged_fit((table.shape[0], table.shape[1]))
            self._rows, self._cols = table.shape
        return table

    def _view(self) -> torch.Tensor:
        """The 2-D table as installed now: a 1-D tensor is staged through a `[n, 1]` view of it, taken again after a
        `resize_` or `set_` of the tensor in place."""
        table, user = self._table, self._user_tensor
        if table is not user and (
            table.shape[0] != user.shape[0] or table.data_ptr() != user.data_ptr() or table.stride(0) != user.stride(0)
        ):
            table = self._table = user.unsqueeze(1)
        return table

    def _describe(self, row: Any, start: Any, length: Any = None) -> str:
        return describe_write(self.name, self._user_tensor.shape, self._table.dtype, row, start, length)

    # -- staging -----------------------------------------------------------------------------------
    def stage_write(self, index: int, start: int, values: Any) -> None:
        """Stage `tensor[index, start:start + len(values) * k] = values` (expanded when `k > 1`).

        Args:
            index: row, `0 <= index < rows`.
            start: first column, `>= 0`.
            values: a list, tuple, 1-D numpy array or 1-D CPU tensor; integers for integer tables.
                Empty values stage a no-op write.

        Raises:
            StagedWriteError: row outside the table, negative start, a write past the row's width, or a
                value the dtype cannot hold. Nothing is staged then.
        """
        if type(index) is not int or type(start) is not int:
            try:
                index, start = strict_index(index), strict_index(start)
            except TypeError as exc:
                raise StagedWriteError(
                    f"{self._describe(index, start)}: row and start must be integers ({exc})"
                ) from None
        # Short int lists are checked value by value by the memoryview stores (bools here); anything else
        # by _checked_values.
        fast = type(values) in (list, tuple) and len(values) <= 8 and self._np_dtype is not np.float32
        if fast:
            n = len(values)
            if bool in map(type, values):
                raise StagedWriteError(f"{self._describe(index, start, n)}: a bool value: stage numbers, not bools")
        else:
            values, n = checked_values(values, self._np_dtype, lambda n: self._describe(index, start, n))
        # The shape installed now (resized or set_ in place since: checked against the new one). The
        # writer re-checks every staged write against it at apply.
        table = self._table if self._table is self._user_tensor else self._view()
        rows, cols = table.shape
        if not 0 <= index < rows:
            raise StagedWriteError(f"{self._describe(index, start, n)}: row {index} is outside [0, {rows})")
        if start < 0:
            raise StagedWriteError(f"{self._describe(index, start, n)}: start is negative")
        k = self.kernel_blocks_per_block
        if start + n * k > cols:
            raise StagedWriteError(
                f"{self._describe(index, start, n)}: ends at column {start + n * k} past the row width {cols}"
                + (f" ({n} values x {k} kernel blocks each)" if k > 1 else "")
            )
        try:
            if k > 1 and n:
                if fast:  # check the values themselves first (type and range), then expand
                    values, _ = checked_values(values, self._np_dtype, lambda n: self._describe(index, start, n))
                check_expanded_range(values, k, self._np_dtype, lambda: self._describe(index, start, n))
                values = expand_kernel_blocks(np.asarray(values, dtype=np.int64), k)
            self._arena.push(self._index, index, start, values, n * k)
        except (OverflowError, TypeError, ValueError) as exc:
            if isinstance(exc, StagedWriteError):
                raise
            # Stores through the memoryview check each value; say which one was wrong, then give up.
            checked_values(values, self._np_dtype, lambda n: self._describe(index, start, n))
            raise StagedWriteError(f"{self._describe(index, start, n)}: {exc}") from None

    def stage_write_elem(self, index: int, value: int | float) -> None:
        """Stage one value at column 0 of row `index` (element `index` of a 1-D tensor).

        Raises:
            StagedWriteError: as `stage_write`.
        """
        self.stage_write(index, 0, (value,))

    def clear_staged_writes(self) -> None:
        """Drop this table's staged writes without applying them."""
        if self.num_staged_writes:
            self._arena.drop_tables([self._index])

    def check_staged_fit(self, shape: tuple[int, int]) -> None:
        """Raise `StagedWriteError` if a staged write of this table would not fit a `shape` table."""
        arena = self._arena
        meta = arena.meta[: arena.num_writes]
        mine = meta[meta[:, META_TABLE] == self._index]
        if not mine.shape[0]:
            return
        ends = mine[:, META_START].astype(np.int64) + mine[:, META_LENGTH]
        bad = np.nonzero((mine[:, META_ROW] >= shape[0]) | (ends > shape[1]))[0]
        if bad.size:
            row, start, length = (int(x) for x in mine[bad[0], [META_ROW, META_START, META_LENGTH]])
            raise StagedWriteError(
                f"{self._describe(row, start, length)}: staged before the table was resized, does not fit "
                f"shape {shape_text(shape if self._user_tensor.dim() == 2 else shape[:1])}; nothing was written "
                "and every staged write stays staged"
            )


def self_overlaps(table: torch.Tensor) -> bool:
    """Whether two distinct cells of the 2-D `table` share memory (`as_strided` views, zero strides; exact: the
    smallest non-zero (row, column) step that returns to one offset fits the shape)."""
    (rows, cols), (s0, s1) = table.shape, table.stride()
    if rows == 0 or cols == 0:
        return False
    if s1 == 1 and s0 >= cols:  # (the common layout: rows of contiguous cells, one after another)
        return False
    s0, s1 = abs(s0), abs(s1)
    if (s0 == 0 and rows > 1) or (s1 == 0 and cols > 1):
        return True
    if s0 == 0 or s1 == 0:
        return False
    g = np.gcd(s0, s1)
    return bool(s1 // g < rows and s0 // g < cols)


def refuse_self_overlap(table: torch.Tensor, name: str, given: torch.Tensor) -> None:
    """Raise `StagedWriteError` naming the table, its shape and strides when its cells overlap in memory: writes to
    distinct cells would hit one address, and no backend orders them (docs/backends.md)."""
    if self_overlaps(table):
        raise StagedWriteError(
            f"{name}: a table whose cells overlap in memory (shape {shape_text(given.shape)}, strides "
            f"{tuple(given.stride())}) is refused: writes to distinct cells would hit one address; stage into a "
            "tensor whose cells are distinct (e.g. .contiguous(), written back by the caller)"
        )

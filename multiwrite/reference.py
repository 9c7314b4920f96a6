"""The plain sequential semantics every backend is checked against.

Nothing here is fast or clever on purpose: one Python loop, one cell at a time, in staging order, on
numpy tables in host memory. It does not share code with the library's staging or backends, so that a
fault there cannot hide in both. It refuses every input the library refuses (`StagedWriteError`, naming
the table, row, start, length and shape), so that a differential test can check the errors too:

- `apply_writes_reference`: writes applied straight into one table.
- `ReferenceStagedTable` and `apply_staged_reference`: `StagedWriteTensor` semantics: writes staged, then
  applied (for any subset of tables, in true staging order across tables, as one `FusedStagedWriter.apply`),
  cleared, or kept when the table is replaced by another of a shape they still fit.
- `ReferenceBlockTables`: `BlockTables` semantics: kernel block expansion, `num_blocks`, apply and clear
  (`misfit_kernel_block`: the check of its block sizes, which `multiwrite replay` makes too).
- `apply_device_writes_reference`: `multiwrite.apply_device_writes` semantics (device-sourced writes, read through
  the fields of each set; bad writes refused with host copies, skipped without).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from multiwrite.errors import StagedWriteError

_sequence = itertools.count()  # staging order across every reference table of the process


def _int(x: Any, what: str) -> int:
    if isinstance(x, (bool, np.bool_)):
        raise StagedWriteError(f"{what} must be an integer, not a bool: {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise StagedWriteError(f"{what} must be an integer, got {x!r}") from None


def _cells(table: np.ndarray, row: int, start: int, values: Sequence, k: int, name: str) -> list[tuple[int, Any]]:
    """The `(column, value)` cells one write sets, after checking it against `table`'s shape and dtype."""
    rows, cols = table.shape
    values = list(values)
    n = len(values)

    def where() -> str:
        return f"{name} (shape {table.shape}, {table.dtype}): write at row {row}, start {start}, length {n}"

    row, start = _int(row, f"{name}: row"), _int(start, f"{name}: start")
    if not 0 <= row < rows:
        raise StagedWriteError(f"{where()}: row {row} is outside [0, {rows})")
    if start < 0:
        raise StagedWriteError(f"{where()}: start is negative")
    if start + n * k > cols:
        raise StagedWriteError(f"{where()}: ends at column {start + n * k} past the row width {cols}")
    cells = []
    col = start
    for v in values:
        for j in range(k):
            x = v * k + j if k > 1 else v
            if table.dtype.kind in "iu":
                if isinstance(x, (float, np.floating)) or not isinstance(x, (int, np.integer)):
                    raise StagedWriteError(f"{where()}: value {v!r} is not an integer")
                info = np.iinfo(table.dtype)
                if not info.min <= int(x) <= info.max:
                    raise StagedWriteError(f"{where()}: value {x} does not fit {table.dtype}")
                x = int(x)
            else:
                x = float(x)
                if np.isfinite(x) and abs(x) > float(np.finfo(table.dtype).max):
                    raise StagedWriteError(f"{where()}: value {x} overflows {table.dtype}")
            cells.append((col, x))
            col += 1
    return cells


def apply_writes_reference(
    table: np.ndarray, writes: Iterable[tuple[int, int, Sequence]], kernel_blocks_per_block: int = 1
) -> np.ndarray:
    """Apply `(row, start, values)` writes to a 2-D numpy `table` in place, one cell at a time, in order.

    Each value `v` fills `kernel_blocks_per_block` (`k`) cells with `v * k + j`; with `k = 1` a value is
    written as it is (rounded to float32 for a float32 table). Returns `table`.

    Raises:
        StagedWriteError: `k < 1`, a row outside the table, a negative start, a write past the row's
            width, a value the table's dtype cannot hold. Writes before the bad one stay written.
    """
    k = _int(kernel_blocks_per_block, "kernel_blocks_per_block")
    if k < 1:
        raise StagedWriteError(f"kernel_blocks_per_block must be >= 1, got {k}")
    for row, start, values in writes:
        for col, x in _cells(table, row, start, values, k, "table"):
            table[row, col] = x
    return table


class ReferenceStagedTable:
    """`StagedWriteTensor` semantics on a numpy `table` (host only).

    Args:
        table: the 2-D numpy array writes land in (a view works: tables may share memory).
        kernel_blocks_per_block: `k`, as in `StagedWriteTensor`.
        name: how errors name it.

    `stage_write` checks against the current table and records the expanded cells with a process-wide
    staging sequence number; `apply_staged_reference` lands them; `clear_staged_writes` drops them;
    `replace(new)` installs another table if every staged write fits it.
    """

    def __init__(self, table: np.ndarray, kernel_blocks_per_block: int = 1, name: str = "table"):
        if table.ndim != 2:
            raise StagedWriteError(f"{name}: a reference table is 2-D, got shape {table.shape}")
        k = _int(kernel_blocks_per_block, f"{name}: kernel_blocks_per_block")
        if k < 1:
            raise StagedWriteError(f"{name}: kernel_blocks_per_block must be >= 1, got {k}")
        if k > 1 and table.dtype.kind == "f":
            raise StagedWriteError(f"{name}: kernel block expansion (k={k}) needs an integer table")
        self.table, self.k, self.name = table, k, name
        self.staged: list[tuple[int, int, int, list[tuple[int, Any]]]] = []  # (sequence, row, start, cells)

    def stage_write(self, row: int, start: int, values: Sequence) -> None:
        """Stage `table[row, start:start + len(values) * k] = values` (expanded); raises like
        `StagedWriteTensor.stage_write` and then stages nothing."""
        cells = _cells(self.table, row, start, values, self.k, self.name)
        self.staged.append((next(_sequence), int(row), int(start), cells))

    @property
    def num_staged_writes(self) -> int:
        """Writes staged and not yet applied (empty ones included)."""
        return len(self.staged)

    def clear_staged_writes(self) -> None:
        """Drop every staged write."""
        self.staged.clear()

    def replace(self, new: np.ndarray) -> None:
        """Install `new` as the table (the `StagedWriteTensor.tensor` setter): refused, keeping the old
        table, unless `new` is 2-D of the same dtype and every staged write fits its shape."""
        if new.ndim != 2 or new.dtype != self.table.dtype:
            raise StagedWriteError(
                f"{self.name}: replacement must be 2-D {self.table.dtype}, got {new.ndim}-D {new.dtype}"
            )
        for _, row, start, cells in self.staged:
            end = start + len(cells)
            if row >= new.shape[0] or end > new.shape[1]:
                raise StagedWriteError(
                    f"{self.name} (shape {self.table.shape}): write at row {row}, start {start}, length "
                    f"{len(cells)}: staged for the old table, does not fit shape {new.shape}"
                )
        self.table = new


def apply_staged_reference(tables: Iterable[ReferenceStagedTable]) -> None:
    """Apply the staged writes of `tables` (any iterable; a table listed twice counts once) in staging
    order across all of them, then clear them: one `FusedStagedWriter.apply`. Where writes touch the
    same cell, also through tables sharing memory, the one staged later wins."""
    chosen = {id(t): t for t in tables}.values()
    writes = sorted((seq, t, row, cells) for t in chosen for seq, row, _, cells in t.staged)
    for _, t, row, cells in writes:
        for col, x in cells:
            t.table[row, col] = x
    for t in chosen:
        t.staged.clear()


def misfit_kernel_block(block_sizes: Sequence[int], kernel_block_sizes: Sequence[int]) -> str | None:
    """What is wrong with the first group whose block size is not a multiple of its kernel block size (`"group 1
    block size 24 is not a positive multiple of its kernel block size 16"`); None when each is (`zip`: the lists'
    common length). The wording `BlockTables` uses too."""
    for g, (b, kb) in enumerate(zip(block_sizes, kernel_block_sizes)):
        if b % kb:
            return f"group {g} block size {b} is not a positive multiple of its kernel block size {kb}"
    return None


class ReferenceBlockTables:
    """`BlockTables` semantics with plain numpy tables and Python loops (host only).

    Same constructor arguments as `BlockTables` minus the device and backend. `append_block_ids` writes
    straight into `tables` (what the real tables hold after the next `apply_staged_writes()`) and
    updates `num_blocks` (the host counts); `apply_staged_writes()` makes that state the applied one
    (`num_blocks_applied`, what `num_blocks_device` holds), and `clear_staged_writes()` restores the
    tables and counts of the last apply, as `BlockTables.clear_staged_writes()` does.

    Raises:
        StagedWriteError: no groups, list lengths that differ, sizes that are not positive integers, a
            block size that is not a positive multiple of its kernel block size (16 with 64 would be
            `k = 0`; 48 with 32 is not a multiple).
    """

    def __init__(
        self,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_blocks_per_group: Sequence[int],
        kernel_block_sizes: Sequence[int] | None = None,
    ):
        block_sizes = [_int(b, "block_sizes") for b in block_sizes]
        kernel = block_sizes if kernel_block_sizes is None else kernel_block_sizes
        kbs = [_int(b, "kernel_block_sizes") for b in kernel]
        widths = [_int(m, "max_num_blocks_per_group") for m in max_num_blocks_per_group]
        max_num_reqs = _int(max_num_reqs, "max_num_reqs")
        if not block_sizes:
            raise StagedWriteError("ReferenceBlockTables: at least one KV-cache group is needed")
        if len(kbs) != len(block_sizes) or len(widths) != len(block_sizes):
            raise StagedWriteError(
                f"ReferenceBlockTables: {len(block_sizes)} block sizes, {len(kbs)} kernel block sizes, "
                f"{len(widths)} max_num_blocks_per_group entries"
            )
        if min(block_sizes + kbs + widths + [max_num_reqs]) < 1:
            raise StagedWriteError(
                f"ReferenceBlockTables: sizes must be >= 1 (block_sizes {block_sizes}, kernel_block_sizes {kbs}, "
                f"max_num_blocks_per_group {widths}, max_num_reqs {max_num_reqs})"
            )
        misfit = misfit_kernel_block(block_sizes, kbs)
        if misfit is not None:
            raise StagedWriteError(f"ReferenceBlockTables: {misfit}")
        self.k = [b // kb for b, kb in zip(block_sizes, kbs)]
        self.max_num_reqs = max_num_reqs
        self.tables = [np.zeros((max_num_reqs, m * k), dtype=np.int64) for m, k in zip(widths, self.k)]
        self.num_blocks = np.zeros((len(block_sizes), max_num_reqs), dtype=np.int64)
        self.num_blocks_applied = self.num_blocks.copy()
        self._applied = [t.copy() for t in self.tables]

    def append_block_ids(self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """Write the expanded ids straight into `tables` and update `num_blocks`; all or nothing.

        Raises:
            StagedWriteError: wrong number of groups, a row outside the tables, a row that would overflow
                its width, ids that are negative, not integers, or whose kernel ids overflow int32.
        """
        req = _int(req_index, "append_block_ids: request row")
        new_block_ids = list(new_block_ids)
        if len(new_block_ids) != len(self.tables):
            raise StagedWriteError(
                f"append_block_ids: request row {req}: block ids for {len(new_block_ids)} KV-cache groups, "
                f"the tables have {len(self.tables)}"
            )
        if not 0 <= req < self.max_num_reqs:
            raise StagedWriteError(f"append_block_ids: request row {req} is outside [0, {self.max_num_reqs})")
        planned = []
        for g, ids in enumerate(new_block_ids):
            ids = list(ids)
            if not ids and not overwrite:
                continue
            start = 0 if overwrite else int(self.num_blocks[g, req])
            for b in ids:
                b = _int(b, f"group {g}: block id")
                if b < 0 or b * self.k[g] + self.k[g] - 1 > 2**31 - 1:
                    raise StagedWriteError(
                        f"group {g} (shape {self.tables[g].shape}): write at row {req}, start {start}, length "
                        f"{len(ids)}: block id {b} is negative or its kernel block ids overflow int32"
                    )
            planned.append((g, start, ids, _cells(self.tables[g], req, start, ids, self.k[g], f"group {g}")))
        for g, start, ids, cells in planned:
            for col, x in cells:
                self.tables[g][req, col] = x
            self.num_blocks[g, req] = start + len(ids) * self.k[g]

    def apply_staged_writes(self) -> None:
        """What `BlockTables.apply_staged_writes()` does to the applied state: everything staged lands."""
        self._applied = [t.copy() for t in self.tables]
        self.num_blocks_applied = self.num_blocks.copy()

    def clear_staged_writes(self) -> None:
        """What `BlockTables.clear_staged_writes()` does: tables and counts as of the last apply."""
        self.tables = [t.copy() for t in self._applied]
        self.num_blocks = self.num_blocks_applied.copy()


#: The slot of a token whose K/V are not stored (padding, or another context-parallel rank's token).
PAD_SLOT_ID = -1


def gather_block_tables_reference(
    tables: Sequence[np.ndarray],
    num_blocks: np.ndarray,
    idx_mapping: Sequence[int],
    num_reqs_padded: int,
    input_block_tables: Sequence[np.ndarray],
    *,
    num_rows: int | None = None,
    num_computed_tokens: Sequence[int] | None = None,
    sliding_window_reach: Sequence[int] | None = None,
    kernel_block_sizes: Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Gather the scheduled requests' rows into batch order, one cell at a time, into `input_block_tables`.

    Batch entry `b < len(idx_mapping)` gets the first `num_blocks[g, idx_mapping[b]]` cells of row
    `idx_mapping[b]` of `tables[g]`; its other cells keep what they held. An entry of -1 (a dummy request) gets a
    zero row. Rows `len(idx_mapping) .. max(num_reqs_padded, num_rows) - 1` become zero. With
    `num_computed_tokens` (per request row) and a group's `sliding_window_reach` `w > 0`, cell `j` of that group
    becomes 0 when the whole kernel block `j` (`kernel_block_sizes[g]` tokens) lies before position
    `num_computed_tokens[row] - w`. Returns `[input_block_tables[g][:num_reqs_padded] for g]`.
    """
    end = max(num_reqs_padded, num_reqs_padded if num_rows is None else num_rows)
    for g, (table, out) in enumerate(zip(tables, input_block_tables)):
        reach = 0 if sliding_window_reach is None else int(sliding_window_reach[g])
        for b in range(end):
            req = int(idx_mapping[b]) if b < len(idx_mapping) else -1
            if req < 0:
                for col in range(out.shape[1]):
                    out[b, col] = 0
                continue
            below = 0
            if num_computed_tokens is not None and reach > 0:
                assert kernel_block_sizes is not None
                below = max(int(num_computed_tokens[req]) - reach, 0) // int(kernel_block_sizes[g])
            for col in range(int(num_blocks[g, req])):
                out[b, col] = 0 if col < below else table[req, col]
    return [out[:num_reqs_padded] for out in input_block_tables]


def compute_slot_mappings_reference(
    tables: Sequence[np.ndarray],
    kernel_block_sizes: Sequence[int],
    idx_mapping: Sequence[int],
    query_start_loc: Sequence[int],
    positions: Sequence[int],
    num_tokens_padded: int,
    is_padding: Sequence[bool] | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    *,
    slot_mapping_enabled: Sequence[bool] | None = None,
    dcp_sharded: Sequence[bool] | None = None,
) -> np.ndarray:
    """Slot of every token in the KV cache of every group: int64 `[num_groups, num_tokens_padded]`.

    Token `i` in `[query_start_loc[b], query_start_loc[b + 1])` belongs to batch entry `b` (request row
    `idx_mapping[b]`) and sits at sequence position `positions[i]`. Under context parallelism the sequence
    is dealt to the `cp_size` ranks in chunks of `cp_interleave` tokens (chunk `c = p // cp_interleave`
    goes to rank `c % cp_size`), and each rank stores the tokens it owns one after another: the owned
    token at position `p` is the rank's local token `j = (c // cp_size) * cp_interleave + p % cp_interleave`
    (with `cp_size == 1`, `j == p`). Its slot is `table[req, j // kbs] * kbs + j % kbs` with the group's
    KERNEL block size `kbs` (the table holds kernel block ids). Tokens another rank owns, tokens whose
    `is_padding` is true, tokens of a dummy request (row -1) and tokens past `query_start_loc[len(idx_mapping)]`
    get `PAD_SLOT_ID`; so does every token of a group whose `slot_mapping_enabled` is False. A group whose
    `dcp_sharded` is False is not dealt: every rank stores every token, `j == p`.

    This is the rank-local token stream written out one token at a time; it equals vLLM's virtual-block
    formula (ownership in manager-block coordinates, vllm-project/vllm PR #51031) whenever the interleave
    divides the manager block size of every sharded group, which `BlockTables` requires.
    """
    out = np.full((len(tables), num_tokens_padded), PAD_SLOT_ID, dtype=np.int64)
    for b in range(len(idx_mapping)):
        req = int(idx_mapping[b])
        if req < 0:
            continue
        for i in range(int(query_start_loc[b]), int(query_start_loc[b + 1])):
            if is_padding is not None and bool(is_padding[i]):
                continue
            p = int(positions[i])
            chunk = p // cp_interleave
            for g, (table, kbs) in enumerate(zip(tables, kernel_block_sizes)):
                if slot_mapping_enabled is not None and not slot_mapping_enabled[g]:
                    continue
                if dcp_sharded is not None and not dcp_sharded[g]:
                    j = p
                elif chunk % cp_size != cp_rank:
                    continue
                else:
                    j = (chunk // cp_size) * cp_interleave + p % cp_interleave
                out[g, i] = int(table[req, j // kbs]) * kbs + j % kbs
    return out


def _elements_at(address: int, count: int, dtype: np.dtype) -> list:
    """`count` elements of `dtype` read from host memory at `address` (an address source of a CPU table)."""
    import ctypes

    if count <= 0:
        return []
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(bytes(raw), dtype=dtype).tolist()


def apply_device_writes_reference(table: np.ndarray, writes: Sequence[Any], skipped: list | None = None) -> np.ndarray:
    """Device-sourced writes (`multiwrite.device_writes.DeviceWrites`, read through their fields) into the 2-D numpy
    `table`, in place, one cell at a time: sets in order, writes in index order (the later wins). Write `i` of a set
    sets `table[rows[i], starts[i] + c] = src[c]` for `c < lengths[i]`, `src` being `values[o_i:]` with
    `o_i = sum(max(lengths[j], 0) for j < i)`, or per row source `i` (its tensor; an address is read from host
    memory, so address sources work for CPU tables only); each value cast to the table's dtype as numpy's `astype`
    (integers wrap, floats truncate toward zero). A bad write (row outside the table, negative start or length, past
    its row, past its values or source tensor): in a set with host copies, `StagedWriteError` naming the set,
    request, row, start, length and shape, raised before any cell is written; in a set without, skipped whole, its
    `(set, request)` appended to `skipped`. Returns `table`.
    """
    rows, cols = table.shape
    plan = []
    for s, w in enumerate(writes):
        r, st, ln = (getattr(w, f).cpu().tolist() for f in ("rows", "starts", "lengths"))
        values = None if w.values is None else w.values.cpu().tolist()
        offset = 0
        for i in range(len(r)):
            if w.values is not None:
                room = len(values) - offset
            elif isinstance(w.sources, (list, tuple)):
                room = int(w.sources[i].numel())
            else:
                room = ln[i]  # an address: nothing tells how far it reaches
            bad = not 0 <= r[i] < rows or st[i] < 0 or ln[i] < 0 or st[i] + ln[i] > cols or ln[i] > room
            if bad and w.host is not None:
                raise StagedWriteError(
                    f"device writes set {s}, request {i}: row {r[i]}, start {st[i]}, length {ln[i]} does not fit the "
                    f"table of shape ({rows}, {cols}) or its values; nothing was written"
                )
            if bad:
                if skipped is not None:
                    skipped.append((s, i))
            else:
                plan.append((w, i, r[i], st[i], ln[i], offset))
            offset += max(ln[i], 0)
    for w, i, row, start, length, offset in plan:
        if w.values is not None:
            src = np.asarray(w.values[offset : offset + length].cpu().numpy())
        elif isinstance(w.sources, (list, tuple)):
            src = w.sources[i][:length].cpu().numpy()
        else:
            np_dtype = np.dtype(str(w.source_dtype).removeprefix("torch."))
            src = np.asarray(_elements_at(int(w.sources[i]), length, np_dtype), dtype=np_dtype)
        cast = src.astype(table.dtype)
        for c in range(length):
            table[row, start + c] = cast[c]
    return table

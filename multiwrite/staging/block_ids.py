"""Staging of block ids: `append_block_ids` and `append_block_ids_batch`, the methods `BlockTables` inherits from
`BlockIdStaging`.

`BlockIdStaging` is `multiwrite.staging._cstaging.BlockIdStaging` (C) where that helper is built, else
`PyBlockIdStaging` below, its exact Python twin: the same checks, the same staged bytes, the same errors. The C
version hands every call it does not take exactly (an unusual type, a bad value, a full arena) to the twin, which
stages it or raises the precise error.

One call stages, for every KV-cache group with new ids (or every group when overwriting), one write of the
expanded kernel block ids (`b` -> `b*k .. b*k+k-1`) into the group's table, then one more write: the request's new
`num_blocks` column, as row `req` of the `[max_num_reqs, num_groups]` view of `num_blocks_device` (table `G` of the
arena), so that the counts land in the same apply. Each (table, row) written is stamped with the arena's batch
number; a second write to one in the same batch marks the batch `may_overlap`. The first change of a row's counts
in a batch saves its counts as of the last landed batch (`staging_applied`), which `clear_staged_writes` restores.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from multiwrite.errors import StagedWriteError
from multiwrite.staging.arena import StagingArena
from multiwrite.staging.fields import CLOCK, _cstaging
from multiwrite.staging.layout import META_COLUMNS, describe_write, strict_index
from multiwrite.staging.values import checked_values, expand_kernel_blocks

_META_BYTES = META_COLUMNS * 4


def overwrite_flag(req_index: object, overwrite: object) -> bool:
    """`overwrite` as a Python bool when it is a `numpy.bool_`; anything else but a bool is refused (a truthy
    string like "no" would overwrite, None would append)."""
    if overwrite is True or overwrite is False:
        return overwrite
    if isinstance(overwrite, np.bool_):
        return bool(overwrite)
    raise StagedWriteError(
        f"append_block_ids: request row {req_index!r}: overwrite must be a bool (True: a new request from column "
        f"0, False: append after the row's blocks), got {overwrite!r} ({type(overwrite).__name__})"
    )


def batch_failure(error: BaseException, index: int, calls: int, req_index: object) -> BaseException:
    """The error to raise when call `index` of an `append_block_ids_batch` of `calls` calls raised `error`: the same
    type, saying which call failed and what stays staged (caused by `error`); `error` itself when its type cannot be
    built from a message."""
    if not isinstance(error, (ValueError, TypeError, OverflowError)):
        return error
    try:
        failure = type(error)(
            f"append_block_ids_batch: call {index} of {calls} (request row {req_index!r:.40}) failed; the {index} "
            f"calls before it stay staged, it and the calls after it were not staged: {error}"
        )
    except Exception:
        return error
    failure.__cause__ = error
    return failure


class PyBlockIdStaging:
    """The staging of block ids in Python: the exact twin of `_cstaging.BlockIdStaging` (module docstring).

    Attributes (set once by `_bind_staging`):
        staging_arena: the `StagingArena` every group stages into.
        staging_num_blocks: int32 `[num_groups, max_num_reqs]`: kernel blocks per request and group, as staged.
        staging_applied: int32 `[num_groups, max_num_reqs]`: a row's counts as of the last landed batch (valid for
            rows whose counts row is stamped with the current batch).
        staging_stamps: int64 `[num_groups + 1, max_num_reqs]`: batch number of the last write per (table, row).
        staging_groups: per group `(k, width, largest id)`: kernel blocks per block, row width in cells, and the
            largest manager id whose kernel ids fit int32.
    """

    __slots__ = ("staging_arena", "staging_num_blocks", "staging_applied", "staging_stamps", "staging_groups")

    def _bind_staging(
        self,
        arena: StagingArena,
        num_blocks: np.ndarray,
        applied: np.ndarray,
        stamps: np.ndarray,
        groups: tuple[tuple[int, int, int], ...],
    ) -> None:
        """The arrays staging writes (once)."""
        self.staging_arena, self.staging_num_blocks, self.staging_applied = arena, num_blocks, applied
        self.staging_stamps, self.staging_groups = stamps, groups

    def append_block_ids(self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """Stage request `req_index`'s new manager block ids, one list per KV-cache group.

        With `overwrite`, each group's row is rewritten from column 0 (a new request in that row); otherwise the
        kernel block ids go after the row's current `num_blocks` (a running request). A group with no new ids
        stages nothing when appending, and resets the row's count to 0 when overwriting. Nothing reaches the
        device until the next apply.

        Args:
            req_index: the request's row, `0 <= req_index < max_num_reqs`.
            new_block_ids: `num_groups` lists (or 1-D int arrays) of manager block ids `>= 0`.
            overwrite: a bool (or `numpy.bool_`): start at column 0 instead of after the current blocks.

        Raises:
            StagedWriteError: wrong number of groups, a row outside the tables, a row that would overflow its
                width (naming request, group and capacity), ids that are not integers or whose kernel ids overflow
                int32, an `overwrite` that is not a bool. Nothing of the call is staged, for any group.
        """
        _stage_block_ids(self, req_index, new_block_ids, overwrite_flag(req_index, overwrite))

    def append_block_ids_batch(
        self,
        req_indices: Sequence[int],
        new_block_ids: Sequence[Sequence[Sequence[int]]],
        overwrite: bool | Sequence[bool],
    ) -> None:
        """Stage a scheduler step's `append_block_ids` calls in one call: `append_block_ids(req_indices[i],
        new_block_ids[i], overwrite[i])` for each `i` in order (or `overwrite` for all when it is one bool).

        Same result as those calls; compiled, it stages them all without a Python call per request.

        Raises:
            StagedWriteError: `req_indices`, `new_block_ids` (and a sequence `overwrite`) differ in length, before
                anything is staged; or a call fails as `append_block_ids` would: the calls before it stay staged,
                that one stages nothing, the ones after it are not made. The error (of the type that call raised,
                caused by it) names the call's position and request row.
        """
        if isinstance(overwrite, (bool, np.bool_)):
            flags: Sequence[object] = [overwrite] * len(req_indices)
        elif isinstance(overwrite, Sequence) and not isinstance(overwrite, (str, bytes)):
            flags = overwrite
        else:
            raise StagedWriteError(
                f"append_block_ids_batch: overwrite must be a bool or one bool per call, got {overwrite!r:.60} "
                f"({type(overwrite).__name__})"
            )
        if not (len(req_indices) == len(new_block_ids) == len(flags)):
            raise StagedWriteError(
                f"append_block_ids_batch: {len(req_indices)} request rows, {len(new_block_ids)} lists of block ids"
                + ("" if flags is not overwrite else f" and {len(flags)} overwrite flags")
                + ": one of each per call; nothing was staged"
            )
        append = self.append_block_ids
        for i, (req, ids, flag) in enumerate(zip(req_indices, new_block_ids, flags)):
            try:
                append(req, ids, flag)
            except Exception as error:
                failure = batch_failure(error, i, len(req_indices), req)
                if failure is error:
                    raise
                raise failure from error


# -- the one staging path of the twin (functions of the staging object: the C type hands them its instances) --
def _stage_block_ids(self: Any, req_index: Any, new_block_ids: Any, overwrite: bool) -> None:
    groups = self.staging_groups
    num_blocks = self.staging_num_blocks
    R = num_blocks.shape[1]
    new_block_ids = _per_group(req_index, new_block_ids, len(groups))
    req = _request_row(req_index, R)
    arena = self.staging_arena
    w = w0 = arena.num_writes
    v = v0 = arena.num_values
    if w + len(groups) + 1 > arena.meta_cap:
        arena.reserve(len(groups) + 1, 0)
    stamps = self.staging_stamps
    batch = arena.batch
    written: list[tuple[int, int]] = []  # (group, new count) per write
    g, start = 0, None  # for errors: the group at hand, its start once known
    try:
        for g, ids in enumerate(new_block_ids):
            n = len(ids)
            k, width, max_id = groups[g]
            cells = n * k
            if n:
                start = 0 if overwrite else int(num_blocks[g, req])
                if start + cells > width:
                    raise StagedWriteError(
                        f"{_describe(self, g, req, start, n)}: {n} block ids x {k} kernel blocks end at column "
                        f"{start + cells}, past the row width {width} (room for {width // k} blocks)"
                    )
                if v + cells > arena.values_cap:
                    arena.reserve(len(groups), v - v0 + cells)
                values = arena.lease.values
                if n <= 8 and type(ids) in (list, tuple):
                    if bool in map(type, ids):
                        raise StagedWriteError(
                            f"{_describe(self, g, req, start, n)}: a bool block id: stage integers, not bools"
                        )
                    low, high = min(ids), max(ids)
                    if low < 0 or high > max_id:
                        _raise_bad_id(self, g, req, start, n, low if low < 0 else high)
                    flat = arena.lease.values_flat
                    if k == 1:
                        for i, b in enumerate(ids, v):
                            flat[i] = b  # checks the type and the int32 range
                    else:
                        i = v
                        for b in ids:
                            b = operator.index(b)  # a numpy scalar times k would wrap in its own dtype
                            for j in range(b * k, b * k + k):
                                flat[i] = j
                                i += 1
                else:
                    ids, n = checked_values(ids, np.int32, _describer(self, g, req, start))
                    low, high = int(min(ids)), int(max(ids))
                    if low < 0 or high > max_id:
                        _raise_bad_id(self, g, req, start, n, low if low < 0 else high)
                    values[v : v + cells] = expand_kernel_blocks(np.asarray(ids, dtype=np.int64), k)
            elif overwrite:
                start = 0
            else:
                continue
            arena.pack_meta(arena.lease.meta_bytes, w * _META_BYTES, g, req, start, cells, v)  # after a reserve
            w += 1
            v += cells
            written.append((g, start + cells))
    except (TypeError, ValueError, OverflowError) as exc:
        # Nothing of this call stays staged: the counters never moved, no (table, row) was stamped.
        if isinstance(exc, StagedWriteError):
            raise
        describe = _describer(self, g, req, start)
        ids = new_block_ids[g]
        if not hasattr(ids, "__len__"):
            raise StagedWriteError(
                f"{describe(None)}: the block ids of group {g} must be a sequence, got {type(ids).__name__}"
            ) from None
        checked_values(ids, np.int32, describe)  # raises, naming the offending value
        raise StagedWriteError(f"{describe(len(ids))}: {exc}") from None
    if w == w0:
        return
    G = len(groups)
    new_counts = [int(num_blocks[gg, req]) for gg in range(G)]
    for gg, count in written:
        new_counts[gg] = count
    if v + G > arena.values_cap:
        arena.reserve(0, v - v0 + G)
    flat = arena.lease.values_flat
    for i, c in enumerate(new_counts, v):
        flat[i] = c
    arena.pack_meta(arena.lease.meta_bytes, w * _META_BYTES, G, req, 0, G, v)
    w += 1
    v += G
    if CLOCK[0] != arena.uid:
        arena.begin_run()  # another arena staged last: these writes start a run of this one
    # Every check passed: stamp the rows written (overlap detection) and commit.
    overlapped = False
    for gg, _ in written:
        overlapped |= stamps[gg, req] == batch
        stamps[gg, req] = batch
    if stamps[G, req] == batch:
        overlapped = True
    else:  # the row's counts change for the first time in this batch: keep them for clears
        self.staging_applied[:, req] = num_blocks[:, req]
    stamps[G, req] = batch
    for gg, count in written:
        num_blocks[gg, req] = count
    arena.num_writes = w
    arena.num_values = v
    if overlapped:
        arena.may_overlap = True


def _describe(self: Any, g: int, req: Any, start: Any, length: Any = None) -> str:
    width = self.staging_groups[g][1]
    shape = (self.staging_num_blocks.shape[1], width)
    return describe_write(f"group {g}", shape, torch.int32, req, start, length)


def _describer(self: Any, g: int, req: int, start: int | None) -> Callable[[int | None], str]:
    if start is None:  # failed before its start was known: name only what the caller gave
        return lambda n: f"append_block_ids: request row {req}, group {g}" + ("" if n is None else f", {n} block ids")
    return lambda n: _describe(self, g, req, start, n)


def _raise_bad_id(self: Any, g: int, req: int, start: int, n: int, bad: int) -> None:
    k = self.staging_groups[g][0]
    why = (
        "negative" if bad < 0
        else "too large: it does not fit int32" if k == 1
        else f"too large: its {k} kernel block ids overflow int32"
    )  # fmt: skip
    raise StagedWriteError(f"{_describe(self, g, req, start, n)}: block id {bad} is {why}")


def _per_group(req_index: Any, new_block_ids: Any, num_groups: int) -> Sequence[Any]:
    """`new_block_ids` as one sequence per group, or the error naming what was passed."""
    if isinstance(new_block_ids, Mapping):
        raise StagedWriteError(
            f"append_block_ids: request row {req_index!r}: new_block_ids must be one sequence of block ids per "
            f"KV-cache group in group order, got a {type(new_block_ids).__name__} (a dict is not a sequence of "
            "per-group lists: pass [ids of group 0, ids of group 1, ...])"
        )
    if not isinstance(new_block_ids, Sequence):
        try:
            new_block_ids = list(new_block_ids)  # a generator of per-group lists
        except TypeError:
            raise StagedWriteError(
                f"append_block_ids: request row {req_index!r}: new_block_ids must be one sequence of block ids per "
                f"KV-cache group, got {type(new_block_ids).__name__}"
            ) from None
    if len(new_block_ids) != num_groups:
        raise StagedWriteError(
            f"append_block_ids: request row {req_index!r}: got block ids for {len(new_block_ids)} KV-cache groups, "
            f"the tables have {num_groups}"
        )
    return new_block_ids


def _request_row(req_index: Any, max_num_reqs: int) -> int:
    if req_index.__class__ is bool:
        raise StagedWriteError(f"append_block_ids: request row {req_index!r} must be an integer, not a bool")
    try:
        req = strict_index(req_index)
    except TypeError:
        raise StagedWriteError(f"append_block_ids: request row {req_index!r} is not an integer") from None
    if not 0 <= req < max_num_reqs:
        raise StagedWriteError(
            f"append_block_ids: request row {req} is outside [0, {max_num_reqs}) (tables of shape "
            f"({max_num_reqs}, ...))"
        )
    return req


if _cstaging is not None:
    _cstaging.set_fallbacks(PyBlockIdStaging.append_block_ids, PyBlockIdStaging.append_block_ids_batch, batch_failure)
    BlockIdStaging: type = _cstaging.BlockIdStaging
else:  # pragma: no cover - depends on the install
    BlockIdStaging = PyBlockIdStaging

__all__ = ["BlockIdStaging", "PyBlockIdStaging", "batch_failure", "overwrite_flag"]

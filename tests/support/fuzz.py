"""The differential fuzz: random batches on a backend against `multiwrite.reference`."""

from __future__ import annotations

import numpy as np
import torch

from multiwrite.reference import ReferenceBlockTables
from tests.support.tables import host

_FUZZ_DTYPES = [(torch.int32, np.int32), (torch.int64, np.int64), (torch.float32, np.float32)]


class FuzzMismatch(AssertionError):
    """A table differs from the reference, or one side refused what the other accepted."""


def _fuzz_values(rng: np.random.Generator, np_dtype, n: int, k: int) -> list:
    if np_dtype is np.float32:
        return [float(x) for x in rng.normal(0, 1e6, n)]  # rounded to float32 by both sides
    hi = (2**31 - 1 if np_dtype is np.int32 else 2**63 - 1) // k - 1
    if rng.integers(0, 4) == 0:  # extremes
        return [int(x) for x in rng.choice([-hi, hi, 0, 1, -1], n)]
    return [int(x) for x in rng.integers(-min(hi, 10**6), min(hi, 10**6), n)]


def run_fuzz(backend: str, device, batches: int, seed: int, engine_args: bool = False) -> dict[str, int]:
    """Run `batches` random batches on `backend` against `multiwrite.reference`; raise `FuzzMismatch` (naming seed
    and batch) at the first difference. Returns counts of what was exercised.

    One batch = a few random operations, then an apply, then every table compared with the reference: standalone
    `StagedWriteTensor`s of int32, int64 and float32 (some with `k = 2` kernel blocks per block): writes (often on a
    row written before in the same batch, so they overlap; empty ones; some invalid, which both sides must refuse,
    staging nothing), clears, resizes (`t.tensor = new`, or `t.tensor.set_(new)` in place, which both sides must
    accept or refuse alike); applied all together or as a random subset; and one `BlockTables` of two groups: appends,
    overwrites, clears, an apply (or not, this batch). With `engine_args`, applies also take an iterator, list a
    table twice, and include a second table over the memory of the first (writes land in true staging order).
    """
    from multiwrite import BlockTables, FusedStagedWriter, StagedWriteError, StagedWriteTensor
    from multiwrite.reference import ReferenceStagedTable, apply_staged_reference

    rng = np.random.default_rng(seed)
    device = torch.device(device)
    writer = FusedStagedWriter(device, backend)
    stats = dict.fromkeys(["writes", "refused", "clears", "resizes", "set_", "partial", "appends", "bt_clears"], 0)

    def new_table(i: int):
        tdt, ndt = _FUZZ_DTYPES[int(rng.integers(0, 3))]
        k = 2 if ndt is not np.float32 and rng.random() < 0.3 else 1
        shape = (int(rng.integers(1, 6)), int(rng.integers(1, 9)) * k)
        t = StagedWriteTensor(shape, tdt, device, name=f"t{i}", kernel_blocks_per_block=k)
        return t, ReferenceStagedTable(np.zeros(shape, ndt), k, name=f"t{i}")

    pairs = [new_table(i) for i in range(4)]
    if engine_args:  # t4 is a second table over t0's memory
        t0, r0 = pairs[0]
        alias = StagedWriteTensor(t0.shape, t0.dtype, device, name="t4", kernel_blocks_per_block=r0.k)
        alias.tensor = t0.tensor
        pairs.append((alias, ReferenceStagedTable(r0.table, r0.k, name="t4")))
    bt = BlockTables([16, 32], 4, [5, 4], device, kernel_block_sizes=[16, 16], backend=backend)
    ref = ReferenceBlockTables([16, 32], 4, [5, 4], [16, 16])

    def fail(batch: int, what: str) -> None:
        raise FuzzMismatch(f"{backend} seed {seed} batch {batch}: {what}")

    def both(batch: int, lib, mirror, what: str) -> bool:
        """The library's and the reference's side of one operation: both accept or both refuse."""
        try:
            lib()
            lib_ok = True
        except StagedWriteError:
            lib_ok = False
        try:
            mirror()
            ref_ok = True
        except StagedWriteError:
            ref_ok = False
        if lib_ok != ref_ok:
            fail(batch, f"{what}: library {'accepted' if lib_ok else 'refused'}, reference did not")
        return lib_ok

    for b in range(batches):
        if engine_args and rng.random() < 0.2:  # t4 then t0 on one cell of their shared memory: t0 must win
            x, y = _fuzz_values(rng, pairs[0][1].table.dtype.type, 2, pairs[0][1].k)
            for (t, r), v in ((pairs[-1], x), (pairs[0], y)):
                both(b, lambda t=t, v=v: t.stage_write(0, 0, [v]), lambda r=r, v=v: r.stage_write(0, 0, [v]), "clash")
        for _ in range(int(rng.integers(0, 7))):
            op = rng.random()
            i = int(rng.integers(0, len(pairs)))
            t, r = pairs[i]
            rows, cols = r.table.shape
            k = r.k
            if op < 0.55:  # a write: the same row as before often; sometimes invalid
                row = int(rng.integers(0, rows)) if rng.random() < 0.9 else int(rng.choice([-1, rows]))
                n = int(rng.integers(0, cols // k + 1))
                start = int(rng.integers(0, cols - n * k + 1))
                if rng.random() < 0.1:
                    start = int(rng.integers(-1, cols + 1))
                w = (row, start, _fuzz_values(rng, r.table.dtype.type, n, k))
                ok = both(b, lambda t=t, w=w: t.stage_write(*w), lambda r=r, w=w: r.stage_write(*w), f"{t.name}{w}")
                stats["writes" if ok else "refused"] += 1
                if t.num_staged_writes != r.num_staged_writes:
                    fail(b, f"{t.name}: {t.num_staged_writes} staged writes, reference {r.num_staged_writes}")
            elif op < 0.65:
                t.clear_staged_writes()
                r.clear_staged_writes()
                stats["clears"] += 1
            elif op < 0.75 and not (engine_args and i in (0, len(pairs) - 1)):  # resize (not the aliased pair)
                shape = (int(rng.integers(1, 6)), int(rng.integers(1, 9)) * k)
                new = torch.zeros(shape, dtype=t.dtype, device=device)
                h, w_ = min(rows, shape[0]), min(cols, shape[1])
                new[:h, :w_] = t.tensor[:h, :w_]
                mirror_new = np.zeros(shape, r.table.dtype)
                mirror_new[:h, :w_] = r.table[:h, :w_]
                if rng.random() < 0.5:  # in place: the same tensor object moves to the new storage
                    try:  # (staged writes that no longer fit would make the next apply refuse them all: skip)
                        r.replace(mirror_new)
                    except StagedWriteError:
                        continue
                    t.tensor.set_(new)
                    stats["set_"] += 1
                else:

                    def lib_resize(t=t, new=new):
                        t.tensor = new

                    both(b, lib_resize, lambda r=r, m=mirror_new: r.replace(m), f"{t.name}.tensor = new {shape}")
                    stats["resizes"] += 1
            else:  # the block tables
                req = int(rng.integers(0, 4))
                if rng.random() < 0.1:
                    bt.clear_staged_writes()
                    ref.clear_staged_writes()
                    stats["bt_clears"] += 1
                    continue
                overwrite = bool(rng.random() < 0.3)
                ids = tuple([int(x) for x in rng.integers(0, 5000, int(rng.integers(0, 3)))] for _ in range(2))
                if rng.random() < 0.05:
                    ids = ([-1], [])  # refused by both
                call = (req, ids, overwrite)
                both(b, lambda c=call: bt.append_block_ids(*c), lambda c=call: ref.append_block_ids(*c),
                     f"append_block_ids{call}")  # fmt: skip
                stats["appends"] += 1
                if not np.array_equal(bt.num_blocks, ref.num_blocks):
                    fail(b, f"host num_blocks {bt.num_blocks.tolist()} != {ref.num_blocks.tolist()}")
        chosen = [p for p in pairs if rng.random() < 0.6] if rng.random() < 0.3 else list(pairs)
        stats["partial"] += len(chosen) < len(pairs)
        tables = [t for t, _ in chosen]
        if engine_args and tables:
            if rng.random() < 0.3:
                tables = tables + [tables[int(rng.integers(0, len(tables)))]]
            if rng.random() < 0.3:
                tables = iter(tables)
        writer.apply(tables)
        apply_staged_reference([r for _, r in chosen])
        if rng.random() < 0.7:
            bt.apply_staged_writes()
            ref.apply_staged_writes()
            for g in range(2):
                if not np.array_equal(host(bt[g].tensor), ref.tables[g]):
                    fail(b, f"group {g} differs:\n{host(bt[g].tensor)}\n{ref.tables[g]}")
            if not np.array_equal(host(bt.num_blocks_device), ref.num_blocks):
                fail(b, "num_blocks_device differs")
        for t, r in pairs:
            got = host(t.tensor)
            if not np.array_equal(got.view(np.uint8), r.table.view(np.uint8)):  # bit for bit
                fail(b, f"{t.name} {got.shape} {got.dtype} differs:\n{got}\n{r.table}")
            if t.num_staged_writes != r.num_staged_writes:
                fail(b, f"{t.name}: {t.num_staged_writes} staged after apply, reference {r.num_staged_writes}")
    return stats

"""The compiled stage entry's test kit (tests/backends/test_triton_*_entry.py), off a GPU: tables on triton-cuda, run
through Triton's interpreter, whose eager mode builds the entry over a stand-in launcher that records each launch the
entry makes and runs it through the real launcher."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch
import triton.language as tl

from multiwrite import BlockTables
from multiwrite.backends.triton.backend import TritonCudaBackend
from multiwrite.backends.triton.launcher import Launcher
from multiwrite.backends.triton.plan import TritonPlan

CPU = torch.device("cpu")
I32, I64 = torch.int32, torch.int64


class StandInLauncher:
    """What the entry reads of a `Launcher` (`fire`, `launches`), its fast launchers recording `(key, grid0, grid1,
    args)` and running each launch through the real launcher `real` (interpreted) with the key's constants
    (`consts`: key -> compile-time constants). `fails`: raised instead of launching; `fails_after`: raised once the
    launch ran (an interrupt that came after the kernel was issued)."""

    def __init__(self, real: Launcher, consts: dict[tuple, dict], fails: BaseException | None = None):
        self.launches = 0
        self.calls: list[tuple] = []
        self.fails = fails
        self.fails_after: BaseException | None = None
        self.fire = {key: self._fire(real, key, c) for key, c in consts.items()}

    def _fire(self, real: Launcher, key: tuple, consts: dict):
        def fire(grid0, grid1, stream, args):
            assert stream == 0
            if self.fails is not None:
                raise self.fails
            self.calls.append((key, grid0, grid1, args))
            real.launch(key, consts, grid0, grid1, args)
            if self.fails_after is not None:
                raise self.fails_after

        return fire


def stage_stand_in(plan: TritonPlan, fails: BaseException | None = None) -> StandInLauncher:
    """The stand-in of `plan`'s stage kernel launcher, every eager variant bound."""
    return StandInLauncher(plan.device.stage_launcher, {key: plan.constexprs(key) for key in all_keys(plan)}, fails)


def apply_stand_in(plan: TritonPlan) -> StandInLauncher:
    """The stand-in of the apply kernel's launcher (int32 values, both the decode tiles and the others bound, with
    the constants `TritonDevice.launch_apply` gives them)."""
    p = plan.device.params
    consts = {(np.dtype(np.int32).char, decode): {"VALUE_DTYPE": tl.int32, "BLOCK_W": w, "BLOCK_L": cells}
              for decode, w, cells in ((True, p.decode_block_w, p.decode_block_l), (False, p.block_w, p.block_l))}
    return StandInLauncher(plan.device.apply_launcher, consts)


def all_keys(plan: TritonPlan) -> list[tuple]:
    """Every eager variant key of `plan`'s stage kernel (`TritonPlan._stage`'s key, no programmatic dependent launch);
    with writes only where it gathers and maps slots (`prepare`)."""
    cp = (plan.layout.cp_size, plan.layout.cp_interleave)
    out = []
    for idx, qsl, pos, pad, gather, slots, writes, nct, window in itertools.product(
        (I32, I64), (I32, I64), (I32, I64), (False, True), (False, True), (False, True), (False, True), (I32, I64),
        (False, True),
    ):  # fmt: skip
        if not writes or gather and slots:
            out.append((idx, qsl, pos, pad, gather, slots, writes, False, *cp, nct, window))
    return out


def entry_tables(monkeypatch, *args, fails: BaseException | None = None, make: type = BlockTables, **kwargs):
    """`BlockTables(*args, **kwargs)` on triton-cuda (interpreted) whose eager mode builds the compiled entry over a
    `StandInLauncher` (device -1: the CPU tensors' `get_device()`); returns (tables, stand-in of the stage kernel's
    launcher), that of the apply kernel's as the stand-in's `apply`. `make`: the class to build (its `core` taken for
    the core tables where it has one: `multiwrite.vllm.BlockTables`).

    A kernel on a GPU leaves torch's version counters alone; the interpreter writes its outputs through torch ops,
    which move them, so that the preamble would find every table "written since" and send each next call to the
    Python path: after each launch of these tables the guards are given the counters as a GPU launch leaves them."""
    made = []

    def spec(plan):
        stand_in = stage_stand_in(plan, fails)
        stand_in.apply = apply_stand_in(plan)
        made.append(stand_in)
        full = plan.launch_spec()
        return dataclasses.replace(full, launcher=stand_in, device_index=-1, get_device=lambda: -1,
                                   staged=dataclasses.replace(full.staged, apply_launcher=stand_in.apply))  # fmt: skip

    with monkeypatch.context() as patch:
        patch.setattr(TritonPlan, "stage_launch_spec", spec)
        bt = make(*args, backend=TritonCudaBackend(), **kwargs)
    core = getattr(bt, "core", bt)
    assert core._mode.entry is not None
    guards = (core._mode.guard, core._mode.outputs_guard)
    launch = Launcher.launch

    def launch_as_on_a_gpu(self, *a, **kw):
        out = launch(self, *a, **kw)
        for guard in guards:
            guard.version = guard.base._version
        return out

    monkeypatch.setattr(Launcher, "launch", launch_as_on_a_gpu)
    return bt, made[0]


GROUPS = dict(block_sizes=[16, 32, 16], max_num_reqs=6, max_num_blocks_per_group=[8, 4, 8], device=CPU,
              kernel_block_sizes=[16, 16, 8], max_num_batched_tokens=32, sliding_window_reach=[0, 0, 40])  # fmt: skip


def stage_rows(bt: BlockTables, rng: np.random.Generator) -> None:
    for r in range(bt.max_num_reqs):
        # (full rows: every position of a step maps to a block)
        ids = [list(rng.integers(1, 1000, size=w)) for w in GROUPS["max_num_blocks_per_group"]]
        bt.append_block_ids(r, ids, True)
    bt.apply_staged_writes()


def engine_steps(rng: np.random.Generator, n: int):
    """Random engine-shaped steps: (idx, padded, nct, qsl, pos, tokens, pad), dtypes drawn per tensor."""
    for _ in range(n):
        reqs = int(rng.integers(0, 6))
        dt = [I32 if rng.random() < 0.5 else I64 for _ in range(4)]
        rows = rng.choice(6, size=reqs, replace=False)
        if reqs and rng.random() < 0.3:
            rows[0] = -1
        idx = torch.tensor(rows.tolist(), dtype=dt[0])  # (from a list: an empty one has stride (1,), as the entry asks)
        padded = int(rng.integers(reqs, 7))
        nct = torch.tensor(rng.integers(0, 100, size=6).tolist(), dtype=dt[1]) if rng.random() < 0.5 else None
        lens = rng.integers(0, 4, size=reqs)
        qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=dt[2])
        pos = torch.tensor(rng.integers(0, 64, size=int(lens.sum())).tolist(), dtype=dt[3])
        tokens = int(lens.sum()) + int(rng.integers(0, 3))
        pad = torch.tensor((rng.random(tokens) < 0.2).tolist(), dtype=torch.bool) if rng.random() < 0.3 else None
        yield idx, padded, nct, qsl, pos, tokens, pad


WIDTHS = GROUPS["max_num_blocks_per_group"]
#: Kernel blocks per block of each group (`num_blocks` counts kernel blocks).
PER_BLOCK = [b // k for b, k in zip(GROUPS["block_sizes"], GROUPS["kernel_block_sizes"])]


def stage_appends(tables: list[BlockTables], rng: np.random.Generator, overlap: bool, overwrites: float = 0.3) -> None:
    """The same random appends and overwrites into each of `tables` (rows never past their width); `overlap`: one row
    written twice (overlapping writes: the Python path's); `overwrites`: the share of overwrites (whole rows; the
    appends to a full row are empty, which stage nothing)."""
    rows = list(rng.choice(GROUPS["max_num_reqs"], size=int(rng.integers(1, 4)), replace=False))
    if overlap:
        rows.append(rows[0])
    for r in rows:
        # (the row written twice: whole both times, so that neither write is empty, which stages nothing)
        overwrite = rng.random() < overwrites or overlap and r == rows[0]
        counts = tables[0].num_blocks[:, r]
        ids = []
        for g, w in enumerate(WIDTHS):  # (an overwrite writes whole rows: every position of a step keeps its block)
            room = w - int(counts[g]) // PER_BLOCK[g]
            ids.append(list(rng.integers(1, 1000, size=w if overwrite else int(rng.integers(0, room + 1)))))
        for t in tables:
            t.append_block_ids(int(r), ids, overwrite)


def addresses(bt: BlockTables) -> dict[int, str]:
    """The addresses a launch on `bt`'s staged batch passes, named."""
    plan, arena = bt._mode.plan, bt._mode.arena
    lease, ring = arena.lease, arena.lender
    named = {lease.meta_addr: "meta", lease.values_addr: "values", lease.bounds_addr: "bounds", lease.done_addr: "done",
             plan._no_batch[0]: "stage-descriptors", plan._fallback: "fallback",
             plan.desc.addr: "descriptors"}  # fmt: skip
    named.update({a: f"counter[{i}]" for i, a in enumerate(ring.counter_addrs)})
    return named


def ring_state(bt: BlockTables, tokens: bool = True) -> tuple:
    """The slot the arena stages into, the ring's next slot, the writes staged, each slot's (token, launches, whether
    it keeps the tables' descriptors alive)."""
    arena = bt._mode.arena
    ring = arena.lender
    desc = bt._mode.plan.desc
    slots = [(lease.token if tokens else None, lease.launches, lease.keep is desc) for lease in ring.leases]
    return arena.lease.slot, ring.next, arena.num_writes, slots


def pair(monkeypatch):
    """(tables taking the entry, their twin taking the Python path, the stand-in), full rows staged and applied."""
    bt, stand_in = entry_tables(monkeypatch, **GROUPS)
    twin = BlockTables(backend=TritonCudaBackend(), **GROUPS)
    stage_rows(bt, np.random.default_rng(1))
    stage_rows(twin, np.random.default_rng(1))
    return bt, twin, stand_in


def same_results(a, b) -> bool:
    """Two `prepare_inputs` results equal."""
    (ga, sa), (gb, sb) = a, b
    return all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True)) and torch.equal(sa, sb)


def same_tables(bt: BlockTables, twin: BlockTables) -> bool:
    """The group tables and host counts equal."""
    return all(torch.equal(a.tensor, b.tensor) for a, b in zip(bt.block_tables, twin.block_tables)) and np.array_equal(
        bt.num_blocks, twin.num_blocks
    )


def recorder(calls: list):
    """`Launcher.launch`, recording each launch into `calls` as (variant, grid0, grid1, args)."""
    original = Launcher.launch

    def recording(self, variant, consts, grid0, grid1, args, *rest, **kw):
        calls.append((variant, grid0, grid1, args))
        return original(self, variant, consts, grid0, grid1, args, *rest, **kw)

    return recording


def run_both(monkeypatch, bt: BlockTables, twin: BlockTables, launcher: StandInLauncher, call) -> tuple:
    """`call(bt)` (the entry's when it takes it: its launch on the stand-in `launcher`) then `call(twin)` (the Python
    path's, its launches recorded at `Launcher.launch`): the tables and ring state must be equal after. Returns both
    results and the entry's launch (variant, grid0, grid1, args with every address named by `addresses`), checked
    against the twin's last launch, or None when the entry did not take the call."""
    names = [addresses(bt), addresses(twin)]
    calls = len(launcher.calls)
    with monkeypatch.context() as m:
        python: list[tuple] = []
        m.setattr(Launcher, "launch", recorder(python))
        got, want = call(bt), call(twin)
    assert same_tables(bt, twin) and ring_state(bt) == ring_state(twin)
    assert torch.equal(bt.num_blocks_device, twin.num_blocks_device)
    if len(launcher.calls) == calls:
        return got, want, None
    mine, theirs = launcher.calls[-1], python[-1]
    assert len(launcher.calls) == calls + 1 and mine[:3] == theirs[:3]
    named = [tuple(n.get(a, a) for a in args) for n, args in zip(names, (mine[3], theirs[3]))]
    assert named[0] == named[1]
    return got, want, (*mine[:3], named[0])


#: Tables large enough for batches of more writes than one apply tile and more values than the kernels preload.
BIG = dict(GROUPS, block_sizes=[16, 16, 16], kernel_block_sizes=[16, 16, 16], max_num_reqs=12,
           max_num_blocks_per_group=[64, 32, 64])  # fmt: skip


def big_pair(monkeypatch) -> tuple:
    """(`BIG` tables taking the entry, their twin taking the Python path, the stand-in)."""
    bt, stand_in = entry_tables(monkeypatch, **BIG)
    return bt, BlockTables(backend=TritonCudaBackend(), **BIG), stand_in


def stage_whole_rows(tables: list[BlockTables], rows, rng: np.random.Generator) -> None:
    """The same random ids overwriting each of `rows` whole, into each of `tables` (`BIG` widths)."""
    for r in rows:
        ids = [list(rng.integers(1, 1000, size=w)) for w in BIG["max_num_blocks_per_group"]]
        for t in tables:
            t.append_block_ids(r, ids, True)


def staged_pair(monkeypatch) -> tuple:
    """`pair`, then the same appends staged into both (no overlapping writes)."""
    bt, twin, stand_in = pair(monkeypatch)
    stage_appends([bt, twin], np.random.default_rng(5), False)
    assert bt._mode.arena.num_writes and not bt._mode.arena.may_overlap
    return bt, twin, stand_in


def new_entry(bt: BlockTables, stand_in: StandInLauncher, get_device=lambda: -1, staged: bool = True, failure=None,
              spec_changes: dict | None = None, **changes):
    """A new `_cstaging.StageEntry` over `bt`'s mode on the stand-ins, its spec's `get_device`, `spec_changes` and
    the `changes` of its staged part replaced (`staged=False`: none; `failure`: the mode's by default)."""
    from multiwrite.staging.fields import _cstaging

    mode = bt._mode
    spec = mode.plan.launch_spec()
    part = dataclasses.replace(spec.staged, apply_launcher=stand_in.apply, **changes) if staged else None
    spec = dataclasses.replace(spec, launcher=stand_in, device_index=-1, get_device=get_device, staged=part,
                               **(spec_changes or {}))  # fmt: skip
    return _cstaging.StageEntry(mode, mode._countdown, mode.guard, mode.outputs_guard, failure or mode.failure, spec)

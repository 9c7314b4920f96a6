"""The compiled stage entry's test kit (tests/backends/test_triton_*_entry.py), off a GPU: tables on triton-cuda, run
through Triton's interpreter, whose eager mode builds the entry over a stand-in launcher that records each launch the
entry makes and runs it through the real launcher."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from multiwrite import BlockTables
from multiwrite.backends.triton.backend import TritonCudaBackend
from multiwrite.backends.triton.launcher import Launcher
from multiwrite.backends.triton.plan import TritonPlan

CPU = torch.device("cpu")
I32, I64 = torch.int32, torch.int64


class StandInLauncher:
    """What the entry reads of a `Launcher` (`fire`, `launches`), its fast launchers recording `(key, grid0, grid1,
    args)` and running each launch through `plan`'s real launcher (interpreted). `fails`: raised instead of launching;
    `fails_after`: raised once the launch ran (an interrupt that came after the kernel was issued)."""

    def __init__(self, plan: TritonPlan, fails: BaseException | None = None):
        self.launches = 0
        self.calls: list[tuple] = []
        self.fails = fails
        self.fails_after: BaseException | None = None
        real = plan.device.stage_launcher
        self.fire = {}
        for key in all_keys(plan):
            self.fire[key] = self._fire(real, key, plan.constexprs(key))

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


def entry_tables(monkeypatch, *args, fails: BaseException | None = None, **kwargs):
    """`BlockTables(*args, **kwargs)` on triton-cuda (interpreted) whose eager mode builds the compiled entry over a
    `StandInLauncher` (device -1: the CPU tensors' `get_device()`); returns (tables, stand-in).

    A kernel on a GPU leaves torch's version counters alone; the interpreter writes its outputs through torch ops,
    which move them, so that the preamble would find every table "written since" and send each next call to the
    Python path: after each launch of these tables the guards are given the counters as a GPU launch leaves them."""
    made = []

    def spec(plan):
        stand_in = StandInLauncher(plan, fails)
        made.append(stand_in)
        return dataclasses.replace(plan.launch_spec(), launcher=stand_in, device_index=-1, get_device=lambda: -1)

    with monkeypatch.context() as patch:
        patch.setattr(TritonPlan, "stage_launch_spec", spec)
        bt = BlockTables(*args, backend=TritonCudaBackend(), **kwargs)
    assert bt._mode.entry is not None
    guards = (bt._mode.guard, bt._mode.outputs_guard)
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

"""Host time per decode step of vLLM's call pattern on `multiwrite.vllm.BlockTables`, on the CPU (issue 24).

Each step: `append_block_ids` for the requests that get a new block (one in eight), `apply_staged_writes()`,
`gather_block_tables(idx, n)`, `compute_slot_mappings(idx, qsl, pos, n)`, with the inputs on the host (on a CPU every
input is a host input, checked value by value). `--backend null` runs the jobs of a plan that does nothing but land
the staged batch, so that what is timed is multiwrite's Python around the jobs (the preamble) and the staging;
`compiled-cpu` / `torch-cpu` run the real jobs. Figures are per step, best of `--repeat` runs of `--steps` steps; on a
shared machine compare ratios of two runs made together, not absolute numbers.

    PYTHONPATH=$PWD python scripts/preamble_costs.py --groups 3 20 --reqs 40 256 [--backend null] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from multiwrite.plugins.backend import Backend, TablesPlan
from multiwrite.vllm import BlockTables


class _NullPlan(TablesPlan):
    """Jobs that only land the staged batch (no table is written): what remains is multiwrite's own host work."""

    def apply(self) -> None:
        self.arena.land_after(_nothing)

    def stage(self, step) -> None:
        pass


def _nothing(lease) -> None:
    pass


class NullBackend(Backend):
    NAME = "null-preamble"
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def apply(self, batches) -> None:
        pass

    def plan(self, layout, arena) -> TablesPlan:
        return _NullPlan(self, layout, arena)


def build(groups: int, reqs: int, backend: str):
    sizes = [16, 32, 8] if groups == 3 else [16] * groups
    widths = [64] * groups
    chosen = NullBackend() if backend == "null" else backend
    bt = BlockTables(sizes, reqs, 4 * reqs, widths, "cpu", backend=chosen)
    for r in range(reqs):
        bt.append_block_ids(r, [[r % 50 + 1] for _ in range(groups)], True)
    bt.apply_staged_writes()
    idx = torch.arange(reqs, dtype=torch.int32)
    qsl = torch.arange(reqs + 1, dtype=torch.int32)
    pos = torch.full((reqs,), 3, dtype=torch.int64)
    return bt, idx, qsl, pos


def steps(bt, idx, qsl, pos, n: int, groups: int) -> None:
    reqs = idx.shape[0]
    counts = bt.num_blocks.np
    grow = max(1, reqs // 8)
    r0 = 0
    ids = [[7] for _ in range(groups)]
    append, apply = bt.append_block_ids, bt.apply_staged_writes
    gather, slots = bt.gather_block_tables, bt.compute_slot_mappings
    for _ in range(n):
        for j in range(grow):
            r = (r0 + j) % reqs
            append(r, ids, bool(counts[0, r] >= 60))
        r0 += grow
        apply()
        gather(idx, reqs)
        slots(idx, qsl, pos, reqs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, nargs="+", default=[3, 20])
    p.add_argument("--reqs", type=int, nargs="+", default=[40, 256])
    p.add_argument("--backend", default="null")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile one run of each, top 25 by internal time")
    args = p.parse_args()
    torch.set_num_threads(1)
    for g in args.groups:
        for r in args.reqs:
            bt, idx, qsl, pos = build(g, r, args.backend)
            steps(bt, idx, qsl, pos, 50, g)
            best = np.inf
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                steps(bt, idx, qsl, pos, args.steps, g)
                best = min(best, (time.perf_counter() - t0) / args.steps)
            print(f"G{g} C={r} backend={args.backend}: {best * 1e6:.1f} us/step")
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                steps(bt, idx, qsl, pos, args.steps, g)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

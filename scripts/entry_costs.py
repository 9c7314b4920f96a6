"""Host time of the eager calls that apply the staged batch, `prepare_inputs` and `apply_staged_writes` (vLLM's), the
Python path against the compiled entry (`StageEntry.prepare`, `StageEntry.apply`), on a CPU (issue 24): what the entry
saves of the Python around the launch.

Off a GPU the entry is never built, so this stands in for one: the tables are triton-cuda's under Triton's interpreter,
their inputs pass for device tensors (`torch.Tensor.get_device` patched to 0, on both paths alike), and every launch
is a no-op that stores its completion token (the kernel's last act), so that only multiwrite's host work is timed.
Each call has three appends staged (not timed). Medians per call, best of five runs of 2000 calls; compare the two
figures of one run, not absolute numbers.

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python scripts/entry_costs.py [--reqs 40] [--groups 3]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import time

import numpy as np
import torch

import multiwrite.backends.triton.device as triton_device
import multiwrite.backends.triton.launcher as triton_launcher
from multiwrite import BlockTables
from multiwrite.backends.triton.backend import TritonCudaBackend
from multiwrite.backends.triton.plan import TritonPlan
from tests.support.stage_entry import all_keys


def noop(grid0, grid1, stream, args):
    """A launch that does nothing but store its token into its slot's completion word (args 5 and 6)."""
    if args[5]:
        ctypes.c_int32.from_address(args[5]).value = args[6]


class NoopLauncher:
    """A launcher of the entry: every variant in `keys` bound to `noop`."""

    def __init__(self, keys):
        self.launches = 0
        self.fire = dict.fromkeys(keys, noop)


APPLY_KEYS = [(np.dtype(np.int32).char, decode) for decode in (False, True)]


def tables(entry: bool, groups: int, reqs: int) -> BlockTables:
    config = dict(block_sizes=[16] * groups, max_num_reqs=max(reqs, 8), max_num_blocks_per_group=[256] * groups,
                  device=torch.device("cpu"), max_num_batched_tokens=2048)  # fmt: skip
    original = TritonPlan.stage_launch_spec
    if entry:

        def patched(plan):
            full = plan.launch_spec()
            staged = dataclasses.replace(full.staged, apply_launcher=NoopLauncher(APPLY_KEYS))
            return dataclasses.replace(full, launcher=NoopLauncher(all_keys(plan)), device_index=0,
                                       get_device=lambda: 0, get_stream=lambda index: 0, staged=staged)  # fmt: skip

        TritonPlan.stage_launch_spec = patched
    try:
        bt = BlockTables(backend=TritonCudaBackend(), **config)
    finally:
        TritonPlan.stage_launch_spec = original
    assert (bt._mode.entry is not None) == entry
    if not entry:  # (the Python path's launches through the same no-op)
        device = bt._mode.plan.device
        device.stage_launcher.fire.update(dict.fromkeys(all_keys(bt._mode.plan), noop))
        device.apply_launcher.fire.update(dict.fromkeys(APPLY_KEYS, noop))
    bt._mode.layout.device_index, bt._mode._gpu = 0, True  # (inputs "on the device": StepInputs.on_device's path)
    return bt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reqs", type=int, default=40)
    parser.add_argument("--groups", type=int, default=3)
    args = parser.parse_args()
    triton_device.get_device = triton_launcher.get_device = lambda: 0
    triton_device.get_stream = triton_launcher.get_stream = lambda index: 0
    torch.Tensor.get_device = lambda self: 0
    C, G = args.reqs, args.groups
    idx, qsl = torch.arange(C, dtype=torch.int32), torch.arange(C + 1, dtype=torch.int32)
    pos = torch.full((C,), 5, dtype=torch.int64)
    calls = {"prepare_inputs": lambda bt: bt.prepare_inputs(idx, qsl, pos, C, C), "apply_staged_writes":
             lambda bt: bt.apply_staged_writes()}  # fmt: skip
    for call, run in calls.items():
        for name in ("python path", "entry"):
            bt = tables(name == "entry", G, C)
            best = []
            for _ in range(5):
                times = []
                for i in range(2000):
                    for r in range(3):
                        bt.append_block_ids(r, [[i % 1000 + 1]] * G, i % 100 == 0)
                    bt._mode._countdown.restart()  # (the address check never due: the common call)
                    start = time.perf_counter()
                    run(bt)
                    times.append(time.perf_counter() - start)
                best.append(float(np.median(times)) * 1e6)
            print(f"{call}, {name}: {min(best):.2f} us per call (C={C}, {G} groups)")

if __name__ == "__main__":
    main()

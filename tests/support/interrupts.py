"""The scenario of the interrupt tests (a Ctrl-C during an eager apply whose staging slot a queued kernel still
reads), shared by the CPU model (tests/backends/test_triton_interrupts.py) and the GPU run
(tests/gpu/test_interrupts.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from multiwrite import Backend, BlockTables
from multiwrite.reference import ReferenceBlockTables
from tests.support.tables import host


class InterruptedTables:
    """A `BlockTables` of one group (block size 16, `rows` rows of 64 blocks, 8 tokens) on `backend` and its
    reference. `run()` is the call under test: `apply_staged_writes()` (`how="apply"`) or a `prepare_inputs` of one
    token; `land()` applies the reference and keeps its tables as what has landed; `check(what)` calls `sync()` (the
    queued kernels run) and compares the table and `num_blocks_device` with what has landed."""

    def __init__(self, backend: Backend, device, rows: int, how: str, sync: Callable[[], None]):
        self.device = torch.device(device)
        self.bt = BlockTables([16], rows, [64], self.device, backend=backend, max_num_batched_tokens=8)
        self.ref = ReferenceBlockTables([16], rows, [64])
        self.how, self.sync = how, sync
        self.landed: list[np.ndarray] = []
        self.alive: list[tuple] = []  # inputs read by queued launches (a GPU's allocator keeps them for the stream)

    def stage(self, row: int, ids: list[int]) -> None:
        self.bt.append_block_ids(row, (ids,), True)
        self.ref.append_block_ids(row, (ids,), True)

    def run(self) -> None:
        if self.how == "apply":
            self.bt.apply_staged_writes()
        else:
            inputs = tuple(torch.tensor(v, device=self.device) for v in ([0], [0, 1], [0]))
            self.alive.append(inputs)
            self.bt.prepare_inputs(*inputs, 1, 1)

    def land(self) -> None:
        """The reference's apply; `landed`: its tables as of it (`ref.tables` holds what is staged too)."""
        self.ref.apply_staged_writes()
        self.landed[:] = [t.copy() for t in self.ref.tables]

    def check(self, what: str) -> None:
        self.sync()
        np.testing.assert_array_equal(host(self.bt[0].tensor), self.landed[0], err_msg=what)
        np.testing.assert_array_equal(host(self.bt.num_blocks_device), self.ref.num_blocks_applied, err_msg=what)

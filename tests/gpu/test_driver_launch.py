"""The driver launch on a real GPU (`backends/triton/launcher.py`, `driver_launcher`): on NVIDIA the apply and stage
kernels bind it (their parameters as the driver itself reports them), and what it launches equals what the CPU
backend computes: on the current stream, from a fresh thread and on a side stream."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from multiwrite import BlockTables

BLOCK_SIZES, WIDTHS, REQS, TOKENS = [16, 32], [48, 24], 32, 128


def _tables(device):
    return BlockTables(BLOCK_SIZES, REQS, WIDTHS, device, max_num_batched_tokens=TOKENS)


def _steps(seed: int, steps: int):
    """Per step: the writes (row, ids per group, overwrite: every row starts with one) and the batch (idx,
    query_start_loc, positions, each inside the row's blocks of every group)."""
    rng = np.random.default_rng(seed)
    counts = [[0] * len(WIDTHS) for _ in range(REQS)]
    for step in range(steps):
        writes = []
        rows = range(REQS) if step == 0 else rng.choice(REQS, size=int(rng.integers(1, 9)), replace=False).tolist()
        for row in rows:
            overwrite = step == 0 or bool(rng.random() < 0.3)
            ids = []
            for g, w in enumerate(WIDTHS):
                start = 0 if overwrite else counts[row][g]
                n = int(rng.integers(1 if overwrite else 0, min(4, w - start) + 1))
                ids.append(rng.integers(1, 5000, size=n).tolist())
                counts[row][g] = start + n
            writes.append((row, ids, overwrite))
        n = int(rng.integers(1, REQS + 1))
        idx = rng.choice(REQS, size=n, replace=False).tolist()
        lens = rng.integers(1, 4, size=n)
        qsl = [0, *np.cumsum(lens).tolist()]
        reach = [min(c * b for c, b in zip(counts[r], BLOCK_SIZES)) for r in idx]
        pos = [int(rng.integers(0, reach[i])) for i in range(n) for _ in range(int(lens[i]))]
        yield writes, idx, qsl, pos


def _run(bt, device, seed: int, steps: int = 40):
    out = []
    for writes, idx, qsl, pos in _steps(seed, steps):
        for row, ids, overwrite in writes:
            bt.append_block_ids(row, ids, overwrite)
        t = [torch.tensor(v, dtype=torch.int32, device=device) for v in (idx, qsl)]
        p = torch.tensor(pos, dtype=torch.int64, device=device)
        gathered, slots = bt.prepare_inputs(t[0], t[1], p, len(idx), len(pos))
        bt.apply_staged_writes()
        out.append(([g.cpu().clone() for g in gathered], slots.cpu().clone()))
    out.append([t.tensor.cpu().clone() for t in bt.block_tables])
    return out


def _equal(a, b):
    for (ga, sa), (gb, sb) in zip(a[:-1], b[:-1]):
        assert all(torch.equal(x, y) for x, y in zip(ga, gb)) and torch.equal(sa, sb)
    assert all(torch.equal(x, y) for x, y in zip(a[-1], b[-1]))


def test_nvidia_kernels_launch_through_the_driver_and_match_the_cpu(device):
    if torch.version.hip is not None:
        pytest.skip("the driver launch is NVIDIA's (ROCm keeps Triton's launchers)")
    expected = _run(_tables(torch.device("cpu")), torch.device("cpu"), seed=3)
    bt = _tables(device)
    _equal(_run(bt, device, seed=3), expected)
    paths = bt.backend.launch_paths()
    assert f"{device}: apply driver" in paths and ", stage driver" in paths, paths


def test_the_driver_launch_from_a_fresh_thread_and_a_side_stream(device):
    expected = _run(_tables(torch.device("cpu")), torch.device("cpu"), seed=11)
    results, errors = {}, []

    def worker(name, side):
        try:
            bt = _tables(device)
            if side:
                with torch.cuda.stream(torch.cuda.Stream(device)):
                    results[name] = _run(bt, device, seed=11)
            else:
                results[name] = _run(bt, device, seed=11)
        except BaseException as exc:  # (reported by the main thread)
            errors.append(exc)

    for name, side in (("thread", False), ("side-stream", True)):
        t = threading.Thread(target=worker, args=(name, side))
        t.start()
        t.join(120)
    assert not errors, errors
    for name in ("thread", "side-stream"):
        _equal(results[name], expected)

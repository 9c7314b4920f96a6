"""Tables on a second GPU while the first is current, and a process forked after CUDA use."""

from __future__ import annotations

import multiprocessing
import warnings

import numpy as np
import pytest
import torch

from multiwrite import BlockTables
from tests.gpu.helpers import RandomBlockTables, RandomTensors, busy, gpu_backend, warm_up


def test_tables_on_a_second_gpu_with_the_first_current(backend_name):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"one GPU visible (torch.cuda.device_count() = {torch.cuda.device_count()}): no cuda:1")
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    with torch.cuda.device(dev0):
        backend = gpu_backend(backend_name, ring_depth=2)
        warm_up(dev1, backend)
        canary = torch.full((1 << 16,), -7, dtype=torch.int32, device=dev0)
        rng = np.random.default_rng(21)
        rb1, rt1 = RandomBlockTables(dev1, backend, rng), RandomTensors(dev1, backend, rng)
        rb0 = RandomBlockTables(dev0, backend, rng)  # the same backend writes both devices
        with torch.cuda.device(dev1):
            busy(0.2)  # cuda:1's current stream falls behind
        for _ in range(500):
            rb1.step()
            rt1.step()
            rb0.step()
            assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(dev1)
        torch.cuda.synchronize(dev0)
        assert (rb1.mismatches(), rt1.mismatches(), rb0.mismatches()) == (0, 0, 0)
        assert bool((canary == -7).all())
        assert backend.device_state(dev1) is not backend.device_state(dev0)


def _child(conn, inherited: BlockTables, backend_name: str) -> None:
    out = {}
    try:
        inherited.append_block_ids(1, ([5],), overwrite=True)
        inherited.apply_staged_writes()
        out["inherited"] = "applied"
    except Exception as exc:
        out["inherited"] = f"{type(exc).__name__}: {exc}"
    try:
        fresh = BlockTables([16], 2, [4], "cuda", backend=backend_name)
        fresh.append_block_ids(0, ([1],), overwrite=True)
        fresh.apply_staged_writes()
        out["fresh"] = "applied" if fresh[0].tensor[0, 0].item() == 1 else "wrong value"
    except Exception as exc:
        out["fresh"] = f"{type(exc).__name__}: {exc}"
    try:
        cpu = BlockTables([16], 2, [4], "cpu", backend="torch-cpu")
        cpu.append_block_ids(1, ([3, 4],), overwrite=True)
        cpu.apply_staged_writes()
        out["cpu"] = cpu[0].tensor.tolist()
    except Exception as exc:
        out["cpu"] = f"{type(exc).__name__}: {exc}"
    conn.send(out)
    conn.close()


def test_a_child_forked_after_cuda_use_gets_a_clear_error_never_a_hang(device, backend_name):
    bt = BlockTables([16], 2, [4], device, backend=gpu_backend(backend_name))
    bt.append_block_ids(0, ([7],), overwrite=True)
    bt.apply_staged_writes()  # CUDA initialized and our kernel launched in the parent
    torch.cuda.synchronize(device)
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded process, fork() may deadlock"
        child = ctx.Process(target=_child, args=(sender, bt, backend_name), daemon=True)
        child.start()
    sender.close()
    try:
        assert receiver.poll(60), "the forked child hung (no answer in 60 s)"
        out = receiver.recv()
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(10)
    assert out["inherited"].startswith("ForkedCudaError: ") and "'spawn'" in out["inherited"], out
    assert out["fresh"] == "applied" or "fork" in out["fresh"].lower(), out
    assert out["cpu"] == [[0, 0, 0, 0], [3, 4, 0, 0]], out
    assert bt[0].tensor.tolist() == [[7, 0, 0, 0], [0, 0, 0, 0]]  # the parent's tables are untouched

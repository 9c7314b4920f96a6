"""Threads on one GPU: distinct objects on distinct threads at once, one backend, busy streams; and a BlockTables used
for the first time while another thread captures a CUDA graph (torch's default, global capture mode, in which a
synchronizing call anywhere in the process invalidates the capture)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from multiwrite import BlockTables
from tests.gpu.helpers import RandomBlockTables, RandomTensors, busy, count_waits, gpu_backend, warm_up


@pytest.mark.parametrize("num_threads, steps", [(2, 600), (8, 200)])
def test_threads_with_separate_objects_on_one_gpu(device, backend_name, num_threads, steps, monkeypatch):
    backend = gpu_backend(backend_name, ring_depth=2)  # two slots per ring: threads wait for slots often
    warm_up(device, backend)
    waits = count_waits(monkeypatch)
    works = [
        (RandomBlockTables(device, backend, np.random.default_rng(100 + i)),
         RandomTensors(device, backend, np.random.default_rng(200 + i), aliasing=i % 2 == 1))
        for i in range(num_threads)
    ]  # fmt: skip
    barrier = threading.Barrier(num_threads + 1, timeout=60)
    errors: list[BaseException] = []

    def body(rb: RandomBlockTables, rt: RandomTensors) -> None:
        try:
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                barrier.wait()
                busy(0.05)  # this thread's stream starts behind: the host runs ahead into the rings
                for it in range(steps):
                    if it % 100 == 50:
                        busy(0.005)
                    rb.step()  # a lent ring of its own
                    if it % 2:
                        rt.step()  # the device's shared ring
            stream.synchronize()
        except BaseException as exc:
            errors.append(exc)

    hog = torch.cuda.Stream(device)
    with torch.cuda.stream(hog):
        busy(0.5)  # another stream kept busy the whole time
    threads = [threading.Thread(target=body, args=w) for w in works]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    torch.cuda.synchronize(device)
    bad = {i: (rb.mismatches(), rt.mismatches()) for i, (rb, rt) in enumerate(works)}
    assert all(v == (0, 0) for v in bad.values()), bad
    assert waits, "no thread ever waited for a staging slot: the slot guard was not exercised"


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager tables", "graph-mode tables"])
def test_first_use_of_block_tables_while_another_thread_captures(device, backend_name, cuda_graphs):
    """Thread A captures a graph in torch's global capture mode; meanwhile thread B builds a BlockTables (its first
    use of the backend on this device: pinned allocations, descriptor copies, compiles) and applies a batch. A's
    capture must stay valid (it ends without error and its replay does exactly its work); B either works (its tables
    exact) or gets a clear error naming the capture, and works once the capture has ended."""
    torch.cuda.synchronize(device)
    x = torch.zeros(1024, device=device)
    graph = torch.cuda.CUDAGraph()
    capturing, b_done = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def capture() -> None:
        try:
            torch.cuda.set_device(device)
            with torch.cuda.graph(graph):
                x.add_(1)
                capturing.set()
                b_done.wait(120)
                x.mul_(3)
            outcome["capture"] = "ok"
        except BaseException as exc:
            outcome["capture"] = f"{type(exc).__name__}: {exc}"
            capturing.set()

    def first_use():
        bt = BlockTables([16, 32], 4, [8, 8], device, [16, 16], backend=gpu_backend(backend_name),
                         cuda_graphs=cuda_graphs)  # fmt: skip
        bt.append_block_ids(2, ([5, 6], [7]), True)
        bt.apply_staged_writes()  # (no synchronization here: in global mode that would break A's capture itself)
        return bt

    a = threading.Thread(target=capture)
    a.start()
    assert capturing.wait(60)
    try:
        bt = first_use()
        outcome["b"] = "ok"
    except Exception as exc:
        outcome["b"] = exc
        bt = None
    finally:
        b_done.set()
        a.join(120)
    assert outcome.get("capture") == "ok", f"the other thread's capture broke: {outcome.get('capture')}"
    torch.cuda.synchronize(device)
    graph.replay()
    torch.cuda.synchronize(device)
    assert x[:4].tolist() == [3.0] * 4, "the other thread's graph does not replay exactly its work"
    if bt is None:
        err = outcome["b"]
        assert "captur" in str(err).lower(), f"an unclear error: {type(err).__name__}: {err}"
        bt = first_use()  # and it works once the capture has ended
    assert bt[0].tensor[2, :2].tolist() == [5, 6] and bt[1].tensor[2, :2].tolist() == [14, 15]
    assert bt.num_blocks_device[:, 2].tolist() == [2, 2]

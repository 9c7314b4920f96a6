"""Distinct objects on distinct threads at once on one GPU, one backend, under busy streams (issue 8, fault 2)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from .gpu_helpers import RandomBlockTables, RandomTensors, busy, gpu_backend, warm_up


@pytest.mark.parametrize("num_threads, steps", [(2, 600), (8, 200)])
def test_threads_with_separate_objects_on_one_gpu(device, backend_name, num_threads, steps):
    backend = gpu_backend(backend_name, ring_depth=2)  # two slots per ring: threads wait for slots often
    warm_up(device, backend)
    works = [
        (RandomBlockTables(device, backend, np.random.default_rng(100 + i)),
         RandomTensors(device, backend, np.random.default_rng(200 + i)))
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
                busy(0.05)  # this thread's stream starts behind: the host runs ahead into the ring
                for it in range(steps):
                    if it % 100 == 50:
                        busy(0.005)
                    rb.step()  # a lent ring of its own
                    if it % 2:
                        rt.step()  # the writer's shared ring
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
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    torch.cuda.synchronize(device)
    bad = {i: (rb.mismatches(), rt.mismatches()) for i, (rb, rt) in enumerate(works)}
    assert all(v == (0, 0) for v in bad.values()), bad
    assert backend.writer(device).waits > 0  # the slot guard was exercised across threads

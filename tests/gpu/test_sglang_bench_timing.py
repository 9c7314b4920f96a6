"""On a real GPU: `bench --sglang`'s device time is the GPU's execution of a call's work, not the host's time issuing
it (a call that spends long on the host before one tiny kernel must not read as long on the device)."""

from __future__ import annotations

import time

import torch

from multiwrite.bench import sglang as bench


def test_device_time_leaves_the_host_out(device):
    x = torch.zeros(16, device=device)

    def call(i: int) -> None:
        time.sleep(0.02)  # 20 ms on the host, then one tiny kernel
        x.add_(1)

    host, dev = bench._time(call, 6, 1, device, lambda k: None)
    assert host.median_us > 15_000
    # the kernel runs in microseconds; events around an idle stream would read the host's 20 ms
    assert dev is not None and dev.median_us < 5_000
    assert float(x[0]) >= 6.0  # every step ran (retried steps run again)


def test_device_time_counts_the_device_work(device):
    cycles = bench._cycles_per_ms(device)

    def call(i: int) -> None:
        torch.cuda._sleep(int(3 * cycles))  # 3 ms of device work, issued at once

    host, dev = bench._time(call, 4, 1, device, lambda k: None)
    assert dev is not None and 2_500 < dev.median_us < 6_000

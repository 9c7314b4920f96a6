"""On a real GPU: `multiwrite.sglang`'s writers against SGLang 0.5.23's own Triton kernel compiled for the device
(SGLang's files located by `MULTIWRITE_SGLANG_WHEEL` or `MULTIWRITE_SGLANG_SRC`, as in tests/sglang), at SGLang's
batch sizes with prefixes up to 100K, and each of them one kernel launch (counted by torch's profiler).

On a machine without network, after `tox -e sglang` here:
`python -m tests.sglang.oracle extract .tox/sglang/sglang-0.5.23.whl build/sglang0523`, then there
`MULTIWRITE_SGLANG_SRC=build/sglang0523 PYTHONPATH=. python -m pytest -rs tests/gpu/test_sglang.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite.sglang import upstream as upstream_mod


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    if not upstream_mod.configured():
        pytest.skip(upstream_mod.SKIP_REASON)
    return upstream_mod.load_upstream(upstream_mod.locate_sources(tmp_path_factory.mktemp("sglang")))


def _kernels(fn) -> int:
    """CUDA kernels `fn()` launched (torch's profiler; copies and memsets are not kernels)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())  # fmt: skip


def _check_extend(upstream, device, backend_name, rng, bs, rows, width, **batch_options):
    """One random extend batch of `bs` requests into pools of `rows` rows (+1) and `width` columns, written by SGLang's
    kernel and by `write_cache_indices`: the tables must be equal."""
    from multiwrite.sglang import write_cache_indices
    from tests.sglang.batches import extend_batch, random_table

    theirs, ours = upstream.pool(rows, width, device), upstream.pool(rows, width, device)
    theirs.req_to_token.copy_(random_table(rng, rows + 1, width, device))
    ours.req_to_token.copy_(theirs.req_to_token)
    batch = extend_batch(rng, device, bs, rows, width, **batch_options)
    with upstream.active():
        upstream.allocation.write_cache_indices(*batch.args(), theirs)
    write_cache_indices(*batch.args(), ours, backend=backend_name)
    torch.cuda.synchronize()
    assert torch.equal(ours.req_to_token, theirs.req_to_token)


@pytest.mark.parametrize("bs", [1, 32, 256, 1024])
def test_extend_equals_sglangs_triton_kernel_on_the_gpu(upstream, device, backend_name, bs):
    rng = np.random.default_rng(bs)
    for _ in range(20):
        width = int(rng.integers(1, 4096))
        _check_extend(upstream, device, backend_name, rng, bs, bs + 3, width,
                      empty_prefix=upstream.allocation._EMPTY_PREFIX)  # fmt: skip


def test_extend_with_prefixes_up_to_100k_on_the_gpu(upstream, device, backend_name):
    rng = np.random.default_rng(100)
    for _ in range(10):
        bs, width = int(rng.integers(1, 17)), 100_000 + int(rng.integers(0, 2048))
        _check_extend(upstream, device, backend_name, rng, bs, bs, width, max_prefix=100_000)


def test_each_writer_is_one_launch(upstream, device, backend_name):
    from multiwrite.sglang import write_cache_indices, write_decode
    from tests.sglang.batches import extend_batch

    rng = np.random.default_rng(7)
    pool = upstream.pool(256, 2048, device)
    batch = extend_batch(rng, device, 256, 256, 2048)
    write_cache_indices(*batch.args(), pool, backend=backend_name)  # (compiles outside the count)
    assert _kernels(lambda: write_cache_indices(*batch.args(), pool, backend=backend_name)) == 1
    rows = torch.arange(1, 257, device=device)
    locs = torch.randint(0, 2048, (256,), device=device)
    slots = torch.randint(0, 2**31 - 1, (256,), device=device)
    write_decode(pool, rows, locs, slots, backend=backend_name)
    assert _kernels(lambda: write_decode(pool, rows, locs, slots, backend=backend_name)) == 1
    expected = pool.req_to_token.clone()
    expected[rows, locs] = slots.to(torch.int32)
    assert torch.equal(pool.req_to_token, expected)  # (the same writes again: nothing else changed)


def test_the_registered_decode_equals_sglangs_and_its_write_is_one_launch(upstream, device):
    from multiwrite.sglang import install, uninstall
    from tests.sglang.oracle import decode_batch

    rng = np.random.default_rng(8)
    rows = rng.choice(np.arange(1, 1025), size=1024, replace=False).tolist()
    seq = rng.integers(1, 4000, size=1024).tolist()
    slots = torch.from_numpy(rng.integers(1, 2**31 - 1, size=1024)).to(device)
    theirs, ours = upstream.pool(1024, 4096, device), upstream.pool(1024, 4096, device)
    with upstream.active():
        install()
        try:
            a, b = decode_batch(theirs, rows, seq, slots), decode_batch(ours, rows, seq, slots)
            expected = upstream.allocation.alloc_for_decode_default(a, 1)
            got = upstream.allocation.alloc_for_decode(b, 1)  # batch.device is cuda: multiwrite's entry
            torch.cuda.synchronize()
            assert torch.equal(got, expected) and torch.equal(ours.req_to_token, theirs.req_to_token)
            again = decode_batch(ours, rows, seq, slots)
            assert _kernels(lambda: upstream.allocation.alloc_for_decode(again, 1)) == 1
            theirs_again = decode_batch(theirs, rows, seq, slots)
            assert _kernels(lambda: upstream.allocation.alloc_for_decode_default(theirs_again, 1)) >= 2
        finally:
            uninstall()

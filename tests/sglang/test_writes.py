"""`multiwrite.sglang.write_cache_indices` and `write_decode` against SGLang 0.5.23's own writers, loaded from its
wheel (`upstream`): its Triton kernel (through Triton's interpreter on CPU) and its per-request fallback for the
extend, its `alloc_for_decode_default` for the decode, on random batches on every backend; then bad input, refused
naming the request and row with nothing written (no oracle needed)."""

from __future__ import annotations

import os
import re
import types

import numpy as np
import pytest
import torch

from multiwrite.errors import StagedWriteError
from multiwrite.sglang import SglangWriteError, write_cache_indices, write_decode
from multiwrite.sglang.install import alloc_for_decode
from tests.sglang.batches import extend_batch, random_table, scenarios
from tests.sglang.oracle import decode_batch


def _pool_pair(upstream, rng, size, width, device):
    """Two SGLang pools (its own class) holding the same random table: one for SGLang's writer, one for ours."""
    a, b = upstream.pool(size, width, device), upstream.pool(size, width, device)
    a.req_to_token.copy_(random_table(rng, size + 1, width, device))
    b.req_to_token.copy_(a.req_to_token)
    return a, b


def _compare_extend(upstream, sglang_backends, backend, rng, path, bs, size, width, max_prefix=None):
    device = backend.device
    if path == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("SGLang's Triton writer reads CPU tensors only through Triton's interpreter (TRITON_INTERPRET=1, "
                    "which tests/conftest.py sets on a machine without a GPU); its fallback is the oracle here")
    sglang_backends(path)
    theirs, ours = _pool_pair(upstream, rng, size, width, device)
    batch = extend_batch(rng, device, bs, size, width, max_prefix, empty_prefix=upstream.allocation._EMPTY_PREFIX)
    with upstream.active():
        upstream.allocation.write_cache_indices(*batch.args(), theirs)
    write_cache_indices(*batch.args(), ours, backend=backend.name)
    assert torch.equal(ours.req_to_token, theirs.req_to_token), (path, bs, batch.rows_cpu.tolist())


def test_extend_equals_sglangs_triton_writer(upstream, sglang_backends, backend):
    """bs 1-1024 (up to 24 through the interpreter: SGLang's kernel sums the earlier extends in a loop per
    request), the padding row 0 among the rows, empty prefixes and extends, rows filled exactly."""
    rng = np.random.default_rng(25)
    native = backend.device.type == "cuda"
    for _ in range(scenarios(60 if native else 5)):
        bs = int(rng.integers(1, (1024 if native else 24) + 1))
        _compare_extend(upstream, sglang_backends, backend, rng, "triton", bs, bs + int(rng.integers(0, 8)),
                        int(rng.integers(1, 600)))  # fmt: skip


def test_extend_equals_sglangs_fallback_writer(upstream, sglang_backends, backend):
    rng = np.random.default_rng(26)
    for _ in range(scenarios(6)):
        bs = int(rng.choice([1, 2, 32, 256, 1024]))
        _compare_extend(upstream, sglang_backends, backend, rng, "torch_native", bs, bs + 3, int(rng.integers(1, 200)))


@pytest.mark.parametrize("path", ["triton", "torch_native"])
def test_extend_with_prefixes_up_to_100k(upstream, sglang_backends, backend, path):
    rng = np.random.default_rng(27)
    for _ in range(scenarios(2)):
        bs = int(rng.integers(1, 4))
        _compare_extend(upstream, sglang_backends, backend, rng, path, bs, 4, 100_000 + int(rng.integers(0, 600)),
                        max_prefix=100_000)  # fmt: skip


def test_an_empty_batch_writes_nothing(upstream, backend):
    rng = np.random.default_rng(28)
    pool = upstream.pool(3, 8, backend.device)
    pool.req_to_token.copy_(random_table(rng, 4, 8, backend.device))
    before = pool.req_to_token.clone()
    batch = extend_batch(rng, backend.device, 0, 3, 8)
    write_cache_indices(*batch.args(), pool, backend=backend.name)
    assert torch.equal(pool.req_to_token, before)


@pytest.mark.parametrize(("page_size", "encoder"), [(1, False), (16, False), (1, True)])
def test_decode_equals_sglangs_decode_allocation(upstream, backend, page_size, encoder):
    """multiwrite's `alloc_for_decode` and SGLang's `alloc_for_decode_default` on the same stand-in batch: the same
    table, slots, allocator calls (the paged one gets each request's last slot), KV counters and SWA eviction."""
    rng = np.random.default_rng(29 + page_size)
    device = backend.device
    for _ in range(scenarios(4)):
        size, width = int(rng.integers(1, 300)), int(rng.integers(2, 400))
        bs = int(rng.integers(1, size + 2))
        rows = rng.choice(size + 1, size=bs, replace=False).tolist()
        enc = rng.integers(0, width // 2, size=bs).tolist() if encoder else None
        seq = [int(rng.integers(1, width - (enc[i] if enc else 0))) for i in range(bs)]
        slots = torch.from_numpy(rng.integers(1, 2**31 - 1, size=bs)).to(device)
        theirs, ours = _pool_pair(upstream, rng, size, width, device)
        a = decode_batch(theirs, rows, seq, slots, page_size, enc)
        b = decode_batch(ours, rows, seq, slots, page_size, enc)
        with upstream.active():
            expected = upstream.allocation.alloc_for_decode_default(a, 1)
            got = alloc_for_decode(b, 1)
        assert torch.equal(got, expected)
        assert torch.equal(ours.req_to_token, theirs.req_to_token)
        alloc_a, alloc_b = a.tree_cache.token_to_kv_pool_allocator, b.tree_cache.token_to_kv_pool_allocator
        assert [m for m, _ in alloc_b.asked] == [m for m, _ in alloc_a.asked] == [
            "alloc" if page_size == 1 else "alloc_decode"
        ]
        for x, y in zip(alloc_a.asked[0][1], alloc_b.asked[0][1]):
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), alloc_a.asked
        grown = [s + 1 for s in seq]
        assert [r.kv.kv_allocated_len for r in b.reqs] == [r.kv.kv_allocated_len for r in a.reqs] == grown
        assert [r.kv.kv_committed_len for r in b.reqs] == grown
        assert a.evicted == b.evicted == [True]


def test_decode_frees_the_slots_when_the_aux_lengths_fail(upstream, backend):
    """As SGLang's: an error of `alloc_aux_to_lengths` gives the slots back and passes through."""
    pool = upstream.pool(4, 16, backend.device)
    slots = torch.tensor([7, 8], device=backend.device)
    batch = decode_batch(pool, [1, 3], [2, 5], slots)

    def fail(**kwargs):
        raise MemoryError("aux pool full")

    batch.req_to_token_pool = types.SimpleNamespace(req_to_token=pool.req_to_token, alloc_aux_to_lengths=fail)
    with upstream.active(), pytest.raises(MemoryError, match="aux pool full"):
        alloc_for_decode(batch, 1)
    assert batch.tree_cache.token_to_kv_pool_allocator.freed[0] is not None
    assert torch.equal(batch.tree_cache.token_to_kv_pool_allocator.freed[0], slots)
    assert pool.req_to_token[1, 2].item() == 7 and pool.req_to_token[3, 5].item() == 8


@pytest.mark.parametrize("host_copies", [True, False])
def test_write_decode_equals_index_assignment(backend, host_copies):
    """`req_to_token[rows, locs] = slots` as int32 (SGLang's write), the padding row 0 given more than once (the
    later request's slot lands, as CUDA-graph padding writes it)."""
    rng = np.random.default_rng(32)
    device = backend.device
    for _ in range(scenarios(8)):
        size, width = int(rng.integers(1, 2000)), int(rng.integers(1, 300))
        bs = int(rng.integers(1, min(size, 1024) + 1))
        rows = rng.choice(np.arange(1, size + 1), size=bs, replace=False)
        pad = int(rng.integers(0, 3))
        rows = np.concatenate([rows, np.zeros(pad, np.int64)])
        locs = rng.integers(0, width, size=rows.size)
        locs[bs:] = locs[bs] if pad else 0
        slots = rng.integers(1, 2**31 - 1, size=rows.size)
        table = random_table(rng, size + 1, width, device)
        expected = table.clone()
        for r, c, v in zip(rows, locs, slots):
            expected[r, c] = int(v)
        pool = types.SimpleNamespace(req_to_token=table)
        rows_t, locs_t = torch.from_numpy(rows).to(device), torch.from_numpy(locs).to(device)
        host = dict(req_pool_indices_cpu=torch.from_numpy(rows), locs_cpu=torch.from_numpy(locs)) if host_copies else {}
        write_decode(pool, rows_t, locs_t, torch.from_numpy(slots).to(device), backend=backend.name, **host)
        assert torch.equal(table, expected)


# -- bad input: refused, naming the request and its row, nothing written ------------------------------------------
def _pool(rows: int = 4, width: int = 8) -> types.SimpleNamespace:
    return types.SimpleNamespace(req_to_token=torch.arange(rows * width, dtype=torch.int32).reshape(rows, width))


def _extend(pool, rows, prefix, extend, seq=None, out=None, prefix_tensors=None, **kwargs):
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    seq = [p + e for p, e in zip(prefix, extend)] if seq is None else seq
    out = torch.arange(100, 100 + max(sum(extend), 0)) if out is None else out
    if prefix_tensors is None:
        prefix_tensors = [torch.arange(1000, 1000 + max(p, 0)) for p in prefix]
    write_cache_indices(out, t(rows), t(rows), t(prefix), t(prefix), t(seq), t(seq), t(extend), t(extend),
                        prefix_tensors, pool, **kwargs)  # fmt: skip


def _names(message: str, *words: object) -> bool:
    return all(re.search(rf"(?<![\w-]){re.escape(str(w))}(?!\w)", message) for w in words)


BAD_EXTENDS = [
    # (rows, prefix, extend, extra, request index, row, phrase)
    ([1, 2], [2, 3], [1, 6], {}, 1, 2, None),  # length past the row (3 + 6 > 8)
    ([1, 2], [9, 0], [0, 1], {}, 0, 1, None),  # a prefix past the row
    ([1, 4], [1, 1], [1, 1], {}, 1, 4, None),  # a row outside the pool (4 rows)
    ([1, -1], [1, 1], [1, 1], {}, 1, -1, None),  # a negative row
    ([1, 2], [1, 3], [2, -2], {}, 1, 2, None),  # a negative extend length (seq = prefix + extend)
    ([1, 2], [1, 0], [1, 1], {"seq": [2, 3]}, 1, 2, "seq_len 3 != prefix_len 0 + extend_len 1"),
    ([3, 1, 3], [0, 0, 0], [1, 1, 1], {}, 0, 3, "requests 0 and 2 both write row 3"),
]


@pytest.mark.parametrize(("rows", "prefix", "extend", "extra", "req", "row", "phrase"), BAD_EXTENDS)
def test_a_bad_extend_is_refused_naming_the_request_and_row_and_writes_nothing(rows, prefix, extend, extra, req,
                                                                             row, phrase, backend):  # fmt: skip
    pool = _pool()
    before = pool.req_to_token.clone()
    with pytest.raises(SglangWriteError) as info:
        _extend(pool, rows, prefix, extend, backend=backend.name, **extra)
    message = str(info.value)
    assert message.startswith("write_cache_indices"), message
    assert _names(message, req, row), message
    if phrase:
        assert phrase in message
    assert torch.equal(pool.req_to_token, before)


def test_a_negative_prefix_length_is_refused_naming_the_request_and_row():
    pool = _pool()
    before = pool.req_to_token.clone()
    with pytest.raises(SglangWriteError, match=r"request 1 \(row 2\): prefix_tensors\[1\] holds 0 "):
        _extend(pool, [1, 2], [1, -1], [1, 2])
    assert torch.equal(pool.req_to_token, before)


@pytest.mark.parametrize(
    ("tensor", "phrase"),
    [
        (torch.arange(3), "holds 3 torch.int64 ids on cpu, expected prefix_len 2"),
        (torch.arange(2, dtype=torch.int32), "holds 2 torch.int32 ids on cpu, expected prefix_len 2 contiguous int64"),
        (torch.arange(4)[::2], "not contiguous"),
    ],
)
def test_a_prefix_tensor_that_does_not_fit_its_prefix_len_is_refused(tensor, phrase):
    pool = _pool()
    before = pool.req_to_token.clone()
    with pytest.raises(SglangWriteError, match=r"request 1 \(row 2\): prefix_tensors\[1\]") as info:
        _extend(pool, [1, 2], [1, 2], [1, 1], prefix_tensors=[torch.arange(1), tensor])
    assert phrase in str(info.value)
    assert torch.equal(pool.req_to_token, before)


def test_too_few_slots_for_the_extends_are_refused():
    pool = _pool()
    before = pool.req_to_token.clone()
    with pytest.raises(SglangWriteError, match="the extends take 3 slots, out_cache_loc holds 2"):
        _extend(pool, [1, 2], [0, 0], [1, 2], out=torch.arange(2))
    assert torch.equal(pool.req_to_token, before)


def test_host_copies_of_the_wrong_shape_are_refused():
    pool = _pool()
    t = torch.tensor([1, 2])
    with pytest.raises(SglangWriteError, match=r"prefix_lens_cpu has shape \(3,\), expected \(2,\)"):
        write_cache_indices(torch.arange(2), t, t, t, torch.tensor([0, 0, 0]), t, t, t, t,
                            [torch.arange(1), torch.arange(2)], pool)  # fmt: skip


BAD_DECODES = [([1, 4], [0, 0], 1, 4), ([2, 1], [3, 8], 1, 1), ([-1, 1], [0, 0], 0, -1), ([1, 2], [0, -1], 1, 2)]


@pytest.mark.parametrize(("rows", "locs", "req", "row"), BAD_DECODES)
def test_a_bad_decode_write_is_refused_naming_the_request_and_row(rows, locs, req, row, backend):
    pool = _pool()
    before = pool.req_to_token.clone()
    r, c = torch.tensor(rows), torch.tensor(locs)
    with pytest.raises(SglangWriteError) as info:
        write_decode(pool, r, c, torch.tensor([5, 6]), req_pool_indices_cpu=r, locs_cpu=c, backend=backend.name)
    assert str(info.value).startswith("write_decode") and _names(str(info.value), req, row), str(info.value)
    assert torch.equal(pool.req_to_token, before)


@pytest.mark.parametrize(("rows", "locs", "req", "row"), BAD_DECODES)
def test_without_host_copies_a_bad_decode_write_is_skipped_and_recorded(rows, locs, req, row, backend):
    """The device cannot raise: the bad write lands nowhere, the good one lands, the record names the bad one."""
    from multiwrite.device_writes import DeviceWriteFaults

    pool = _pool()
    expected = pool.req_to_token.clone()
    good = 1 - req
    expected[rows[good], locs[good]] = [5, 6][good]
    device = backend.device
    pool.req_to_token = pool.req_to_token.to(device)
    expected = expected.to(device)
    faults = DeviceWriteFaults(device)
    on = {"device": device}
    write_decode(pool, torch.tensor(rows, **on), torch.tensor(locs, **on), torch.tensor([5, 6], **on),
                 backend=backend.name, faults=faults)  # fmt: skip
    assert torch.equal(pool.req_to_token, expected)
    with pytest.raises(StagedWriteError) as info:
        faults.check()
    assert _names(str(info.value), req, row), str(info.value)


def test_decode_slots_that_do_not_match_the_requests_are_refused():
    pool = _pool()
    with pytest.raises(SglangWriteError, match=r"out_cache_loc has shape \(4,\), expected \(2,\)"):
        write_decode(pool, torch.tensor([1, 2]), torch.tensor([0, 0]), torch.arange(4))

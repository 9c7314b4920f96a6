"""SGLang 0.5.23's two page-table writers over `multiwrite.device_writes`: one launch each (docs/sglang.md).

SGLang keeps a request's KV-cache slot of every token in `ReqToTokenPool.req_to_token` (int32
`[size + 1, max_context_len]`, row 0 the padding row). `write_cache_indices` (the extend step) has SGLang's
parameters and writes what SGLang's writes; `write_decode` is the write of SGLang's decode allocation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from multiwrite.device_writes import DeviceWriteFaults, DeviceWrites, HostCopies, apply_device_writes
from multiwrite.errors import StagedWriteError

__all__ = ["SglangWriteError", "write_cache_indices", "write_decode"]


class SglangWriteError(StagedWriteError):
    """A write of `write_cache_indices` or `write_decode` that cannot be applied: the message names the request
    (its index in the batch) and its row, and what is wrong. Nothing was written."""


#: Per (device, value): a read-only int64 buffer of that constant, sliced for the starts (0) of the prefix writes and
#: the lengths (1) of the decode writes, so that neither costs a launch of its own; value -1: an empty int64 tensor
#: (the source of an empty prefix SGLang passes on the CPU). Grown by doubling.
_constants: dict[tuple[torch.device, int], torch.Tensor] = {}


def _constant(device: torch.device, value: int, n: int) -> torch.Tensor:
    buf = _constants.get((device, value))
    if buf is None or buf.shape[0] < n:
        size = max(n, 2 * (0 if buf is None else buf.shape[0]), 64)
        buf = _constants[(device, value)] = torch.full((size,), value, dtype=torch.int64, device=device)
    return buf[:n]


def _host(t: torch.Tensor, name: str, n: int) -> np.ndarray:
    if t.device.type != "cpu":
        raise SglangWriteError(f"write_cache_indices: {name} is on {t.device}, SGLang passes it on the CPU")
    if tuple(t.shape) != (n,):
        raise SglangWriteError(f"write_cache_indices: {name} has shape {tuple(t.shape)}, expected ({n},) (one per "
                               "request)")  # fmt: skip
    return t.numpy()


def _shape(t: torch.Tensor, name: str, n: int, where: str) -> None:
    if t.dim() != 1 or t.shape[0] != n:
        raise SglangWriteError(f"{where}: {name} has shape {tuple(t.shape)}, expected ({n},): one per request")


def _request(i: int, rows: np.ndarray) -> str:
    return f"request {i} (row {int(rows[i])})"


def _refused(where: str, e: ValueError) -> SglangWriteError:
    return SglangWriteError(f"{where}: {e}")


def _prefixes(rows_tensor: torch.Tensor, lens_tensor: torch.Tensor, sources: Sequence[torch.Tensor],
              rows: np.ndarray, prefix: np.ndarray, device: torch.device) -> DeviceWrites:  # fmt: skip
    n = rows.shape[0]
    return DeviceWrites(rows_tensor, _constant(device, 0, n), lens_tensor, sources=sources, source_dtype=torch.int64,
                        host=HostCopies(rows, np.zeros(n, np.int64), prefix), may_overlap=False)  # fmt: skip


def _prefix_set(rows_tensor: torch.Tensor, lens_tensor: torch.Tensor, prefix_tensors: Sequence[torch.Tensor],
                rows: np.ndarray, prefix: np.ndarray, device: torch.device) -> DeviceWrites | None:  # fmt: skip
    """The prefixes' set when every prefix tensor is already `prefix_len` contiguous int64 ids on `device` (what
    SGLang passes but for empty prefixes elsewhere), read in one pass; else None (the caller checks each)."""
    if not len(prefix_tensors):
        return None
    try:
        w = _prefixes(rows_tensor, lens_tensor, prefix_tensors, rows, prefix, device)
    except StagedWriteError:
        return None
    return w if np.array_equal(w.source_sizes, prefix) else None


def write_cache_indices(
    out_cache_loc: torch.Tensor,
    req_pool_indices_tensor: torch.Tensor,
    req_pool_indices_cpu: torch.Tensor,
    prefix_lens_tensor: torch.Tensor,
    prefix_lens_cpu: torch.Tensor,
    seq_lens_tensor: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    extend_lens_tensor: torch.Tensor,
    extend_lens_cpu: torch.Tensor,
    prefix_tensors: Sequence[torch.Tensor],
    req_to_token_pool: Any,
    *,
    backend: str | None = None,
) -> None:
    """SGLang's `write_cache_indices` (sglang/srt/mem_cache/allocation.py, 0.5.23) in one launch: for each request
    i of the batch, row `r = req_pool_indices[i]` of `req_to_token_pool.req_to_token` gets `prefix_tensors[i]` at
    `[0, prefix_lens[i])` and its share of `out_cache_loc` at `[prefix_lens[i], seq_lens[i])`, the shares
    consecutive in batch order (request i's starts after the `extend_lens` of requests 0..i-1). Values are written
    as int32. The `*_tensor` arguments are on the pool's device, the `*_cpu` ones their CPU copies (all `[bs]`);
    the checks read the CPU copies only (no synchronization).

    `backend` forces a multiwrite backend by name (default: the best for the pool's device).

    Raises:
        SglangWriteError: naming the request and its row, nothing written: `seq_lens != prefix_lens +
            extend_lens`; a prefix tensor that is not `prefix_lens[i]` contiguous int64 ids on the pool's device;
            a row that appears twice; a row outside the pool, a negative length or a write past the row
            (`apply_device_writes`' check, its message quoted: its set 0 is the prefixes, set 1 the extends);
            fewer `out_cache_loc` than the extends take; arguments of the wrong shape, dtype or device.
    """
    table = req_to_token_pool.req_to_token
    device = table.device
    where = "write_cache_indices"
    n = len(prefix_tensors)
    rows = _host(req_pool_indices_cpu, "req_pool_indices_cpu", n)
    prefix = _host(prefix_lens_cpu, "prefix_lens_cpu", n)
    seq = _host(seq_lens_cpu, "seq_lens_cpu", n)
    extend = _host(extend_lens_cpu, "extend_lens_cpu", n)
    for name, t in (("req_pool_indices_tensor", req_pool_indices_tensor), ("prefix_lens_tensor", prefix_lens_tensor),
                    ("seq_lens_tensor", seq_lens_tensor), ("extend_lens_tensor", extend_lens_tensor)):  # fmt: skip
        _shape(t, name, n, where)
    bad = np.flatnonzero(seq != prefix + extend)
    if bad.size:
        i = int(bad[0])
        raise SglangWriteError(f"{where}: {_request(i, rows)}: seq_len {int(seq[i])} != prefix_len {int(prefix[i])} "
                               f"+ extend_len {int(extend[i])}")  # fmt: skip
    prefixes = _prefix_set(req_pool_indices_tensor, prefix_lens_tensor, prefix_tensors, rows, prefix, device)
    if prefixes is None:  # some prefix tensor is refused or replaced: the one check, request by request
        sources = list(prefix_tensors)
        for i, t in enumerate(prefix_tensors):
            k = t.numel()
            strided = k > 1 and t.stride(-1) != 1
            if k != prefix[i] or (k and (t.dtype != torch.int64 or t.device != device or strided)):
                got = f"{k} {t.dtype} ids on {t.device}" + ("" if k < 2 or t.stride(-1) == 1 else ", not contiguous")
                raise SglangWriteError(f"{where}: {_request(i, rows)}: prefix_tensors[{i}] holds {got}, expected "
                                       f"prefix_len {int(prefix[i])} contiguous int64 ids on {device}")  # fmt: skip
            if not k and (t.device != device or t.dtype != torch.int64 or t.dim() != 1):
                sources[i] = _constant(device, -1, 0)  # (an empty prefix is read from nowhere)
    else:
        sources = prefixes.sources
    order = np.argsort(rows, kind="stable")
    twice = np.flatnonzero(rows[order][1:] == rows[order][:-1])
    if twice.size:
        a, b = int(order[twice[0]]), int(order[twice[0] + 1])
        raise SglangWriteError(f"{where}: requests {a} and {b} both write row {int(rows[a])} (SGLang gives each "
                               "request a row of its own)")  # fmt: skip
    needed = int(extend.sum()) if n else 0
    if needed > out_cache_loc.numel():
        raise SglangWriteError(f"{where}: the extends take {needed} slots, out_cache_loc holds {out_cache_loc.numel()}")
    if not n:
        return
    try:
        # distinct rows (checked above), prefixes at [0, prefix_len), extends at [prefix_len, seq_len): disjoint
        writes = [
            prefixes or _prefixes(req_pool_indices_tensor, prefix_lens_tensor, sources, rows, prefix, device),
            DeviceWrites(req_pool_indices_tensor, prefix_lens_tensor, extend_lens_tensor, values=out_cache_loc,
                         host=HostCopies(rows, prefix, extend), may_overlap=False),
        ]  # fmt: skip
        apply_device_writes(table, writes, backend=backend)
    except StagedWriteError as e:
        raise _refused(f"{where} (set 0: the prefixes, set 1: the extends)", e) from e


def write_decode(
    req_to_token_pool: Any,
    req_pool_indices: torch.Tensor,
    locs: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *,
    req_pool_indices_cpu: torch.Tensor | None = None,
    locs_cpu: torch.Tensor | None = None,
    backend: str | None = None,
    faults: DeviceWriteFaults | None = None,
) -> None:
    """`req_to_token_pool.req_to_token[req_pool_indices, locs] = out_cache_loc` as int32, in one launch: the write
    of SGLang's decode allocation (one slot per request; all three `[bs]` on the pool's device).

    With `req_pool_indices_cpu` and `locs_cpu` (their CPU copies, equal to the device tensors) every write is
    checked on the host first; without them a bad write is skipped on the device and written nowhere, as
    `apply_device_writes` does for writes without host copies (its `faults=` record counts them; no error is
    raised; pass `faults` to have them recorded). A row given twice takes the later request's slot. `backend`
    forces a multiwrite backend by name.

    Raises:
        SglangWriteError: naming the request and its row, nothing written: with host copies, a row outside the
            pool or a location outside the row (`apply_device_writes`' check, its message quoted); shapes that
            differ (SGLang's indexing refuses them too).
    """
    table = req_to_token_pool.req_to_token
    n = req_pool_indices.numel()
    where = "write_decode"
    _shape(req_pool_indices, "req_pool_indices", n, where)
    _shape(locs, "locs", n, where)
    _shape(out_cache_loc, "out_cache_loc", n, where)
    host = None
    if (req_pool_indices_cpu is None) != (locs_cpu is None):
        raise SglangWriteError(f"{where}: give both req_pool_indices_cpu and locs_cpu, or neither")
    if req_pool_indices_cpu is not None and locs_cpu is not None:
        host = HostCopies(req_pool_indices_cpu, locs_cpu, np.ones(n, np.int64))
    if not n:
        return
    try:
        write = DeviceWrites(req_pool_indices, locs, _constant(table.device, 1, n), values=out_cache_loc, host=host,
                             max_length=1)  # fmt: skip
        apply_device_writes(table, [write], backend=backend, faults=faults)
    except StagedWriteError as e:
        raise _refused(where, e) from e

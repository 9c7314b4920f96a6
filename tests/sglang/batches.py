"""Random SGLang-shaped batches for the oracle tests (here and in tests/gpu/test_sglang.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

#: `MULTIWRITE_SGLANG_SCENARIOS` raises the number of random batches per test.
SCENARIOS = int(os.environ.get("MULTIWRITE_SGLANG_SCENARIOS", "0")) or None


def scenarios(default: int) -> int:
    """Random batches for a test: `MULTIWRITE_SGLANG_SCENARIOS` when set, else `default`."""
    return SCENARIOS or default


@dataclass
class ExtendBatch:
    """The arguments of `write_cache_indices` before the pool, for one batch; `size`, `width`: the pool's."""

    out_cache_loc: torch.Tensor
    rows: torch.Tensor
    rows_cpu: torch.Tensor
    prefix_lens: torch.Tensor
    prefix_lens_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_lens: torch.Tensor
    extend_lens_cpu: torch.Tensor
    prefix_tensors: list[torch.Tensor]
    size: int
    width: int

    def args(self) -> tuple:
        """Positional arguments of `write_cache_indices` up to (not including) `req_to_token_pool`."""
        return (self.out_cache_loc, self.rows, self.rows_cpu, self.prefix_lens, self.prefix_lens_cpu, self.seq_lens,
                self.seq_lens_cpu, self.extend_lens, self.extend_lens_cpu, self.prefix_tensors)  # fmt: skip


def extend_batch(rng: np.random.Generator, device: torch.device, bs: int, size: int, width: int,
                 max_prefix: int | None = None, empty_prefix: torch.Tensor | None = None) -> ExtendBatch:  # fmt: skip
    """`bs` requests in distinct rows of a pool of `size` rows plus the padding row 0 (which may be among them), each
    with a prefix of up to `max_prefix` (default `width`) ids and an extend filling up to the rest of its row; about
    a quarter of prefixes and of extends are empty, some requests fill their row exactly. An empty prefix is
    `empty_prefix` where given (SGLang's `_EMPTY_PREFIX`, a CPU tensor), else an empty device tensor."""
    assert bs <= size + 1
    rows = rng.choice(size + 1, size=bs, replace=False).astype(np.int64)
    cap = width if max_prefix is None else min(max_prefix, width)
    prefix = rng.integers(0, cap + 1, size=bs)
    prefix[rng.random(bs) < 0.25] = 0
    extend = np.array([rng.integers(0, width - p + 1) for p in prefix], dtype=np.int64)
    extend[rng.random(bs) < 0.25] = 0
    full = rng.random(bs) < 0.1
    extend[full] = width - prefix[full]
    seq = prefix + extend
    empty = empty_prefix if empty_prefix is not None else torch.empty(0, dtype=torch.int64, device=device)
    prefix_tensors = [
        torch.from_numpy(rng.integers(1, 2**31 - 1, size=p)).to(device) if p else empty for p in prefix.tolist()
    ]
    out = torch.from_numpy(rng.integers(1, 2**31 - 1, size=int(extend.sum()))).to(device)

    def both(a: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(a.astype(np.int64))
        return t.to(device), t

    return ExtendBatch(out, *both(rows), *both(prefix), *both(seq), *both(extend), prefix_tensors, size, width)


def random_table(rng: np.random.Generator, rows: int, width: int, device: torch.device) -> torch.Tensor:
    """An int32 `[rows, width]` table of random nonzero ids, so that a cell written where none should be shows."""
    return torch.from_numpy(rng.integers(1, 2**31 - 1, size=(rows, width)).astype(np.int32)).to(device)

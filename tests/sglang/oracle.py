"""SGLang 0.5.23's own writers as a test oracle, loaded at test time from SGLang's wheel (nothing of SGLang is kept
here): `multiwrite.sglang.upstream` locates and loads them; this module fetches the wheel for `tox -e sglang`
(`tests.wheels`: downloaded once per machine into `$XDG_CACHE_HOME/multiwrite`, sha256-checked) and holds the
stand-in batch SGLang's decode allocation reads.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import torch

from multiwrite.sglang.upstream import MEMBERS, VERSION, SglangSourceError, locate_sources
from multiwrite.sglang.upstream import WHEEL_ENV as WHEEL_ENV
from tests import wheels


def fetch_wheel(dest: Path, cache: Path | None = None) -> Path:
    """SGLang 0.5.23's wheel at `dest`, from the cache or downloaded once (`tests.wheels.fetch_wheel`)."""
    return wheels.fetch_wheel(dest, "sglang", VERSION, MEMBERS.values(), cache)


def extract(wheel: Path, dest: Path) -> Path:
    """Copy the three files out of `wheel` into `dest` (for `MULTIWRITE_SGLANG_SRC` on a machine without network)."""
    import os

    old = os.environ.get(WHEEL_ENV)
    os.environ[WHEEL_ENV] = str(wheel)
    try:
        return locate_sources(dest)
    finally:
        if old is None:
            os.environ.pop(WHEEL_ENV, None)
        else:
            os.environ[WHEEL_ENV] = old


class Allocator:
    """The stand-in KV-slot allocator of SGLang's decode allocation: hands out the `slots` it is given and records
    what it was asked (`asked`: (method, args)); `freed` collects what was given back."""

    def __init__(self, slots: torch.Tensor, page_size: int) -> None:
        self.slots, self.page_size = slots, page_size
        self.asked: list[tuple[str, tuple]] = []
        self.freed: list[torch.Tensor] = []

    def alloc(self, num_tokens: int) -> torch.Tensor:
        self.asked.append(("alloc", (num_tokens,)))
        return self.slots[:num_tokens]

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor:
        self.asked.append(("alloc_decode", (seq_lens.clone(), seq_lens_cpu.clone(), last_loc.clone())))
        return self.slots[: seq_lens.shape[0]]

    def free(self, slots: torch.Tensor) -> None:
        self.freed.append(slots)


def decode_batch(pool: Any, rows: list[int], seq_lens: list[int], slots: torch.Tensor, page_size: int = 1,
                 encoder_lens: list[int] | None = None) -> types.SimpleNamespace:  # fmt: skip
    """A stand-in for SGLang's `ScheduleBatch` with what its decode allocation reads: the pool, the requests' rows
    and lengths (device and CPU), a tree cache with `page_size` over an `Allocator` of `slots`, a model config
    (encoder-decoder when `encoder_lens` is given), and per-request KV counters."""
    device = pool.req_to_token.device
    allocator = Allocator(slots, page_size)
    evicted: list[bool] = []
    return types.SimpleNamespace(
        device=device,
        req_to_token_pool=pool,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        req_pool_indices_cpu=torch.tensor(rows, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        encoder_lens=None if encoder_lens is None else torch.tensor(encoder_lens, dtype=torch.int64, device=device),
        model_config=types.SimpleNamespace(is_encoder_decoder=encoder_lens is not None),
        tree_cache=types.SimpleNamespace(page_size=page_size, token_to_kv_pool_allocator=allocator,
                                         pretty_print=lambda: None),  # fmt: skip
        reqs=[types.SimpleNamespace(kv=types.SimpleNamespace(kv_allocated_len=n, kv_committed_len=n))
              for n in seq_lens],  # fmt: skip
        maybe_evict_swa=lambda: evicted.append(True),
        evicted=evicted,
    )


USAGE = f"""usage: python -m tests.sglang.oracle fetch DEST.whl      SGLang {VERSION}'s wheel at DEST.whl unless
                                                   it exists, from the cache ($XDG_CACHE_HOME/multiwrite), else
                                                   downloaded
       python -m tests.sglang.oracle extract WHEEL DIR    copy {', '.join(MEMBERS)} into DIR"""

if __name__ == "__main__":
    args = sys.argv[1:]
    try:
        if len(args) == 2 and args[0] == "fetch":
            print(fetch_wheel(Path(args[1])))
        elif len(args) == 3 and args[0] == "extract":
            print(extract(Path(args[1]), Path(args[2])))
        else:
            sys.exit(USAGE)
    except SglangSourceError as e:
        sys.exit(str(e))

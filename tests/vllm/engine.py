"""Random engine-shaped scenarios for a `BlockTables`: what vLLM 0.33's v2 model runner asks of it, step by step.

A `Scenario` is a table configuration (`Config`) and a list of `Step`s, made from a seed by `scenario(seed)` and
independent of any implementation. Requests arrive in free rows (rows of finished requests are reused, their stale
ids left in place), run chunked prefills (some start from a prefix-cache hit) then decode, get blocks as their
tokens need them (`overwrite=True` when new, `False` after), and finish. Each step is the runner's: appends, apply,
then, when tokens are scheduled, a gather in batch order with padding (sometimes into the caller's tables, `out=`;
with `num_computed_tokens` when a group has a sliding window) and the slot mappings (sometimes with dummy requests,
-1, and into the caller's buffer). Some steps are dummy runs first (`get_dummy_*`), some redirect writes to the
null block, some try a write past a row (which vLLM refuses after staging the groups before the failing one: such
calls are only for implementations that stage nothing of them; `Step.rejected`).

Within one step no two writes touch the same cell (vLLM's apply runs them concurrently), a block id times its
block size stays below 2**31 (vLLM computes it in int32), and -1 never reaches a gather (vLLM reads out of bounds).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

MAX_BLOCK_ID = 1 << 20  # times a block size of at most 1024: below 2**31


@dataclass(frozen=True)
class Config:
    """The constructor arguments of a `BlockTables`, vLLM's names."""

    block_sizes: list[int]
    max_num_reqs: int
    max_num_batched_tokens: int
    max_num_blocks_per_group: list[int]
    cp_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    slot_mapping_enabled: list[bool] | None = None
    dcp_sharded: list[bool] | None = None
    sliding_window_reach: list[int] | None = None

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the constructor, `device` left out."""
        return dict(self.__dict__)

    @property
    def groups(self) -> int:
        return len(self.block_sizes)

    def tokens_per_entry(self, g: int) -> int:
        """Tokens one block-table entry of group `g` covers (a DCP-sharded group's entry is a virtual block)."""
        sharded = self.dcp_sharded is None or self.dcp_sharded[g]
        return self.block_sizes[g] * (self.cp_size if sharded else 1)

    def entries_for(self, g: int, tokens: int) -> int:
        return math.ceil(tokens / self.tokens_per_entry(g))

    @property
    def max_tokens_per_request(self) -> int:
        """The most tokens a request may reach with every group's row holding its blocks."""
        return min((w * self.tokens_per_entry(g) for g, w in enumerate(self.max_num_blocks_per_group)), default=256)


@dataclass
class Gather:
    """`gather_block_tables(idx_mapping, num_reqs_padded, out=..., num_computed_tokens=...)`."""

    idx_mapping: list[int]
    num_reqs_padded: int
    num_computed_tokens: list[int] | None = None  # per request row, max_num_reqs long
    out_rows: int | None = None  # gather into caller's tables of this many rows (and out_ptrs)


@dataclass
class Slots:
    """`compute_slot_mappings(idx_mapping, query_start_loc, positions, num_tokens_padded, out=...)`."""

    idx_mapping: list[int]
    query_start_loc: list[int]
    positions: list[int]
    num_tokens_padded: int
    out_tokens: int | None = None  # into a caller's (groups, out_tokens) buffer


@dataclass
class Step:
    """One runner step (`dummy` is a dummy run before it: `get_dummy_block_tables(n)`, `get_dummy_slot_mappings(t)`)."""

    appends: list[tuple[int, tuple[list[int], ...], bool]] = field(default_factory=list)
    rejected: list[tuple[int, tuple[list[int], ...], bool, int]] = field(default_factory=list)  # ..., failing group
    redirect: bool = False
    dummy: tuple[int, int] | None = None
    gather: Gather | None = None
    slots: Slots | None = None


@dataclass
class Scenario:
    seed: int
    config: Config
    steps: list[Step]


@dataclass
class _Request:
    prompt: int
    total: int
    computed: int
    entries: list[int]


def random_config(rng: random.Random, groups: int | None = None, cp_size: int | None = None) -> Config:
    """A configuration: 0-3 groups (mostly 1-3), cp 1/2/4 with any rank and an interleave dividing the block sizes of
    the sharded groups (those it leaves unsharded are sometimes odd), random enabled/sharded flags and sliding
    windows."""
    g = rng.choice([0, 1, 1, 2, 2, 3, 3]) if groups is None else groups
    cp = rng.choice([1, 1, 2, 4]) if cp_size is None else cp_size
    sizes = [rng.choice([4, 8, 16, 32]) for _ in range(g)]
    interleave = rng.choice([i for i in (1, 2, 4) if all(s % i == 0 for s in sizes)] + ([min(sizes)] if sizes else []))
    max_tokens = rng.choice([48, 96, 200])
    widths = []
    for s in sizes:
        # A sharded group's entries cover cp blocks; replicated ones one: wide enough for either.
        widths.append(math.ceil(max_tokens / s) + rng.randint(0, 2))
    cfg = Config(
        block_sizes=sizes,
        max_num_reqs=rng.randint(2, 8),
        max_num_batched_tokens=rng.choice([32, 64, 128]),
        max_num_blocks_per_group=widths,
        cp_size=cp,
        cp_rank=rng.randrange(cp),
        cp_interleave=interleave,
        slot_mapping_enabled=None if rng.random() < 0.4 else [rng.random() < 0.8 for _ in range(g)],
        dcp_sharded=None if rng.random() < 0.4 else [rng.random() < 0.7 for _ in range(g)],
        sliding_window_reach=None if rng.random() < 0.4 else [rng.choice([0, 0, 1, 5, 16, 40]) for _ in range(g)],
    )
    if cfg.dcp_sharded and not all(cfg.dcp_sharded) and cfg.max_num_reqs % 2 == 0:
        # A group context parallelism does not shard may have a block size no interleave divides (vLLM sets a Mamba
        # group's to max_model_len); decided without a draw, so that the rest of the scenario stays as it was.
        odd = [s + 1 if not sharded else s for s, sharded in zip(sizes, cfg.dcp_sharded)]
        cfg = replace(cfg, block_sizes=odd)
    return cfg


def scenario(seed: int, steps: int = 8, config: Config | None = None) -> Scenario:
    """The scenario of `seed`: a random configuration (unless given) and `steps` runner steps."""
    rng = random.Random(seed)
    cfg = config or random_config(rng)
    G, R, T = cfg.groups, cfg.max_num_reqs, cfg.max_num_batched_tokens
    cap = cfg.max_tokens_per_request
    running: dict[int, _Request] = {}
    stale_rows: set[int] = set()
    out: list[Step] = []

    def ids(n: int) -> list[int]:
        return [rng.randint(1, MAX_BLOCK_ID) for _ in range(n)]

    for _ in range(steps):
        step = Step()
        # finish
        for row in list(running):
            req = running[row]
            if req.computed >= req.total or rng.random() < 0.15:
                del running[row]
                stale_rows.add(row)
        # schedule the running ones (decode or the next prefill chunk), then admit new ones in free rows
        budget = rng.randint(max(1, T // 4), T)
        scheduled: dict[int, int] = {}
        for row, req in running.items():
            if budget == 0:
                break
            want = 1 if req.computed >= req.prompt else min(req.prompt - req.computed, rng.randint(1, T))
            n = min(want, budget, req.total - req.computed)
            if n > 0 and rng.random() < 0.9:
                scheduled[row] = n
                budget -= n
        free = [r for r in range(R) if r not in running]
        rng.shuffle(free)
        free.sort(key=lambda r: r not in stale_rows and rng.random() < 0.7)  # mostly reuse rows holding stale ids
        new_rows = set()
        while free and budget > 0 and rng.random() < 0.6:
            row = free.pop(0)
            prompt = rng.randint(1, max(1, cap - 8))
            total = min(cap, prompt + rng.randint(1, 16))
            cached = rng.randint(0, prompt - 1) if rng.random() < 0.3 else 0
            running[row] = _Request(prompt, total, cached, [0] * G)
            n = min(prompt - cached, budget)
            scheduled[row] = n
            budget -= n
            new_rows.add(row)
            stale_rows.discard(row)
        # blocks for the scheduled tokens (a new request also gets those of its cached prefix), a little lookahead
        for row, n in scheduled.items():
            req = running[row]
            new = []
            for g in range(G):
                need = cfg.entries_for(g, req.computed + n)
                width = cfg.max_num_blocks_per_group[g]
                need = min(width, need + (1 if rng.random() < 0.2 else 0))
                have = 0 if row in new_rows else req.entries[g]
                new.append(ids(max(0, need - have)))
                req.entries[g] = max(have, need)
            if row in new_rows or any(new):
                step.appends.append((row, tuple(new), row in new_rows))
        rng.shuffle(step.appends)
        # a write past a row, refused (only for implementations that stage nothing of it)
        if running and G and rng.random() < 0.25:
            row = rng.choice(sorted(running))
            bad = rng.randrange(G)
            lengths = [rng.randint(0, 1) for _ in range(G)]
            overwrite = rng.random() < 0.5
            have = 0 if overwrite else running[row].entries[bad]
            lengths[bad] = cfg.max_num_blocks_per_group[bad] - have + rng.randint(1, 2)
            # groups before the failing one must fit, so that only `bad` is refused
            for g in range(bad):
                room = cfg.max_num_blocks_per_group[g] - (0 if overwrite else running[row].entries[g])
                lengths[g] = min(lengths[g], room)
            step.rejected.append((row, tuple(ids(k) for k in lengths), overwrite, bad))
        step.redirect = rng.random() < 0.08
        if rng.random() < 0.15:
            step.dummy = (rng.randint(0, R), rng.randint(0, T))
        # the batch
        if scheduled:
            order = list(scheduled)
            rng.shuffle(order)
            num_reqs = len(order)
            padded = num_reqs if rng.random() < 0.4 else rng.randint(num_reqs, R)
            nct = None
            if rng.random() < 0.8:
                nct = [rng.randint(0, 500) for _ in range(R)]  # stale values in rows not in the batch
                for row in order:
                    nct[row] = running[row].computed
            out_rows = rng.randint(padded, R + 2) if rng.random() < 0.2 else None
            step.gather = Gather(order, padded, nct, out_rows)
            # slot mappings, maybe with dummy requests (-1) holding a few tokens each
            slot_idx: list[int] = []
            qsl = [0]
            positions: list[int] = []
            spare = T - sum(scheduled.values())
            for row in order:
                # the runner's batches (dummies included) hold at most max_num_reqs entries
                while spare > 0 and len(slot_idx) + len(order) < R and rng.random() < 0.1:
                    k = rng.randint(1, min(3, spare))
                    slot_idx.append(-1)
                    positions += [rng.randint(0, 4 * cap) for _ in range(k)]
                    qsl.append(qsl[-1] + k)
                    spare -= k
                req, n = running[row], scheduled[row]
                slot_idx.append(row)
                positions += list(range(req.computed, req.computed + n))
                qsl.append(qsl[-1] + n)
            num_tokens = qsl[-1]
            tokens_padded = num_tokens if rng.random() < 0.4 else rng.randint(num_tokens, T)
            positions += [rng.randint(0, 4 * cap) for _ in range(tokens_padded - num_tokens)]
            # the runner passes query_start_loc[:num_reqs_padded + 1]: padded requests hold no tokens
            qsl += [num_tokens] * (padded - num_reqs)
            out_tokens = rng.randint(max(tokens_padded, 1), T + 8) if rng.random() < 0.2 else None
            step.slots = Slots(slot_idx, qsl, positions, tokens_padded, out_tokens)
            for row, n in scheduled.items():
                running[row].computed += n
        out.append(step)
    return Scenario(seed, cfg, out)

"""The smallest complete decode loop over multiwrite's `BlockTables`, checked token by token.

Per scheduler step:
1. the scheduler (`multiwrite.workload.replay_schedule`: continuous batching over the Azure trace's prompt and
   output lengths, chunked prefill, a LIFO block allocator) admits requests into free rows, hands out blocks and
   finishes requests;
2. `BlockTables` stages the step's new block ids (`append_block_ids`) and `prepare_inputs` applies them, gathers
   the scheduled rows (`input_block_tables`) and computes every token's slot (`slot_mappings`), in one launch on a
   GPU;
3. one attention layer: the step's K and V are written into the paged KV cache at their slots, and each token's
   query attends, through FlexAttention's paged access over the gathered block table, to its request's history;
4. the checks: each token's output against plain attention over its request's own history (kept densely here),
   and the cache at the slot the request's own block ids give each token (kept here as plain lists) holding
   exactly that token's K and V.

A wrong block id makes attention read another page: an output error far above the tolerance. A wrong slot leaves a
token's K/V where attention does not look: the cache at the token's true slot does not hold it (its effect on the
output alone, about 1/history of a softmax, can hide in rounding behind a long history).

    python examples/paged_decode.py                            # CPU, small size: a few seconds
    python examples/paged_decode.py --size full --device cuda  # trace lengths, Llama-8B's heads, bfloat16

Exit code 0 when both checks pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np
import torch

from multiwrite import BlockTables
from multiwrite.bench.paged_attention import DESCRIPTIONS, PagedAttention, PagedBatch, dense_attention, write_kv
from multiwrite.workload import Trace, load_trace, replay_schedule


@dataclass
class Size:
    """The run's sizes: request slots, steps, tokens per step, heads, and how much the trace's lengths are cut."""

    concurrency: int
    steps: int
    token_budget: int
    q_heads: int
    kv_heads: int
    head_dim: int
    max_prompt: int
    max_output: int
    dtype: torch.dtype
    tolerance: float  # largest absolute error of an output accepted


SIZES = {
    "tiny": Size(4, 12, 64, 2, 1, 16, 40, 8, torch.float32, 1e-4),
    "small": Size(8, 40, 128, 4, 2, 32, 400, 40, torch.float32, 1e-4),
    "full": Size(40, 60, 2048, 32, 8, 128, 8192, 8192, torch.float32, 1e-4),
}
BLOCK_SIZE = 16


@dataclass
class Result:
    """What `run` did: the largest absolute error of any checked token's output, the tokens whose K or V is not at
    their slot, steps, tokens checked, requests admitted, and requests finished whose rows a new request took."""

    worst: float
    misplaced: int
    steps: int
    checked: int
    admitted: int
    finished: int


#: Query lengths a step's batch is padded to (few shapes: each one compiles once).
Q_BUCKETS = (1, 16, 128, 2048)


def run(size: Size, device: torch.device, attention: PagedAttention, trace: Trace, tamper=None, seed: int = 0):
    """Run the loop; returns a `Result`. `tamper(step, gathered, slots)`, if given, may change the step's gathered
    table (int32 `[C, width]`) and slot mappings (int64 `[tokens]`) in place before they are used (the tests plant a
    wrong slot and a wrong block id through it)."""
    C = size.concurrency
    trace = Trace(np.minimum(trace.prompt_tokens, size.max_prompt), np.minimum(trace.output_tokens, size.max_output),
                  trace.source)  # fmt: skip
    schedule = list(replay_schedule(trace, [BLOCK_SIZE], C, size.steps, size.token_budget))
    num_pages = 1 + max((max(ids[0]) for s in schedule for _, ids, _ in s.calls if ids[0]), default=0)
    max_len = size.max_prompt + size.max_output
    width = max_len // BLOCK_SIZE + 1
    tables = BlockTables([BLOCK_SIZE], C, [width], device, max_num_batched_tokens=size.token_budget)

    num_slots = num_pages * BLOCK_SIZE  # the paged KV cache: random at first, plus one dump block for PAD slots
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (size.kv_heads, num_slots + BLOCK_SIZE, size.head_dim)  # head-major, as FlexAttention reads it
    k_cache = torch.randn(shape, generator=g, device=device, dtype=size.dtype)
    v_cache = torch.randn(shape, generator=g, device=device, dtype=size.dtype)
    history_k = torch.zeros(C, max_len, size.kv_heads, size.head_dim, device=device, dtype=size.dtype)
    history_v = torch.zeros_like(history_k)  # each request's own K and V, densely, by position
    batches: dict[int, PagedBatch] = {}
    worst, misplaced, checked, admitted, finished, used_rows = 0.0, 0, 0, 0, 0, set()
    blocks: list[list[int]] = [[] for _ in range(C)]  # each row's block ids, as the scheduler handed them out

    for step_no, step in enumerate(schedule):
        for row, ids, overwrite in step.calls:  # 1. the scheduler's new blocks, staged
            tables.append_block_ids(row, ids, overwrite)
            blocks[row] = (blocks[row] if not overwrite else []) + list(ids[0])
            if overwrite:  # a new request in this row (a request that held it has finished)
                admitted, finished = admitted + 1, finished + (row in used_rows)
                used_rows.add(row)
        n, T = len(step.rows), sum(step.tokens)
        starts, counts = torch.tensor(step.starts), torch.tensor(step.tokens)
        entry = torch.repeat_interleave(torch.arange(n), counts)  # batch entry of each token
        offset = torch.arange(T) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        positions = starts[entry] + offset
        idx = torch.tensor(step.rows, dtype=torch.int32, device=device)
        qsl = torch.tensor([0, *np.cumsum(step.tokens)], dtype=torch.int32, device=device)
        gathered, slots = tables.prepare_inputs(idx, qsl, positions.to(device), C, T)  # 2. one launch
        gathered, slots = gathered[0], slots[0, :T]
        if tamper is not None:
            tamper(step_no, gathered, slots)

        q = torch.randn(T, size.q_heads, size.head_dim, generator=g, device=device, dtype=size.dtype)
        k = torch.randn(T, size.kv_heads, size.head_dim, generator=g, device=device, dtype=size.dtype)
        v = torch.randn(T, size.kv_heads, size.head_dim, generator=g, device=device, dtype=size.dtype)
        write_kv(k_cache, slots, k)  # 3. the KV write, through the slot mappings
        write_kv(v_cache, slots, v)

        q_len = next(b for b in (*Q_BUCKETS, T) if b >= int(counts.max()))
        batch = batches.get(q_len) or batches.setdefault(
            q_len, PagedBatch(C, width, q_len, BLOCK_SIZE, num_slots, device)
        )
        q_pos = torch.full((C, q_len), -1, dtype=torch.int64)
        q_pos[entry, offset] = positions
        batch.update(gathered, q_pos.to(device))
        q_batch = torch.zeros(C, q_len, size.q_heads, size.head_dim, device=device, dtype=size.dtype)
        q_batch[entry.to(device), offset.to(device)] = q
        out = attention(q_batch.transpose(1, 2).contiguous(), k_cache, v_cache, batch)  # through the gathered tables

        rows_t = torch.tensor(step.rows, device=device)[entry.to(device)]  # 4. the check, against dense attention
        history_k[rows_t, positions.to(device)] = k
        history_v[rows_t, positions.to(device)] = v
        for b, row in enumerate(step.rows):
            mine = (entry == b).nonzero().flatten()
            last = int(positions[mine[-1]])
            want = dense_attention(q[mine.to(device)].transpose(0, 1), history_k[row, : last + 1],
                                   history_v[row, : last + 1], positions[mine].to(device))  # fmt: skip
            got = out[b, :, : mine.numel()].double()
            worst = max(worst, float((got - want).abs().max()))
            checked += mine.numel()
            p = positions[mine]
            slot = torch.tensor(blocks[row], dtype=torch.int64)[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            slot, mine = slot.to(device), mine.to(device)
            wrong = (k_cache[:, slot] != k[mine].transpose(0, 1)) | (v_cache[:, slot] != v[mine].transpose(0, 1))
            wrong = wrong.transpose(0, 1).flatten(1).any(1)
            misplaced += int(wrong.sum())
    return Result(worst, misplaced, len(schedule), checked, admitted, finished)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=SIZES, default="small", help="small: a CPU in seconds; full: trace lengths (GPU)")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda")
    p.add_argument("--attention", choices=["auto", *DESCRIPTIONS], default="auto",
                   help="flex-paged (default; compiled on a GPU) or the sdpa-gathered fallback")  # fmt: skip
    p.add_argument("--steps", type=int, help="scheduler steps (default: the size's)")
    p.add_argument("--trace", help="CSV with ContextTokens,GeneratedTokens (default: the embedded Azure trace)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)  # fmt: skip
    size = SIZES[args.size]
    if args.steps:
        size = Size(**{**size.__dict__, "steps": args.steps})
    attention = PagedAttention(args.attention, compile=device.type == "cuda")
    with torch.no_grad():  # (not inference_mode: BlockTables reads its tensors' version counters)
        r = run(size, device, attention, load_trace(args.trace))
    print(f"paged decode: {r.steps} steps on {device}, {r.admitted} requests admitted, {r.finished} finished and "
          f"their rows reused, {r.checked} token outputs checked")  # fmt: skip
    print(f"  attention: {attention.name}: {DESCRIPTIONS[attention.impl]}")
    print(f"  largest error against dense attention over each request's own history: {r.worst:.3g} "
          f"(tolerance {size.tolerance:g}, {str(size.dtype).replace('torch.', '')})")  # fmt: skip
    print(f"  tokens whose K or V is not at the slot their request's block ids give: {r.misplaced}")
    ok = r.worst <= size.tolerance and r.misplaced == 0
    print(f"verdict: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

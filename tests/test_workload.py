"""The trace-replay scheduler of ANCHORS.md, on inputs small enough to check by hand."""

from __future__ import annotations

import numpy as np

from multiwrite.workload import CONFIGS, Trace, load_trace, max_blocks_per_group, replay_steps


def trace(*requests: tuple[int, int]) -> Trace:
    prompts, outputs = zip(*requests)
    return Trace(np.asarray(prompts), np.asarray(outputs), "test")


def test_chunked_prefill_then_decode_then_finish():
    # One slot, block size 4, budget 6: prompt 10 takes two chunks (6 + 4), then 2 decode steps.
    steps = list(replay_steps(trace((10, 2), (3, 1)), [4], concurrency=1, num_steps=20, token_budget=6))
    assert steps[0] == [(0, [[1, 2]], True)]  # 6 tokens -> 2 blocks; first chunk overwrites
    assert steps[1] == [(0, [[3]], False)]  # 10 tokens -> 3 blocks
    assert steps[2] == []  # 11 tokens, still 3 blocks: no write
    assert steps[3] == []  # 12 tokens = prompt + output: finishes and frees blocks 1, 2, 3
    # the next request takes the same slot and reuses the freed blocks LIFO (last freed first)
    assert steps[4] == [(0, [[3]], True)]
    assert len(steps) == 6  # 3 + 1 tokens: one more step, then the trace is exhausted


def test_overwrite_in_every_group_even_without_blocks_and_budget_order():
    steps = list(replay_steps(trace((1, 1), (40, 1), (5, 1)), [2, 32], concurrency=3, num_steps=1, token_budget=30))
    # admission order, budget 30: request 0 takes 1 token, request 1 takes 29, request 2 gets nothing yet
    assert steps[0] == [(0, [[1], [1]], True), (1, [[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [2]], True)]


def test_null_block_is_never_handed_out_and_ids_are_unique_while_held():
    t = load_trace("tests/data/small_trace.csv")
    held: dict[int, set[int]] = {}
    for calls in replay_steps(t, [16], concurrency=2, num_steps=200, token_budget=32):
        for req, ids, overwrite in calls:
            if overwrite:
                held[req] = set()
            assert 0 not in ids[0]
            assert not held[req] & set(ids[0])
            held[req] |= set(ids[0])


def test_embedded_trace_and_anchor_statistics():
    t = load_trace()
    assert len(t) == 19366
    assert t.prompt_tokens[:3].tolist() == [374, 396, 879]
    bs, _ = CONFIGS["G3"]
    counts = [len(c) for c in replay_steps(t, bs, concurrency=40, num_steps=400)]
    assert np.median([c for c in counts[50:] if c]) == 5  # ANCHORS.md: median 5 writes at C=40
    assert max(counts) == 14  # ANCHORS.md: max 14
    assert max_blocks_per_group(bs) == [1025, 513, 2049]

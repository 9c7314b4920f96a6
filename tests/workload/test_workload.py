"""The trace-replay workload (`multiwrite.workload`): reading a trace, and the saturated continuous-batching
scheduler that turns it into `append_block_ids` calls, on inputs small enough to check by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from multiwrite.workload import (
    CONFIGS,
    Trace,
    TraceError,
    load_trace,
    max_blocks_per_group,
    replay_schedule,
    replay_steps,
)

SMALL_TRACE = Path(__file__).resolve().parents[1] / "data" / "small_trace.csv"


def trace(*requests: tuple[int, int]) -> Trace:
    prompts, outputs = zip(*requests)
    return Trace(np.asarray(prompts), np.asarray(outputs), "test")


def test_chunked_prefill_then_decode_then_finish_and_lifo_block_reuse():
    # One slot, block size 4, budget 6: prompt 10 takes two chunks (6 + 4), then 2 decode steps.
    steps = list(replay_steps(trace((10, 2), (3, 1)), [4], concurrency=1, num_steps=20, token_budget=6))
    assert steps[0] == [(0, [[1, 2]], True)]  # 6 tokens -> 2 blocks; the first chunk overwrites
    assert steps[1] == [(0, [[3]], False)]  # 10 tokens -> 3 blocks
    assert steps[2] == []  # 11 tokens, still 3 blocks: no write
    assert steps[3] == []  # 12 tokens = prompt + output: finishes and frees blocks 1, 2, 3
    # the next request takes the same slot and reuses the freed blocks LIFO (last freed first)
    assert steps[4] == [(0, [[3]], True)]
    assert len(steps) == 6  # 3 + 1 tokens: one more step, then the trace is exhausted


def test_a_new_request_overwrites_every_group_even_without_blocks_and_the_budget_goes_in_admission_order():
    steps = list(replay_steps(trace((1, 1), (40, 1), (5, 1)), [2, 32], concurrency=3, num_steps=1, token_budget=30))
    # admission order, budget 30: request 0 takes 1 token, request 1 takes 29, request 2 gets nothing yet
    assert steps[0] == [(0, [[1], [1]], True), (1, [[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [2]], True)]


def test_the_schedule_says_what_each_step_computes():
    schedule = list(replay_schedule(trace((10, 2), (3, 1)), [4], concurrency=2, num_steps=6, token_budget=6))
    assert [(s.rows, s.starts, s.tokens) for s in schedule] == [
        ([0], [0], [6]),  # a prefill chunk of request 0 fills the budget
        ([0, 1], [6, 0], [4, 2]),  # its last chunk, then request 1's first
        ([0, 1], [10, 2], [1, 1]),  # one token each: request 0 decodes, request 1 computes its last prompt token
        ([0, 1], [11, 3], [1, 1]),  # both finish
    ]
    assert [s.is_decode for s in schedule] == [False, False, True, True]
    assert [s.calls for s in schedule] == list(replay_steps(trace((10, 2), (3, 1)), [4], 2, 6, 6))


def test_the_null_block_is_never_handed_out_and_ids_are_unique_while_held():
    t = load_trace(SMALL_TRACE)
    held: dict[int, set[int]] = {}
    steps = 0
    for calls in replay_steps(t, [16], concurrency=2, num_steps=200, token_budget=32):
        steps += 1
        for req, ids, overwrite in calls:
            if overwrite:
                held[req] = set()
            assert 0 not in ids[0]
            assert not held[req] & set(ids[0])
            held[req] |= set(ids[0])
    assert steps > 20 and len(held) == 2


def test_the_embedded_trace_and_the_workloads_statistics():
    t = load_trace()
    assert len(t) == 19366 and t.source == "embedded azure_llm_inference_2023_conv.csv"
    assert t.prompt_tokens[:3].tolist() == [374, 396, 879]
    assert t.num_capped() == (1, 0)  # one prompt longer than 8192 tokens
    bs, _ = CONFIGS["G3"]
    counts = [len(c) for c in replay_steps(t, bs, concurrency=40, num_steps=400)]
    assert np.median([c for c in counts[50:] if c]) == 5  # BENCHMARKS.md: median 5 writes per step at C=40
    assert max(counts) == 14
    assert max_blocks_per_group(bs) == [1025, 513, 2049]


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("", "line 1: empty file, expected a header with ContextTokens,GeneratedTokens"),
        ("ContextTokens\n4\n", "line 1: missing column 'GeneratedTokens' (header: ContextTokens)"),
        ("ContextTokens,GeneratedTokens\n4,x\n", "line 2: GeneratedTokens='x' is not an integer"),
        ("ContextTokens,GeneratedTokens\n4,2\n\n-1,3\n", "line 4: ContextTokens=-1 is negative"),
        ("ContextTokens,GeneratedTokens\n", "no requests after the header"),
        ("ContextTokens,GeneratedTokens\n0,0\n0,0\n", "all 2 requests have ContextTokens + GeneratedTokens = 0"),
    ],
)
def test_a_trace_that_cannot_be_read_names_the_file_and_line(tmp_path, text, what):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}: {what}")
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.csv")


def test_extra_columns_and_blank_lines_are_ignored(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP, GeneratedTokens ,ContextTokens\nt0,2,10\n\n t1 , 0 , 3 \n")
    t = load_trace(path)
    assert t.prompt_tokens.tolist() == [10, 3] and t.output_tokens.tolist() == [2, 0] and t.source == str(path)

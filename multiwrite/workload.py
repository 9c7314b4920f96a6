"""The trace-replay workload: a saturated continuous-batching scheduler turned into block-table writes.

Defined by the project's performance anchors (the workload; see BENCHMARKS.md): `concurrency` request
slots filled in file order; a token budget per step (chunked prefill, one token per decoding request, in
admission order); per KV-cache group a LIFO block allocator (id 0 is the null block and never handed
out); an overwrite in every group at a request's first scheduled chunk, appends for groups that got new
blocks later; blocks and slot freed once prompt + output tokens are computed.

The default input is the Azure LLM inference trace 2023 (conversation), CC-BY 4.0, Patel et al.,
"Splitwise", ISCA 2024, shipped in `multiwrite/data/` with its NOTICE.
"""

from __future__ import annotations

import csv
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

#: Name of the embedded trace file in `multiwrite/data/`.
EMBEDDED_TRACE = "azure_llm_inference_2023_conv.csv"
#: Per-step token budget, prompt/output caps and max model length of the workload (performance anchors, BENCHMARKS.md).
TOKEN_BUDGET = 8192
MAX_PROMPT_TOKENS = 8192
MAX_OUTPUT_TOKENS = 8192
MAX_MODEL_LEN = 16384

#: The anchor configurations: name -> (block sizes, kernel block sizes).
CONFIGS: dict[str, tuple[list[int], list[int]]] = {
    "G1": ([16], [16]),
    "G2": ([16, 16], [16, 16]),
    "G3": ([16, 32, 8], [16, 16, 8]),
    "G4": ([16, 16, 16, 16], [16, 16, 16, 16]),
}

#: One staged `append_block_ids` call: (request row, new manager block ids per group, overwrite).
StagedCall = tuple[int, list[list[int]], bool]


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Trace:
    """Prompt and output lengths of a serving trace, in arrival order.

    Attributes:
        prompt_tokens: int64 `[num_requests]`, tokens.
        output_tokens: int64 `[num_requests]`, tokens.
        source: where it was read from.
    """

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    source: str

    def __len__(self) -> int:
        return int(self.prompt_tokens.shape[0])

    def num_capped(self) -> tuple[int, int]:
        """(prompts, outputs) longer than the workload's caps (`MAX_PROMPT_TOKENS`, `MAX_OUTPUT_TOKENS`),
        which the replay cuts to the cap."""
        return (
            int(np.count_nonzero(self.prompt_tokens > MAX_PROMPT_TOKENS)),
            int(np.count_nonzero(self.output_tokens > MAX_OUTPUT_TOKENS)),
        )


def load_trace(path: str | Path | None = None) -> Trace:
    """Read a CSV trace with integer `ContextTokens` and `GeneratedTokens` columns (other columns ignored).

    Args:
        path: the CSV file; None reads the embedded Azure conversation trace.

    Raises:
        TraceError: unreadable file, missing column, a value that is not a non-negative integer, no
            requests, or no request with any token (nothing to replay); the message names the file and,
            where it applies, the line.
    """
    if path is None:
        ref = resources.files("multiwrite") / "data" / EMBEDDED_TRACE
        source = f"embedded {EMBEDDED_TRACE}"
        text = ref.read_text(encoding="utf-8")
    else:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TraceError(f"{source}: cannot read trace: {exc}") from None
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if header is None:
        raise TraceError(f"{source}: line 1: empty file, expected a header with ContextTokens,GeneratedTokens")
    header = [h.strip() for h in header]
    cols: dict[str, int] = {}
    for name in ("ContextTokens", "GeneratedTokens"):
        if name not in header:
            raise TraceError(f"{source}: line 1: missing column {name!r} (header: {','.join(header)})")
        cols[name] = header.index(name)
    prompts, outputs = [], []
    for line_no, row in enumerate(reader, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        parsed = []
        for name in ("ContextTokens", "GeneratedTokens"):
            i = cols[name]
            cell = row[i].strip() if i < len(row) else ""
            try:
                value = int(cell)
            except ValueError:
                raise TraceError(f"{source}: line {line_no}: {name}={cell!r} is not an integer") from None
            if value < 0:
                raise TraceError(f"{source}: line {line_no}: {name}={value} is negative")
            parsed.append(value)
        prompts.append(parsed[0])
        outputs.append(parsed[1])
    if not prompts:
        raise TraceError(f"{source}: no requests after the header")
    if not any(p + o for p, o in zip(prompts, outputs)):
        raise TraceError(
            f"{source}: all {len(prompts)} requests have ContextTokens + GeneratedTokens = 0: nothing to schedule"
        )
    return Trace(np.asarray(prompts, dtype=np.int64), np.asarray(outputs, dtype=np.int64), source)


def max_blocks_per_group(block_sizes: Sequence[int], max_model_len: int = MAX_MODEL_LEN) -> list[int]:
    """Manager blocks a request may hold per group: `max_model_len // bs + 1` (the anchors' row width)."""
    return [max_model_len // bs + 1 for bs in block_sizes]


class _Request:
    __slots__ = ("slot", "prompt", "total", "computed", "blocks", "started")

    def __init__(self, slot: int, prompt: int, total: int, num_groups: int):
        self.slot = slot
        self.prompt = prompt
        self.total = total
        self.computed = 0
        self.blocks: list[list[int]] = [[] for _ in range(num_groups)]
        self.started = False


@dataclass(frozen=True)
class ScheduledStep:
    """One scheduler step of the workload: what it stages and what it schedules.

    Attributes:
        calls: the step's `append_block_ids` calls, in admission order.
        rows: request rows (slots) scheduled this step, in batch order (admission order).
        starts: per scheduled row, the sequence position of its first token this step.
        tokens: per scheduled row, tokens computed this step (1 for a decoding request; a chunk in prefill).
    """

    calls: list[StagedCall]
    rows: list[int]
    starts: list[int]
    tokens: list[int]

    @property
    def is_decode(self) -> bool:
        """Every scheduled request computes one token (no prefill chunk in this step)."""
        return bool(self.rows) and all(t == 1 for t in self.tokens)


def replay_steps(
    trace: Trace,
    block_sizes: Sequence[int],
    concurrency: int,
    num_steps: int,
    token_budget: int = TOKEN_BUDGET,
) -> Iterator[list[StagedCall]]:
    """Yield, per scheduler step, the `append_block_ids` calls the step stages, in admission order.

    Stops early when the trace runs out of requests. Block ids are manager ids (before kernel block
    expansion); rows are slot indices in `[0, concurrency)`.
    """
    for step in replay_schedule(trace, block_sizes, concurrency, num_steps, token_budget):
        yield step.calls


def replay_schedule(
    trace: Trace,
    block_sizes: Sequence[int],
    concurrency: int,
    num_steps: int,
    token_budget: int = TOKEN_BUDGET,
) -> Iterator[ScheduledStep]:
    """`replay_steps` with the batch of each step: the scheduled rows, their first positions and token counts
    (what `BlockTables.prepare_inputs` needs: `idx_mapping`, `query_start_loc`, `positions`)."""
    num_groups = len(block_sizes)
    free_slots = list(range(concurrency))
    heapq.heapify(free_slots)
    free_blocks: list[list[int]] = [[] for _ in block_sizes]
    next_fresh = [1] * num_groups  # id 0 is the null block
    running: list[_Request] = []
    prompts = np.minimum(trace.prompt_tokens, MAX_PROMPT_TOKENS).tolist()
    outputs = np.minimum(trace.output_tokens, MAX_OUTPUT_TOKENS).tolist()
    next_req = 0
    for _ in range(num_steps):
        while free_slots and next_req < len(prompts):
            prompt, output = prompts[next_req], outputs[next_req]
            next_req += 1
            if prompt + output == 0:
                continue  # nothing to compute: never scheduled
            running.append(_Request(heapq.heappop(free_slots), prompt, prompt + output, num_groups))
        if not running:
            return
        budget = token_budget
        calls: list[StagedCall] = []
        rows: list[int] = []
        starts: list[int] = []
        tokens: list[int] = []
        finished = False
        for req in running:
            if budget == 0:
                break
            take = min(req.prompt - req.computed, budget) if req.computed < req.prompt else 1
            budget -= take
            rows.append(req.slot)
            starts.append(req.computed)
            tokens.append(take)
            req.computed += take
            new_ids: list[list[int]] = []
            for g, bs in enumerate(block_sizes):
                need = -(-req.computed // bs) - len(req.blocks[g])
                ids = []
                for _ in range(need):
                    if free_blocks[g]:
                        ids.append(free_blocks[g].pop())
                    else:
                        ids.append(next_fresh[g])
                        next_fresh[g] += 1
                req.blocks[g].extend(ids)
                new_ids.append(ids)
            if not req.started:
                req.started = True
                calls.append((req.slot, new_ids, True))
            elif any(new_ids):
                calls.append((req.slot, new_ids, False))
            finished |= req.computed >= req.total
        if finished:
            still = []
            for req in running:
                if req.computed >= req.total:
                    for g in range(num_groups):
                        free_blocks[g].extend(req.blocks[g])
                    heapq.heappush(free_slots, req.slot)
                else:
                    still.append(req)
            running = still
        yield ScheduledStep(calls, rows, starts, tokens)

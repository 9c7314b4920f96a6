"""Device time of graph mode's captured consume kernel when the batch it consumes is EMPTY: a measurement.

    python scripts/consume_kernel_costs.py      # on a GPU machine: C=40 and C=256, G3

Replays the real trace (G3) through a graph-mode `BlockTables` whose graph captured [empty kernel,
`apply_staged_writes()`] (the consume kernel); each real step is committed and consumed by an untimed replay.
Then, in turn, one of three graphs is timed (queued behind busy device work, as in
`scripts/graph_mode_costs.py`): the same graph consuming an empty commit (a header with no writes, its ticket
published), a graph of one empty kernel, a graph of two empty kernels. Prints the medians: what the consume
kernel costs with nothing to apply, against what one more kernel node costs.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import graph_mode_costs  # noqa: E402

from multiwrite.workload import CONFIGS, load_trace, replay_steps  # noqa: E402


def measure(concurrency: int, steps: int = 300) -> dict[str, float]:
    block_sizes = CONFIGS["G3"][0]
    bt, floor, with_apply = graph_mode_costs.graph_mode_tables(concurrency)

    def two_floors():
        floor()
        floor()

    capture = graph_mode_costs.capture_graph
    g_apply, g_one, g_two = capture(with_apply), capture(floor), capture(two_floors)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {"empty header": [], "one empty kernel": [], "two empty kernels": []}
    for i, calls in enumerate(replay_steps(load_trace(), block_sizes, concurrency, steps)):
        for req, ids, overwrite in calls:
            bt.append_block_ids(req, ids, overwrite)
        bt.commit_staged_writes()
        g_apply.replay()  # the real step, untimed
        torch.cuda.synchronize()
        if i < graph_mode_costs.WARMUP:
            continue
        kind = list(times)[i % 3]
        if kind == "empty header":
            bt.commit_staged_writes()  # nothing staged: an empty header
        graph = {"empty header": g_apply, "one empty kernel": g_one}.get(kind, g_two)
        graph_mode_costs.timed_replay(graph, start, end)
        torch.cuda.synchronize()
        times[kind].append(start.elapsed_time(end) * 1e3)
    return {f"{k} us": statistics.median(v) for k, v in times.items()}


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for c in (40, 256):
        print(f"C={c} G3 consume kernel: " + ", ".join(f"{k} {v:.2f}" for k, v in measure(c).items()), flush=True)

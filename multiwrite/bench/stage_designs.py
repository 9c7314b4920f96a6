"""The designs of `multiwrite bench --stage` (`STAGE_VARIANTS`; `multiwrite.bench.stage` says what each does and how
they are timed): each a runner that stages a step's `append_block_ids` calls (`prepare`, `stage`) and runs the step's
block-table stage (`run`), with the outputs and final tables it is checked by."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from multiwrite.bench.groups import STAGE_CONFIGS
from multiwrite.bench.runner import launch_paths
from multiwrite.bench.variants import Snapshot
from multiwrite.capture import simulated_capture
from multiwrite.environment import synchronize
from multiwrite.errors import BackendUnavailableError
from multiwrite.tables.block_tables import BlockTables
from multiwrite.workload import ScheduledStep, max_blocks_per_group

#: The configuration the stage goals are set on (BENCHMARKS.md).
STAGE_CONFIG = "G3"


class StepBuffers:
    """The step's inputs in persistent device buffers, and views of this step's length."""

    def __init__(self, device: torch.device, max_reqs: int, max_tokens: int):
        self.idx_buf = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.qsl_buf = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self.pos_buf = torch.zeros(max_tokens, dtype=torch.int64, device=device)

    def load(self, step: ScheduledStep) -> None:
        rows = np.asarray(step.rows, dtype=np.int32)
        tokens = np.asarray(step.tokens, dtype=np.int64)
        qsl = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32)
        pos = np.concatenate([np.arange(s, s + t) for s, t in zip(step.starts, step.tokens)] or [np.zeros(0)])
        self.n, self.T = rows.shape[0], int(qsl[-1])
        self.idx_buf[: self.n].copy_(torch.from_numpy(rows))
        self.qsl_buf[: self.n + 1].copy_(torch.from_numpy(qsl))
        self.pos_buf[: self.T].copy_(torch.from_numpy(pos.astype(np.int64)))
        self.idx, self.qsl, self.pos = self.idx_buf[: self.n], self.qsl_buf[: self.n + 1], self.pos_buf[: self.T]
        self.host = (rows.tolist(), qsl.tolist(), pos.astype(np.int64).tolist())


class Design:
    """One design of the stage bench on `BlockTables` of configuration `config` (a name of
    `bench.groups.STAGE_CONFIGS`) with `concurrency` rows and `max_tokens` slots: `prepare(calls)` builds a step's
    `append_block_ids` arguments (untimed), `stage` stages them and `run(x)` runs the step's stage on `StepBuffers`
    `x` (both timed), `after(x)` its untimed device work; `outputs`, `snapshot` and `kernel_block_sizes` are what it
    is checked by.

    Attributes:
        name, launches: how the report names it and counts its launches per step.
        path, why: how its buffers reach the device where a design has a choice (vLLM's own class: "uva" or
            "fallback"), else ""; why the fallback.
        config: the tables' configuration (G3 by default; `bench.model_step` runs the designs on G1).
        bt: its multiwrite `BlockTables` (None for vLLM's own class).
    """

    name = ""
    launches = ""
    path = ""
    why = ""

    def __init__(self, device: torch.device, backend: str | None, concurrency: int, max_tokens: int,
                 config: str = STAGE_CONFIG):  # fmt: skip
        self.config = config
        bs, kbs = STAGE_CONFIGS[config]
        self.bt = self.build(bs, kbs, concurrency, max_tokens, device, backend)
        self._append = self.bt.append_block_ids

    def build(self, bs, kbs, concurrency, max_tokens, device, backend) -> BlockTables:
        """The design's tables (graph mode's: with `cuda_graphs=True`)."""
        return BlockTables(bs, concurrency, max_blocks_per_group(bs), device, kbs, backend=backend,
                           max_num_batched_tokens=max_tokens)  # fmt: skip

    @property
    def label(self) -> str:
        """The design's name in the report and the CSV: its name, and its path where it has one (`vllm-0.33-uva`)."""
        return f"{self.name}-{self.path}" if self.path else self.name

    def prepare(self, calls):
        """Untimed, right before the step's staging: the step's calls as an engine's model runner receives them,
        freshly built (the scheduler output of this step, deserialized in the worker process in vLLM), not the
        objects the schedule built at the start of the run; returns what `stage` takes."""
        return [(req, [list(g) for g in ids], overwrite) for req, ids, overwrite in calls]

    def stage(self, calls) -> None:
        append = self._append
        for req, ids, overwrite in calls:
            append(req, ids, overwrite)

    def run(self, x: StepBuffers) -> None:
        raise NotImplementedError

    def after(self, x: StepBuffers) -> None:
        """Device work of the step that is not timed (graph mode's replay); enqueued before the synchronize."""

    def outputs(self, x: StepBuffers) -> tuple[list[torch.Tensor], torch.Tensor]:
        assert self.bt.slot_mappings is not None
        return [t[: x.n] for t in self.bt.input_block_tables], self.bt.slot_mappings[:, : x.T]

    @property
    def kernel_block_sizes(self) -> list[int]:
        """The kernel block sizes the runner's tables hold ids of (which reference it is checked against)."""
        return list(self.bt.kernel_block_sizes)

    def snapshot(self) -> Snapshot:
        """The tables, host counts and device counts at the end of the run."""
        bt = self.bt
        return Snapshot([t.tensor.cpu().numpy() for t in bt.block_tables], bt.num_blocks.copy(),
                        bt.num_blocks_device.cpu().numpy())  # fmt: skip

    def launch_path(self) -> str:
        return launch_paths(self.bt.backend)


class VllmDesign(Design):
    """vLLM 0.33's call pattern on a `BlockTables` of its signature (`make`), kernel block = block."""

    launches = "3"

    def __init__(self, device: torch.device, backend: str | None, concurrency: int, max_tokens: int,
                 config: str = STAGE_CONFIG):  # fmt: skip
        self.config = config
        bs, _ = STAGE_CONFIGS[config]
        self.vbt = self.make(bs, concurrency, max_tokens, max_blocks_per_group(bs), device, backend)
        self._append = self.vbt.append_block_ids

    def make(self, bs, concurrency, max_tokens, widths, device, backend):
        from multiwrite.vllm import BlockTables as VllmBlockTables

        tables = VllmBlockTables(bs, concurrency, max_tokens, widths, device, backend=backend)
        self.bt = tables.core
        return tables

    def run(self, x: StepBuffers) -> None:
        vbt = self.vbt
        vbt.apply_staged_writes()
        vbt.gather_block_tables(x.idx, x.n)
        vbt.compute_slot_mappings(x.idx, x.qsl, x.pos, x.T)

    @property
    def kernel_block_sizes(self) -> list[int]:
        return list(STAGE_CONFIGS[self.config][0])


class VllmThreeCalls(VllmDesign):
    """vLLM's three calls through `multiwrite.vllm.BlockTables` (three launches, as vLLM's)."""

    name = "vllm-3-calls"


class Vllm033(VllmDesign):
    """vLLM's three calls on vLLM 0.33's own `BlockTables` (`multiwrite.vllm.upstream.load_vllm_anchor`): on vLLM's
    UVA path where it runs (a CUDA device with pinned memory: `path` "uva"), else its fallback ("fallback"; `why`
    says why)."""

    name, launches = "vllm-0.33", "3"

    def make(self, bs, concurrency, max_tokens, widths, device, backend):
        from multiwrite.vllm.upstream import VllmSourceError, load_vllm_anchor

        try:
            anchor = load_vllm_anchor(device.type)
        except VllmSourceError as exc:
            raise BackendUnavailableError(str(exc)) from None
        self.bt = None
        self.path, self.why = anchor.path, anchor.why
        return anchor.cls(list(bs), concurrency, max_tokens, widths, device)

    def outputs(self, x: StepBuffers) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [t[: x.n] for t in self.vbt.input_block_tables], self.vbt.slot_mappings[:, : x.T]

    def snapshot(self) -> Snapshot:
        v = self.vbt
        return Snapshot([t.gpu.cpu().numpy() for t in v.block_tables], v.num_blocks.np.copy(),
                        v.num_blocks.gpu.cpu().numpy())  # fmt: skip

    def launch_path(self) -> str:
        return f"vLLM 0.33's kernels through Triton's JIT, its buffers on its {self.path} path"


class Ours(Design):
    """`prepare_inputs`: the whole stage in one backend call."""

    name, launches = "ours", "1"

    def run(self, x: StepBuffers) -> None:
        self.bt.prepare_inputs(x.idx, x.qsl, x.pos, x.n, x.T)


class BatchedStaging:
    """Staging through ONE `append_block_ids_batch` call per step (the step's calls as three lists, built before
    the timed region: an engine holds them as lists already) instead of a Python loop of `append_block_ids`."""

    bt: BlockTables

    def prepare(self, calls):
        return [c[0] for c in calls], [[list(g) for g in c[1]] for c in calls], [c[2] for c in calls]

    def stage(self, lists) -> None:
        self.bt.append_block_ids_batch(*lists)


class OursBatched(BatchedStaging, Ours):
    """`ours` with the step staged by one `append_block_ids_batch` call."""

    name = "ours-batched"


class OursThreeCalls(Design):
    """Our three calls: apply, gather, slot mappings."""

    name, launches = "ours-3-calls", "3"

    def run(self, x: StepBuffers) -> None:
        bt = self.bt
        bt.apply_staged_writes()
        bt.gather_block_tables(x.idx, x.n)
        bt.compute_slot_mappings(x.idx, x.qsl, x.pos, x.T)


class AnchorDesign(Design):
    """Our apply, then the anchor's gather and slot-mapping kernels (`bench.anchor_kernels`; `fused`: one kernel for
    both) into buffers of their own; GPU only."""

    fused = False

    def __init__(self, device: torch.device, backend: str | None, concurrency: int, max_tokens: int,
                 config: str = STAGE_CONFIG):  # fmt: skip
        super().__init__(device, backend, concurrency, max_tokens, config)
        from multiwrite.bench.anchor_kernels import AnchorStage

        self.anchor = AnchorStage(self.bt, max_tokens, fused=self.fused)

    def run(self, x: StepBuffers) -> None:
        self.bt.apply_staged_writes()
        self.anchor.run(x.idx, x.qsl, x.pos)

    def outputs(self, x: StepBuffers) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [t[: x.n] for t in self.anchor.input_block_tables], self.anchor.slot_mappings[:, : x.T]


class Anchor3(AnchorDesign):
    """Our apply, then the anchor gather and slot-mapping kernels (vLLM's v2 model runner's design)."""

    name, launches, fused = "anchor-3", "3", False


class Anchor2(AnchorDesign):
    """Our apply, then the anchor fused gather + slot mapping (vllm-project/vllm PR #34660)."""

    name, launches, fused = "anchor-2", "2", True


class Replayable(Protocol):
    """A captured graph: `torch.cuda.CUDAGraph`, or a `multiwrite.capture.SimulatedGraph`."""

    def replay(self) -> None: ...


def capture(device: torch.device, record: Callable[[], object]) -> Replayable:
    """`record()` captured into a graph to replay (`graph.replay()`): a CUDA graph on a GPU, else a simulated capture
    (`multiwrite.capture.simulated_capture`: CPU tables on a backend whose launches it records)."""
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            record()
        return graph
    with simulated_capture() as simulated:
        record()
    return simulated


class GraphMode(Design):
    """Graph mode: `prepare_inputs` captured once in a graph (`capture`); per step staging +
    `commit_staged_writes()` timed, then the step's inputs written into the captured buffers and the graph
    replayed (not timed)."""

    name, launches = "graph-mode", "0 (replay)"

    def __init__(self, device: torch.device, backend: str | None, concurrency: int, max_tokens: int,
                 config: str = STAGE_CONFIG):  # fmt: skip
        super().__init__(device, backend, concurrency, max_tokens, config)
        self._commit = self.bt.commit_staged_writes
        # Persistent inputs padded to the bucket: `concurrency` entries (unused ones: row 0, no tokens) and
        # `max_tokens` tokens (the unscheduled ones marked as padding).
        self.idx = torch.zeros(concurrency, dtype=torch.int32, device=device)
        self.qsl = torch.zeros(concurrency + 1, dtype=torch.int32, device=device)
        self.pos = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.pad = torch.ones(max_tokens, dtype=torch.bool, device=device)
        self._tokens = torch.arange(max_tokens, device=device)
        args = (self.idx, self.qsl, self.pos, concurrency, max_tokens, self.pad)
        self.bt.prepare_inputs(*args)  # compiles the kernels for these buffers: nothing compiles inside the capture
        synchronize(device)
        self.graph = capture(device, lambda: self.bt.prepare_inputs(*args))
        synchronize(device)

    def run(self, x: StepBuffers) -> None:
        self._commit()

    def after(self, x: StepBuffers) -> None:
        n, T = x.n, x.T
        self.idx[:n].copy_(x.idx)
        self.idx[n:].zero_()
        self.qsl[: n + 1].copy_(x.qsl)
        self.qsl[n + 1 :].fill_(T)
        self.pos[:T].copy_(x.pos)
        torch.ge(self._tokens, T, out=self.pad)
        self.graph.replay()

    def build(self, bs, kbs, concurrency, max_tokens, device, backend) -> BlockTables:
        return BlockTables(bs, concurrency, max_blocks_per_group(bs), device, kbs, backend=backend,
                           max_num_batched_tokens=max_tokens, cuda_graphs=True)  # fmt: skip


class GraphModeBatched(BatchedStaging, GraphMode):
    """`graph-mode` with the step staged by one `append_block_ids_batch` call."""

    name = "graph-mode-batched"


#: The designs, in the order the report prints them.
STAGE_VARIANTS = (Ours, OursBatched, OursThreeCalls, VllmThreeCalls, Vllm033, Anchor3, Anchor2, GraphMode,
                  GraphModeBatched)  # fmt: skip

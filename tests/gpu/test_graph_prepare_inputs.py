"""Graph mode on a real GPU: `prepare_inputs` (apply, gather and slot mappings) captured once over persistent input
buffers, replayed over the real trace and behind a busy stream, with and without programmatic dependent launch,
checked against the reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, RingWaitWarning
from multiwrite.reference import ReferenceBlockTables, compute_slot_mappings_reference, gather_block_tables_reference
from multiwrite.workload import TOKEN_BUDGET, load_trace, max_blocks_per_group, replay_schedule
from tests.gpu.captured import BLOCK_SIZES, KERNEL_BLOCK_SIZES
from tests.gpu.helpers import busy, gpu_backend


class CapturedStep:
    """A graph-mode BlockTables of G3 with `reqs` rows, and a graph that captured `prepare_inputs` once over persistent
    device input buffers sized for the padded bucket: `reqs` batch entries (a step's unused ones name row 0 with zero
    tokens) and TOKEN_BUDGET tokens (`is_padding` marks the unscheduled ones). `pdl`: the stage kernel is recorded as
    the programmatic dependent launch of the consume kernel (`TritonPlan.pdl`; skipped where the GPU cannot) or as a
    plain launch after it."""

    def __init__(self, device, backend_name: str, reqs: int = 40, pdl: bool = True):
        widths = max_blocks_per_group(BLOCK_SIZES)
        self.reqs, self.device = reqs, device
        self.bt = BlockTables(BLOCK_SIZES, reqs, widths, device, KERNEL_BLOCK_SIZES, backend=gpu_backend(backend_name),
                              cuda_graphs=True, max_num_batched_tokens=TOKEN_BUDGET)  # fmt: skip
        plan = self.bt.graph.plan
        if pdl and not plan.pdl:
            pytest.skip("programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0 or newer")
        plan.pdl = pdl  # white-box: the plan's switch, read at each capture
        self.ref = ReferenceBlockTables(BLOCK_SIZES, reqs, widths, KERNEL_BLOCK_SIZES)
        self.idx = torch.zeros(reqs, dtype=torch.int32, device=device)
        self.qsl = torch.zeros(reqs + 1, dtype=torch.int32, device=device)
        self.pos = torch.zeros(TOKEN_BUDGET, dtype=torch.int64, device=device)
        self.pad = torch.ones(TOKEN_BUDGET, dtype=torch.bool, device=device)
        args = (self.idx, self.qsl, self.pos, reqs, TOKEN_BUDGET, self.pad)
        self.bt.prepare_inputs(*args)  # the eager warm-up: compiles the kernels for these buffers (no replay's run)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.gathered, self.slots = self.bt.prepare_inputs(*args)
        torch.cuda.synchronize(device)
        self._pinned: list[torch.Tensor] = []  # host copies of queued inputs, alive until the next synchronize

    def stage(self, calls) -> None:
        for req, ids, overwrite in calls:
            self.bt.append_block_ids(req, ids, overwrite)
            self.ref.append_block_ids(req, ids, overwrite)

    def load(self, step):
        """Write the step's inputs into the device buffers (asynchronously, in stream order, from pinned copies: the
        host never waits for earlier replays). Returns them as lists, and the real entry count."""
        n = len(step.rows)
        idx = list(step.rows) + [0] * (self.reqs - n)
        tokens = list(step.tokens) + [0] * (self.reqs - n)
        qsl = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        T = int(qsl[-1])
        pos = np.zeros(TOKEN_BUDGET, dtype=np.int64)
        pos[:T] = np.concatenate([np.arange(s, s + t) for s, t in zip(step.starts, step.tokens)] or [np.zeros(0)])
        pad = np.arange(TOKEN_BUDGET) >= T
        for buf, host in ((self.idx, np.asarray(idx, dtype=np.int32)), (self.qsl, qsl.astype(np.int32)),
                          (self.pos, pos), (self.pad, pad)):  # fmt: skip
            pinned = torch.from_numpy(host).pin_memory()
            buf.copy_(pinned, non_blocking=True)
            self._pinned.append(pinned)
        return idx, qsl.tolist(), pos[:T].tolist(), pad.tolist(), n

    def expected(self, inputs):
        """The reference's gathered rows (-7 where the step defines no cell) and slot mappings for `inputs`."""
        idx, qsl, pos, pad, _ = inputs
        zero = [np.zeros(t.shape, dtype=np.int64) for t in self.ref.tables]
        gathered = gather_block_tables_reference(self.ref.tables, self.ref.num_blocks, idx, self.reqs, zero)
        slots = compute_slot_mappings_reference(self.ref.tables, KERNEL_BLOCK_SIZES, idx, qsl, pos, TOKEN_BUDGET, pad)
        counts = [self.ref.num_blocks[g, idx] for g in range(len(BLOCK_SIZES))]
        return [np.where(np.arange(w.shape[1])[None, :] < c[:, None], w, -7) for w, c in zip(gathered, counts)], slots

    def outputs(self):
        """Copies of the outputs, taken in stream order after the last replay."""
        return [t.clone() for t in self.gathered], self.slots.clone()


def stage_mismatch(got, want, n: int) -> str:
    """An empty string when the gathered cells the step defines (entries < n, columns < num_blocks) and every slot
    equal the reference, else the first difference."""
    for g, (a, w) in enumerate(zip(got[0], want[0])):
        a = a.cpu().numpy()[:n]
        bad = np.argwhere((w[:n] != -7) & (a != w[:n]))
        if bad.size:
            b, col = (int(i) for i in bad[0])
            return f"group {g} gathered[{b}, {col}] = {a[b, col]}, reference {w[b, col]}"
    s = got[1].cpu().numpy()
    bad = np.argwhere(s != want[1])
    if bad.size:
        g, i = (int(v) for v in bad[0])
        return f"slot_mappings[{g}, {i}] = {s[g, i]}, reference {want[1][g, i]}"
    return ""


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
def test_a_captured_prepare_inputs_over_the_real_trace_equals_the_reference(device, backend_name, pdl):
    """prepare_inputs captured once (padded bucket: 40 entries, 8,192 tokens); 500 steps of the trace (G3, C=40), each:
    stage, commit, write the step's inputs into the buffers, replay: every step's defined gathered cells and all its
    slot mappings equal the reference. With PDL the stage kernel starts while the consume kernel lands the step's
    writes: a stage that read the tables before `griddepcontrol.wait` would see the last step's."""
    c = CapturedStep(device, backend_name, pdl=pdl)
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        for step in replay_schedule(load_trace(), BLOCK_SIZES, 40, 500):
            c.stage(step.calls)
            c.bt.commit_staged_writes()
            c.ref.apply_staged_writes()
            inputs = c.load(step)
            c.graph.replay()
            got = c.outputs()
            torch.cuda.synchronize(device)
            c._pinned.clear()
            assert stage_mismatch(got, c.expected(inputs), inputs[4]) == "", f"step {steps}"
            steps += 1
    assert steps == 500 and c.bt.graph.ring.idle_runs == 0
    np.testing.assert_array_equal(c.bt.num_blocks_device.cpu().numpy(), c.ref.num_blocks)
    for g, t in enumerate(c.bt.block_tables):
        np.testing.assert_array_equal(t.tensor.cpu().numpy(), c.ref.tables[g], err_msg=f"group {g}")


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
def test_a_captured_prepare_inputs_queued_behind_a_busy_stream_sees_only_its_own_step(device, backend_name, pdl):
    """Replay N of the captured prepare_inputs waits behind 50 ms of device work while the host stages, commits and
    loads the inputs of step N+1 and queues its replay: replay N applies step N only and reads step N's inputs."""
    c = CapturedStep(device, backend_name, pdl=pdl)
    schedule = iter(replay_schedule(load_trace(), BLOCK_SIZES, 40, 60))
    for i, step in enumerate(schedule):
        c.stage(step.calls)
        c.bt.commit_staged_writes()
        c.ref.apply_staged_writes()
        if i < 50:  # past the first prefills: rows are freed and reused by new requests (overwrites)
            c.load(step)
            c.graph.replay()
            continue
        torch.cuda.synchronize(device)
        c._pinned.clear()
        busy(0.05)
        inputs_n = c.load(step)
        c.graph.replay()
        got_n, want_n = c.outputs(), c.expected(inputs_n)
        assert not torch.cuda.current_stream(device).query(), "replay N ran too early for this test to mean anything"
        nxt = next(schedule, None)
        if nxt is None:
            break
        c.stage(nxt.calls)
        c.bt.commit_staged_writes()  # while replay N still waits
        c.ref.apply_staged_writes()
        inputs_n1 = c.load(nxt)
        c.graph.replay()
        got_n1, want_n1 = c.outputs(), c.expected(inputs_n1)
        torch.cuda.synchronize(device)
        assert stage_mismatch(got_n, want_n, inputs_n[4]) == "", f"step {i}: replay N saw more (or less) than step N"
        assert stage_mismatch(got_n1, want_n1, inputs_n1[4]) == "", f"step {i + 1}"
    ring = c.bt.graph.ring
    assert ring.idle_runs == 0 and ring.applied == ring.published

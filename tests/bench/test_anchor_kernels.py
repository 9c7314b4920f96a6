"""The anchor designs `multiwrite bench --stage` times on a GPU (vLLM's gather and slot-mapping kernels, and their
fused variant), run here through Triton's interpreter over trace steps and checked as the bench checks them: they
equal the reference, and a wrong slot is reported.

White-box: off a GPU the bench never runs the anchors (it says why and skips them), so this test drives the bench's
own stage helpers directly, `multiwrite.bench.stage_designs.StepBuffers` (the step's persistent input buffers) and
`multiwrite.bench.stage._check` (the comparison with the reference the bench applies to every design); there is no
public face to them.
"""

from __future__ import annotations

import pytest
import torch

from multiwrite import available_backends
from multiwrite.reference import ReferenceBlockTables
from multiwrite.workload import load_trace, max_blocks_per_group, replay_schedule


def test_the_anchor_designs_equal_the_reference_and_a_wrong_slot_is_reported():
    if torch.cuda.is_available():  # no interpreter there: the bench runs the anchors on the GPU and verifies them
        pytest.skip("the anchors run through Triton's interpreter only on a machine without CUDA")
    if not {s.name: s.available for s in available_backends("cpu")}.get("triton-cuda"):
        pytest.skip("Triton's interpreter is not available (needs Triton and TRITON_INTERPRET=1)")
    from multiwrite.bench import stage as st
    from multiwrite.bench import stage_designs as designs

    bs, kbs = st.STAGE_CONFIGS[st.STAGE_CONFIG]
    cpu = torch.device("cpu")
    runners = [v(cpu, "torch-cpu", 8, 8192) for v in (designs.Anchor3, designs.Anchor2, designs.Ours)]
    ref = ReferenceBlockTables(bs, 8, max_blocks_per_group(bs), kbs)
    x = designs.StepBuffers(cpu, 8, 8192)
    decode = 0
    for step in replay_schedule(load_trace(), bs, 8, 12):
        x.load(step)
        for r in runners:
            r.stage(r.prepare(step.calls))
            r.run(x)
        for req, ids, overwrite in step.calls:
            ref.append_block_ids(req, ids, overwrite)
        ref.apply_staged_writes()
        for r in runners:
            assert st._check(r, x, ref) == "", r.name
        decode += step.is_decode
    assert decode >= 5
    runners[0].anchor.slot_mappings[0, 0] += 1  # a wrong slot must be reported
    assert st._check(runners[0], x, ref).startswith("slot_mappings[0, 0] = ")

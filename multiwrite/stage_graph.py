"""Graph mode's stage: `prepare_inputs`, `gather_block_tables` and `compute_slot_mappings` of a
`BlockTables(..., cuda_graphs=True)` captured in a CUDA graph.

What a capture records (issue 10):
- `prepare_inputs(idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded, is_padding)`:
  the consume kernel (each replay applies exactly the NEXT batch closed by `commit_staged_writes()`, as a
  captured `apply_staged_writes()` does) followed by ONE launch of the stage kernel (gather + slot mappings);
- `gather_block_tables(...)`, `compute_slot_mappings(...)`: one launch of the stage kernel each, reading
  the tables as the last run of the consume kernel left them.

Fixed at capture: the ADDRESSES of every tensor given (the tables, `input_block_tables`, `slot_mappings`
and the step's input tensors, which the graph keeps alive), `num_reqs = len(idx_mapping)`, `num_reqs_padded`,
`num_tokens_padded`, the length of `positions`, and whether `is_padding` is given. Read at replay: the
VALUES of `idx_mapping`, `query_start_loc` (including `query_start_loc[num_reqs]`, the end of the scheduled
tokens), `positions` and `is_padding`, as the engine's persistent input buffers hold them when the replay
runs; and the tables as the consume kernel left them.

During a capture every input tensor must already be on the tables' device: a host tensor would need a
host->device copy, and a captured copy replays from the capture's host buffer, which is not what the caller
means by passing it (and from pageable memory it cannot be captured at all). Values of device tensors are
never read on the host, so they are not checked; out-of-range values give wrong slots, never an access
outside the buffers (the kernel clamps what becomes an address), as for device inputs outside a capture.

The stage descriptors (the tables' and outputs' addresses) are built once per `BlockTables`, at construction,
and kept by the backend's graph stage (`GraphStage.bind_stage` in `backends/triton_graph.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from multiwrite import stage as _stage
from multiwrite.errors import GraphCaptureError, StageInputError
from multiwrite.writer import _check_frozen

if TYPE_CHECKING:
    from multiwrite.block_tables import BlockTables


def bind(bt: BlockTables) -> None:
    """Hand the graph stage of `bt` (graph mode) the layout of its stage, so that it builds the stage
    descriptors now, outside any capture. A graph stage without `bind_stage` (a third-party one) is left as is:
    its captures of the stage are refused (`GraphCaptureError`)."""
    bind_stage = getattr(bt._graph, "bind_stage", None)
    if bind_stage is None:
        return
    bind_stage(_stage.new_stage(bt._stage_config))


def _on_device(bt: BlockTables, what: str, **tensors: Any) -> None:
    """Refuse input tensors that are not on the tables' device (see the module docstring)."""
    device = bt.num_blocks_device.device
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != device:
            raise StageInputError(
                f"{what} during CUDA graph capture: {name} is on {t.device}, but a captured call needs every input "
                f"tensor on the tables' device {device} (a host->device copy would be captured and every replay "
                "would copy the capture's host buffer again). Keep the step's inputs in persistent device "
                "buffers and write each step's values into them before the replay. Nothing was recorded."
            )


def _capture(
    bt: BlockTables,
    what: str,
    consume: bool,
    idx_mapping: Any,
    num_reqs_padded: int | None,
    query_start_loc: Any = None,
    positions: Any = None,
    num_tokens_padded: int | None = None,
    is_padding: Any = None,
) -> _stage.StageInputs:
    record = getattr(bt._graph, "record_stage", None)
    if record is None:
        raise GraphCaptureError(
            f"BlockTables.{what} during CUDA graph capture: the graph mode of backend {bt.backend.NAME!r} captures "
            "apply_staged_writes() only (its graph stage has no record_stage). Nothing was recorded."
        )
    _on_device(bt, what, idx_mapping=idx_mapping, query_start_loc=query_start_loc, positions=positions,
               is_padding=is_padding)  # fmt: skip
    stage = _stage._build(
        bt, what, idx_mapping, num_reqs_padded, query_start_loc, positions, num_tokens_padded, is_padding
    )
    _check_frozen(bt._arena)  # the descriptors are captured by address: the tables must be as built
    record(stage, consume)
    return stage


def capture_prepare_inputs(
    bt: BlockTables,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    num_reqs_padded: int,
    num_tokens_padded: int,
    is_padding: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Record `bt.prepare_inputs(...)` in the graph being captured (see the module docstring)."""
    stage = _capture(
        bt, "prepare_inputs", True, idx_mapping, num_reqs_padded, query_start_loc, positions, num_tokens_padded,
        is_padding,
    )  # fmt: skip
    return stage.gathered(), stage.slots()


def capture_gather_block_tables(
    bt: BlockTables, idx_mapping: torch.Tensor, num_reqs_padded: int
) -> tuple[torch.Tensor, ...]:
    """Record `bt.gather_block_tables(...)` in the graph being captured (see the module docstring)."""
    return _capture(bt, "gather_block_tables", False, idx_mapping, num_reqs_padded).gathered()


def capture_compute_slot_mappings(
    bt: BlockTables,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    num_tokens_padded: int,
    is_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """Record `bt.compute_slot_mappings(...)` in the graph being captured (see the module docstring)."""
    stage = _capture(
        bt, "compute_slot_mappings", False, idx_mapping, None, query_start_loc, positions, num_tokens_padded,
        is_padding,
    )  # fmt: skip
    return stage.slots()


__all__ = ["bind", "capture_compute_slot_mappings", "capture_gather_block_tables", "capture_prepare_inputs"]

"""The rest of a step's block-table stage: gather the scheduled rows and compute slot mappings.

A model runner's step has three block-table jobs: apply the staged writes (`BlockTables.apply_staged_writes`),
**gather** each scheduled request's rows into batch order for the attention kernels
(`BlockTables.gather_block_tables`), and compute the **slot mapping** of every scheduled token, where its K/V
go in the paged cache (`BlockTables.compute_slot_mappings`). `BlockTables.prepare_inputs` does all three in
one backend call. Names and semantics follow vLLM's v2 model runner (`vllm/v1/worker/gpu/block_table.py` in
vllm-project/vllm), so an engine can adopt them as they are:

- `input_block_tables[g]`: a persistent int32 `[max_num_reqs, width_g]` tensor per group (its address never
  changes, so a CUDA graph may read it). Gathering batch entry `b < num_reqs` copies the first
  `num_blocks[g, idx_mapping[b]]` cells of row `idx_mapping[b]`; its other cells keep what they held (as in
  vLLM: attention reads a row only up to the request's length). Rows `num_reqs .. num_reqs_padded - 1`
  become zero.
- `slot_mappings`: a persistent int64 `[num_groups, max_num_batched_tokens]` tensor. Token `i` of batch
  entry `b` (`query_start_loc[b] <= i < query_start_loc[b + 1]`) at position `p = positions[i]` maps, with
  the group's KERNEL block size `kbs` (the tables hold kernel block ids), to
  `table[idx_mapping[b], p // kbs] * kbs + p % kbs`. Tokens past `query_start_loc[num_reqs]`, tokens whose
  `is_padding` is true, and every column from `num_tokens_padded` on hold `PAD_SLOT_ID` (-1).
- Context parallelism (`cp_size > 1`, decode context parallelism in vLLM): the sequence is dealt to the
  ranks in chunks of `cp_interleave` tokens, so each token belongs to exactly one rank; the others map it to
  `PAD_SLOT_ID`. Ownership and the rank-local offset are computed in MANAGER-block coordinates (a virtual
  block of `block_size * cp_size` tokens), and the kernel block size is used only to pick the kernel block
  and the slot inside it: the fix of vllm-project/vllm PR #51031, whose fault was computing them with a
  block size other than the one the table's ids are in.

The generic implementation here is vectorized torch (no Python loop over requests or tokens, only over the
few KV-cache groups), runs on any device, and is what every backend gets unless it implements
`Backend.prepare_inputs` itself. `multiwrite.reference` has the plain sequential semantics it is tested
against.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from multiwrite.capture import refuse_capture
from multiwrite.errors import StagedWriteError, StageInputError  # re-exported: it was defined here
from multiwrite.reference import PAD_SLOT_ID

if TYPE_CHECKING:
    from multiwrite.block_tables import BlockTables

__all__ = [
    "PAD_SLOT_ID",
    "StageInputError",
    "StageInputs",
    "compute_slot_mappings_torch",
    "gather_block_tables_torch",
    "run_stage_torch",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


class StageInputs:
    """One step's block-table stage as a backend receives it in `Backend.prepare_inputs`.

    Every tensor is on the tables' device. Attributes:
        tables: the source tables, int32 `[max_num_reqs, width_g]` per group (kernel block ids).
        num_blocks: int32 `[num_groups, max_num_reqs]` on the device, as of the apply in the same call.
        input_block_tables: the persistent gather outputs, int32 `[max_num_reqs, width_g]` per group.
        slot_mappings: the persistent int64 `[num_groups, max_num_batched_tokens]` output, or None when
            the tables were built without `max_num_batched_tokens` (then `do_slots` is false).
        block_sizes, kernel_block_sizes, kernel_blocks_per_block: per group (tokens, tokens, count).
        cp_size, cp_rank, cp_interleave: context parallelism (1, 0, 1 without it).
        idx_mapping: int32/int64 `[num_reqs]`: the request row of each batch entry.
        query_start_loc: int32/int64 `[>= num_reqs + 1]`: first token of each batch entry, then the end.
        positions: int32/int64 `[n]`: each token's position in its sequence.
        is_padding: bool `[>= num_tokens_padded]` or None.
        num_reqs, num_reqs_padded, num_tokens_padded: ints.
        do_gather, do_slots: which of the two jobs this call asks for.
        plans: a dict that lives as long as the `BlockTables`, shared by every call on it: a backend may
            keep there what is fixed for these tables (descriptors, bound launchers), under a key of its own.
            It must hold nothing that would keep the `BlockTables` itself alive.
    """

    __slots__ = (
        "tables",
        "num_blocks",
        "input_block_tables",
        "slot_mappings",
        "block_sizes",
        "kernel_block_sizes",
        "kernel_blocks_per_block",
        "cp_size",
        "cp_rank",
        "cp_interleave",
        "idx_mapping",
        "query_start_loc",
        "positions",
        "is_padding",
        "num_reqs",
        "num_reqs_padded",
        "num_tokens_padded",
        "do_gather",
        "do_slots",
        "plans",
        "_config",
        "_columns",
        "_tokens",
    )

    tables: list[torch.Tensor]
    num_blocks: torch.Tensor
    input_block_tables: list[torch.Tensor]
    slot_mappings: torch.Tensor | None
    block_sizes: list[int]
    kernel_block_sizes: list[int]
    kernel_blocks_per_block: list[int]
    cp_size: int
    cp_rank: int
    cp_interleave: int
    idx_mapping: torch.Tensor
    query_start_loc: torch.Tensor | None
    positions: torch.Tensor | None
    is_padding: torch.Tensor | None
    num_reqs: int
    num_reqs_padded: int
    num_tokens_padded: int
    do_gather: bool
    do_slots: bool
    plans: dict
    _config: _StageConfig
    _columns: torch.Tensor
    _tokens: torch.Tensor | None

    def gathered(self) -> tuple[torch.Tensor, ...]:
        """`input_block_tables[g][:num_reqs_padded]` for every group (views, fixed addresses)."""
        n = self.num_reqs_padded
        config = self._config
        if self.input_block_tables is config.input_block_tables:
            views = config.gathered_views.get(n)
            return gathered_views(config, n) if views is None else views
        return tuple(t[:n] for t in self.input_block_tables)

    def slots(self) -> torch.Tensor:
        """`slot_mappings[:, :num_tokens_padded]` (a view, fixed address)."""
        out = self.slot_mappings
        assert out is not None
        n = self.num_tokens_padded
        config = self._config
        if out is config.slot_mappings:
            view = config.slot_views.get(n)
            return slot_view(config, n) if view is None else view
        return out[:, :n]


#: Most `slot_mappings` views `StageInputs.slots` keeps (one per distinct `num_tokens_padded`).
_VIEW_CACHE = 1024


def gathered_views(config: _StageConfig, n: int) -> tuple[torch.Tensor, ...]:
    """`input_block_tables[g][:n]` of every group, made once per `n` and kept in `config.gathered_views`."""
    views = config.gathered_views.get(n)
    if views is None:
        views = config.gathered_views[n] = tuple(t[:n] for t in config.input_block_tables)
    return views


def slot_view(config: _StageConfig, n: int) -> torch.Tensor:
    """`slot_mappings[:, :n]`, made once per `n` and kept in `config.slot_views` (at most `_VIEW_CACHE` sizes)."""
    views = config.slot_views
    view = views.get(n)
    if view is None:
        assert config.slot_mappings is not None
        if len(views) >= _VIEW_CACHE:
            views.clear()
        view = views[n] = config.slot_mappings[:, :n]
    return view


class _StageConfig:
    """What `BlockTables` keeps for the stage: its constructor arguments, persistent buffers, and what every
    call reuses: the tables as a list, the views it returns (they are views of fixed buffers, so one per size
    serves every call) and the backends' `plans`."""

    __slots__ = (
        "max_num_batched_tokens", "cp_size", "cp_rank", "cp_interleave", "columns", "tokens",
        "input_block_tables", "slot_mappings", "device", "tables", "num_blocks", "block_sizes",
        "kernel_block_sizes", "kernel_blocks_per_block", "max_num_reqs", "gathered_views", "slot_views", "plans",
        "gpu",
    )  # fmt: skip

    max_num_batched_tokens: int | None
    cp_size: int
    cp_rank: int
    cp_interleave: int
    columns: torch.Tensor
    tokens: torch.Tensor | None
    input_block_tables: list[torch.Tensor]
    slot_mappings: torch.Tensor | None
    device: torch.device
    gpu: bool
    tables: list[torch.Tensor]
    num_blocks: torch.Tensor
    block_sizes: list[int]
    kernel_block_sizes: list[int]
    kernel_blocks_per_block: list[int]
    max_num_reqs: int
    gathered_views: dict[int, tuple[torch.Tensor, ...]]
    slot_views: dict[int, torch.Tensor]
    plans: dict


def _int_arg(what: str, value: Any, low: int) -> int:
    if isinstance(value, bool):
        raise StagedWriteError(f"BlockTables: {what} must be an integer, not a bool ({value!r})")
    try:
        value = operator.index(value)
    except TypeError:
        raise StagedWriteError(f"BlockTables: {what} must be an integer, got {value!r}") from None
    if value < low:
        raise StagedWriteError(f"BlockTables: {what} must be >= {low}, got {value}")
    return value


def init_stage(
    bt: BlockTables, max_num_batched_tokens: int | None, cp_size: int, cp_rank: int, cp_interleave: int
) -> _StageConfig:
    """Check the stage's constructor arguments; allocate the `input_block_tables` and `slot_mappings` of `bt`.

    The buffers are allocations of their own (the tables' shared storage is not touched) and never move.

    Raises:
        StagedWriteError: a non-integer or out-of-range value; `cp_rank` outside `[0, cp_size)`; with
            `cp_size > 1`, a group's block size that `cp_interleave` does not divide (vLLM's requirement).
    """
    config = _StageConfig()
    config.cp_size = _int_arg("cp_size", cp_size, 1)
    config.cp_rank = _int_arg("cp_rank", cp_rank, 0)
    config.cp_interleave = _int_arg("cp_interleave", cp_interleave, 1)
    if config.cp_rank >= config.cp_size:
        raise StagedWriteError(f"BlockTables: cp_rank {config.cp_rank} is outside [0, cp_size={config.cp_size})")
    if config.cp_size > 1:
        for g, bs in enumerate(bt.block_sizes):
            if bs % config.cp_interleave:
                raise StagedWriteError(
                    f"BlockTables: group {g} block size {bs} is not a multiple of cp_interleave "
                    f"{config.cp_interleave} (context parallelism deals whole interleave chunks of a block)"
                )
    config.max_num_batched_tokens = (
        None if max_num_batched_tokens is None else _int_arg("max_num_batched_tokens", max_num_batched_tokens, 1)
    )
    device = bt.num_blocks_device.device
    widths = [t.tensor.shape[1] for t in bt.block_tables]
    R = bt.max_num_reqs
    storage = torch.zeros(R * sum(widths), dtype=torch.int32, device=device)
    offsets = np.cumsum([0, *(R * w for w in widths)]).tolist()
    config.input_block_tables = [storage[offsets[g] : offsets[g + 1]].view(R, w) for g, w in enumerate(widths)]
    config.columns = torch.arange(max(widths), device=device)
    if config.max_num_batched_tokens is None:
        config.slot_mappings = config.tokens = None
    else:
        n = config.max_num_batched_tokens
        config.slot_mappings = torch.full((len(widths), n), PAD_SLOT_ID, dtype=torch.int64, device=device)
        config.tokens = torch.arange(n, device=device)
    config.device = device
    config.gpu = device.type != "cpu"
    config.tables = [t.tensor for t in bt.block_tables]  # fixed: a BlockTables' tables are never replaced
    config.num_blocks = bt.num_blocks_device
    config.block_sizes = bt.block_sizes
    config.kernel_block_sizes = bt.kernel_block_sizes
    config.kernel_blocks_per_block = bt.kernel_blocks_per_block
    config.max_num_reqs = R
    config.gathered_views = {}  # at most max_num_reqs + 1 entries
    config.slot_views = {}
    config.plans = {}
    return config


# -------------------------------------------------------------------------------------------------
# input checks
# -------------------------------------------------------------------------------------------------
def _count(what: str, value: Any, high: int, high_name: str) -> int:
    if value.__class__ is int and 0 <= value <= high:
        return value
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        raise StageInputError(f"{what} must be a Python int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise StageInputError(f"{what} must be an integer, got {value!r}") from None
    if not 0 <= value <= high:
        raise StageInputError(f"{what}={value} is outside [0, {high_name}={high}]")
    return value


def _vector(what: str, t: Any, dtypes: tuple[torch.dtype, ...], device: torch.device) -> torch.Tensor:
    """`t` checked to be a 1-D tensor of `dtypes` on `device` or on the host, moved to `device`, contiguous (the
    kernels read element `i` at `data_ptr() + i`: a strided view is copied, on the current stream)."""
    if (
        t.__class__ is torch.Tensor and t.dtype in dtypes and t.device == device and t.dim() == 1
        and t.is_contiguous()
    ):  # fmt: skip
        return t  # the common case, in as few tensor attribute reads as possible
    if not isinstance(t, torch.Tensor):
        raise StageInputError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise StageInputError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise StageInputError(f"{what} has dtype {str(t.dtype).removeprefix('torch.')} (accepted: {allowed})")
    if t.device == device:
        return t.contiguous()
    if t.device.type != "cpu":
        raise StageInputError(f"{what} is on {t.device}; the tables are on {device} (pass it there or on the host)")
    # A host tensor: pinned memory is copied asynchronously on the current stream, as the engine's own
    # persistent input buffers are; the caller must not overwrite it before that copy ran.
    return t.to(device, non_blocking=t.is_pinned()).contiguous()


def _host(original: Any, checked: torch.Tensor, gpu: bool) -> np.ndarray | None:
    """The values of an input the caller passed on the host (checked there), or None for a device input
    (never read: that would synchronize). `checked` is what `_vector` made of `original`."""
    if gpu and (checked is original or original.device == checked.device):
        return None
    return original.numpy()


def _refuse_capture(bt: BlockTables, what: str) -> None:
    refuse_capture(bt.device, f"BlockTables.{what}")  # GraphCaptureError before anything is applied or written


def new_stage(config: _StageConfig) -> StageInputs:
    """A `StageInputs` holding what is fixed for one `BlockTables` (its `_stage_config`): tables, outputs, sizes,
    context parallelism, plans; the step's fields are the caller's to set."""
    s = StageInputs()
    s.tables = config.tables
    s.num_blocks = config.num_blocks
    s.input_block_tables = config.input_block_tables
    s.slot_mappings = config.slot_mappings
    s.block_sizes = config.block_sizes
    s.kernel_block_sizes = config.kernel_block_sizes
    s.kernel_blocks_per_block = config.kernel_blocks_per_block
    s.cp_size, s.cp_rank, s.cp_interleave = config.cp_size, config.cp_rank, config.cp_interleave
    s.plans, s._config = config.plans, config
    s._columns, s._tokens = config.columns, config.tokens
    return s


def _build_common(
    config: _StageConfig,
    idx: Any,
    num_reqs_padded: Any,
    qsl: Any,
    pos: Any,
    num_tokens_padded: Any,
    pad: Any,
) -> StageInputs | None:
    """`_build` of a `prepare_inputs` call as an engine makes it on a GPU (device inputs of accepted dtypes,
    counts in range), in as few tensor attribute reads as possible; None for anything else, which `_build`
    then checks in full (and names what is wrong)."""
    device = config.device
    T = torch.Tensor
    if not (
        config.gpu
        and idx.__class__ is T and idx.dtype in _INDEX_DTYPES and idx.device == device and idx.dim() == 1
        and qsl.__class__ is T and qsl.dtype in _INDEX_DTYPES and qsl.device == device and qsl.dim() == 1
        and pos.__class__ is T and pos.dtype in _INDEX_DTYPES and pos.device == device and pos.dim() == 1
        and num_reqs_padded.__class__ is int and num_tokens_padded.__class__ is int
        and idx.is_contiguous() and qsl.is_contiguous() and pos.is_contiguous()  # (strided: `_vector` copies)
        and config.max_num_batched_tokens is not None
    ):  # fmt: skip
        return None
    n = idx.shape[0]
    if not (n <= num_reqs_padded <= config.max_num_reqs and qsl.shape[0] > n):
        return None
    if not 0 <= num_tokens_padded <= config.max_num_batched_tokens:
        return None
    if pad is not None and not (
        pad.__class__ is T and pad.dtype is torch.bool and pad.device == device and pad.dim() == 1
        and pad.shape[0] >= num_tokens_padded and pad.is_contiguous()
    ):  # fmt: skip
        return None
    s = new_stage(config)
    s.do_gather = s.do_slots = True
    s.idx_mapping, s.query_start_loc, s.positions, s.is_padding = idx, qsl, pos, pad
    s.num_reqs, s.num_reqs_padded, s.num_tokens_padded = n, num_reqs_padded, num_tokens_padded
    return s


def _build(
    bt: BlockTables,
    what: str,
    idx_mapping: Any,
    num_reqs_padded: int | None,
    query_start_loc: Any = None,
    positions: Any = None,
    num_tokens_padded: int | None = None,
    is_padding: Any = None,
) -> StageInputs:
    """Check one call's inputs (shapes, dtypes, counts; values too where they are on the host) and bundle them.

    Values of inputs already on a GPU are not read (that would synchronize the host with the device):
    out-of-range values there are the caller's responsibility, as in vLLM.
    """
    config: _StageConfig = bt._stage_config
    device = config.device
    R = config.max_num_reqs
    s = new_stage(config)
    s.do_gather = num_reqs_padded is not None
    s.do_slots = num_tokens_padded is not None

    gpu = device.type != "cpu"
    s.idx_mapping = _vector(f"{what}: idx_mapping", idx_mapping, _INDEX_DTYPES, device)
    n = s.num_reqs = s.idx_mapping.shape[0]
    if n > R:
        raise StageInputError(f"{what}: idx_mapping has {n} batch entries, more than max_num_reqs={R}")
    idx = _host(idx_mapping, s.idx_mapping, gpu)
    if idx is not None and n:  # a host input: its values are checked
        bad = np.flatnonzero((idx < 0) | (idx >= R))
        if bad.size:
            b = int(bad[0])
            raise StageInputError(
                f"{what}: idx_mapping[{b}]={int(idx[b])} is outside the tables' request rows [0, {R})"
            )
    s.num_reqs_padded = n
    if s.do_gather:
        s.num_reqs_padded = _count(f"{what}: num_reqs_padded", num_reqs_padded, R, "max_num_reqs")
        if s.num_reqs_padded < n:
            raise StageInputError(
                f"{what}: num_reqs_padded={s.num_reqs_padded} is less than num_reqs={n} (idx_mapping's length)"
            )
    s.query_start_loc = s.positions = s.is_padding = None
    s.num_tokens_padded = 0
    if not s.do_slots:
        return s
    if bt.slot_mappings is None or config.max_num_batched_tokens is None:
        raise StageInputError(
            f"{what}: these BlockTables were built without max_num_batched_tokens, so they have no "
            "slot_mappings buffer; pass max_num_batched_tokens= to the constructor"
        )
    T = s.num_tokens_padded = _count(
        f"{what}: num_tokens_padded", num_tokens_padded, config.max_num_batched_tokens, "max_num_batched_tokens"
    )
    s.query_start_loc = _vector(f"{what}: query_start_loc", query_start_loc, _INDEX_DTYPES, device)
    if s.query_start_loc.shape[0] < n + 1:
        raise StageInputError(
            f"{what}: query_start_loc has {s.query_start_loc.shape[0]} entries, needs num_reqs + 1 = {n + 1}"
        )
    s.positions = _vector(f"{what}: positions", positions, _INDEX_DTYPES, device)
    if is_padding is not None:
        s.is_padding = _vector(f"{what}: is_padding", is_padding, (torch.bool,), device)
        if s.is_padding.shape[0] < T:
            raise StageInputError(
                f"{what}: is_padding has {s.is_padding.shape[0]} entries, needs num_tokens_padded = {T}"
            )
    qsl, pos = _host(query_start_loc, s.query_start_loc, gpu), _host(positions, s.positions, gpu)
    if qsl is not None:
        qsl = qsl[: n + 1].astype(np.int64)
        if qsl[0] != 0:
            raise StageInputError(f"{what}: query_start_loc[0]={int(qsl[0])}, must be 0")
        steps = np.flatnonzero(np.diff(qsl) < 0)
        if steps.size:
            b = int(steps[0])
            raise StageInputError(
                f"{what}: query_start_loc decreases at batch entry {b}: {int(qsl[b])} then {int(qsl[b + 1])}"
            )
        if qsl[n] > T:
            raise StageInputError(
                f"{what}: query_start_loc[num_reqs={n}]={int(qsl[n])} tokens, more than num_tokens_padded={T}"
            )
        if qsl[n] > s.positions.shape[0]:
            raise StageInputError(
                f"{what}: positions has {s.positions.shape[0]} entries for {int(qsl[n])} scheduled tokens"
            )
        pad = _host(is_padding, s.is_padding, gpu) if s.is_padding is not None else None
        if pos is not None and idx is not None:
            _check_positions(s, what, idx, qsl, pos[: int(qsl[n])], pad)
    return s


def _check_positions(
    s: StageInputs, what: str, idx: np.ndarray, qsl: np.ndarray, pos: np.ndarray, pad: np.ndarray | None
) -> None:
    """Every scheduled, unpadded token this rank stores must address a cell inside its table's row."""
    if not pos.shape[0]:
        return
    pos = pos.astype(np.int64)
    live = np.ones(pos.shape[0], dtype=bool) if pad is None else ~pad[: pos.shape[0]]
    negative = np.flatnonzero(live & (pos < 0))
    if negative.size:
        i = int(negative[0])
        raise StageInputError(f"{what}: positions[{i}]={int(pos[i])} is negative")
    chunk = pos // s.cp_interleave
    live &= chunk % s.cp_size == s.cp_rank
    local = (chunk // s.cp_size) * s.cp_interleave + pos % s.cp_interleave
    for g, (kbs, table) in enumerate(zip(s.kernel_block_sizes, s.tables)):
        width = table.shape[1]
        bad = np.flatnonzero(live & (local // kbs >= width))
        if bad.size:
            i = int(bad[0])
            b = int(np.searchsorted(qsl[1:], i, side="right"))
            raise StageInputError(
                f"{what}: token {i} (batch entry {b}, request row {int(idx[b])}) at position {int(pos[i])} "
                f"needs kernel block column {int(local[i] // kbs)} of group {g}, past its row width {width} "
                f"(kernel block size {kbs}" + (f", cp_size {s.cp_size})" if s.cp_size > 1 else ")")
            )


# -------------------------------------------------------------------------------------------------
# the generic torch implementation
# -------------------------------------------------------------------------------------------------
def gather_block_tables_torch(stage: StageInputs) -> None:
    """Gather `stage`'s rows into `stage.input_block_tables` with torch ops on the tables' device.

    One `index_select` and one masked copy per group (no loop over requests); padding rows are zeroed.
    """
    n, padded = stage.num_reqs, stage.num_reqs_padded
    idx = stage.idx_mapping.long().clamp(0, stage.num_blocks.shape[1] - 1)  # see compute_slot_mappings_torch
    on_host = stage.num_blocks.device.type == "cpu"
    for g, (src, out) in enumerate(zip(stage.tables, stage.input_block_tables)):
        if n:
            counts = stage.num_blocks[g].index_select(0, idx)
            # On the host, copy only up to the longest row of the batch (reading it costs nothing there);
            # on a device that would synchronize, so the whole width is masked instead.
            width = min(int(counts.max()), out.shape[1]) if on_host else out.shape[1]
            keep = stage._columns[:width].unsqueeze(0) < counts.unsqueeze(1)
            out[:n, :width] = torch.where(keep, src[:, :width].index_select(0, idx), out[:n, :width])
        out[n:padded].zero_()


def compute_slot_mappings_torch(stage: StageInputs) -> None:
    """Compute `stage.slot_mappings[:, :num_tokens_padded]` (and pad the rest) with torch ops, no host sync.

    Each token finds its batch entry by a binary search over `query_start_loc`; request rows and table
    columns are clamped into the tables, so an input nobody checked (values of device tensors) never reads
    outside a table nor raises a device-side assert: it only gets wrong slots.
    """
    out, qsl, positions, tokens = stage.slot_mappings, stage.query_start_loc, stage.positions, stage._tokens
    assert out is not None and qsl is not None and positions is not None and tokens is not None
    n, T = stage.num_reqs, stage.num_tokens_padded
    out[:, T:].fill_(PAD_SLOT_ID)
    if T == 0:
        return
    if n == 0 or positions.shape[0] == 0:
        out[:, :T].fill_(PAD_SLOT_ID)
        return
    i = tokens[:T]
    qsl = qsl[: n + 1].long()
    batch = torch.searchsorted(qsl[1:], i, right=True).clamp_(max=n - 1)
    live = (i >= qsl[0]) & (i < qsl[n])
    if stage.is_padding is not None:
        live &= ~stage.is_padding[:T]
    req = stage.idx_mapping.long().index_select(0, batch).clamp_(0, stage.num_blocks.shape[1] - 1)
    pos = positions.index_select(0, i.clamp(max=positions.shape[0] - 1)).long()
    C, ilv, rank = stage.cp_size, stage.cp_interleave, stage.cp_rank
    for g, (src, bs, kbs, k) in enumerate(
        zip(stage.tables, stage.block_sizes, stage.kernel_block_sizes, stage.kernel_blocks_per_block)
    ):
        if C == 1:
            column = torch.div(pos, kbs, rounding_mode="floor")
            offset = pos - column * kbs
            owned = live
        else:
            # vLLM's virtual block: `bs * C` tokens of the sequence, `bs` of them on each rank, in chunks of ilv.
            virtual = bs * C
            block = torch.div(pos, virtual, rounding_mode="floor")
            within = pos - block * virtual
            owned = live & (torch.div(within, ilv, rounding_mode="floor") % C == rank)
            local = torch.div(within, ilv * C, rounding_mode="floor") * ilv + within % ilv  # in [0, bs)
            column = block * k + torch.div(local, kbs, rounding_mode="floor")
            offset = local % kbs
        column = column.clamp_(0, src.shape[1] - 1)
        slot = src[req, column].long() * kbs + offset
        out[g, :T] = torch.where(owned, slot, torch.full_like(slot, PAD_SLOT_ID))


def run_stage_torch(stage: StageInputs) -> None:
    """The jobs `stage` asks for (gather, slot mappings), with the generic torch implementation."""
    if stage.do_gather:
        gather_block_tables_torch(stage)
    if stage.do_slots:
        compute_slot_mappings_torch(stage)


# -------------------------------------------------------------------------------------------------
# the BlockTables methods
# -------------------------------------------------------------------------------------------------
def gather_block_tables(bt: BlockTables, idx_mapping: torch.Tensor, num_reqs_padded: int) -> tuple[torch.Tensor, ...]:
    """`BlockTables.gather_block_tables` (documented there)."""
    _refuse_capture(bt, "gather_block_tables")
    stage = _build(bt, "gather_block_tables", idx_mapping, num_reqs_padded)
    bt.backend.prepare_inputs([], stage)  # the backend's own stage where it has one (do_slots is false)
    return stage.gathered()


def compute_slot_mappings(
    bt: BlockTables,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    num_tokens_padded: int,
    is_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """`BlockTables.compute_slot_mappings` (documented there)."""
    _refuse_capture(bt, "compute_slot_mappings")
    stage = _build(
        bt, "compute_slot_mappings", idx_mapping, None, query_start_loc, positions, num_tokens_padded, is_padding
    )
    bt.backend.prepare_inputs([], stage)  # the backend's own stage where it has one (do_gather is false)
    return stage.slots()


def prepare_inputs(
    bt: BlockTables,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    num_reqs_padded: int,
    num_tokens_padded: int,
    is_padding: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """`BlockTables.prepare_inputs` (documented there)."""
    _refuse_capture(bt, "prepare_inputs")
    stage = _build_common(
        bt._stage_config, idx_mapping, num_reqs_padded, query_start_loc, positions, num_tokens_padded, is_padding
    ) or _build(
        bt, "prepare_inputs", idx_mapping, num_reqs_padded, query_start_loc, positions, num_tokens_padded, is_padding
    )
    writer = bt._writer
    writer._stage = stage  # the writer's one backend call becomes `backend.prepare_inputs(batches, stage)`
    try:
        bt.apply_staged_writes()
    finally:
        taken = writer._stage is None
        writer._stage = None
    if not taken:  # nothing was staged (or graph mode, which applies without the writer): no backend call yet
        writer.backend.prepare_inputs([], stage)
    return stage.gathered(), stage.slots()

"""`StepInputs`: one call's inputs to the gather and the slot mappings, checked once for every backend.

Shapes, dtypes and counts are always checked. Values are checked only where the caller passed them on the host
(reading values on a GPU would synchronize the host with it): a request row outside the tables (-1, a dummy
request whose tokens get PAD and whose row is never read, is accepted), `query_start_loc`
not starting at 0 or decreasing, a negative position, a position whose kernel block lies past its request's
`num_blocks` (it would map a token to a stale block of the row's previous request). Values of device inputs are
the caller's responsibility, as in vLLM; out-of-range ones give wrong slots, never an access outside the buffers
(every kernel clamps what becomes an address).

A host input bound for a GPU is copied asynchronously on the current stream: from pinned memory as it is, from
pageable memory through a pinned copy taken from torch's pinned-memory cache (so the call never synchronizes the
device, and the caller may reuse its tensor at once).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from multiwrite.errors import StageInputError
from multiwrite.stage.layout import TablesLayout

INDEX_DTYPES = (torch.int32, torch.int64)
_T = torch.Tensor
_UNIT = (1,)  # the strides of a contiguous 1-D tensor


class StepInputs:
    """One call's step inputs, on the tables' device (what `TablesPlan.stage` and `prepare` receive).

    Attributes:
        idx_mapping: int32/int64 `[num_reqs]`: the request row of each batch entry (-1: a dummy request).
        query_start_loc: int32/int64 `[>= num_reqs + 1]`: first token of each entry, then the end; or None.
        positions: int32/int64 `[n]`: each token's position in its sequence; or None.
        is_padding: bool `[>= num_tokens_padded]` or None.
        num_computed_tokens: int32/int64 `[>= max_num_reqs]` per request row, or None: the sliding-window cut.
        num_reqs, num_reqs_padded, num_tokens_padded: ints.
        num_rows: rows of `input_block_tables` the gather writes (`>= num_reqs_padded`: rows a previous gather left
            past this one's are zeroed too).
        do_gather, do_slots: which of the two jobs the call asks for.
    """

    __slots__ = ("idx_mapping", "query_start_loc", "positions", "is_padding", "num_computed_tokens", "num_reqs",
                 "num_reqs_padded", "num_rows", "num_tokens_padded", "do_gather", "do_slots")  # fmt: skip

    def __init__(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor | None,
        positions: torch.Tensor | None,
        is_padding: torch.Tensor | None,
        num_reqs_padded: int,
        num_tokens_padded: int,
        do_gather: bool,
        do_slots: bool,
    ):
        self.idx_mapping, self.query_start_loc, self.positions, self.is_padding = (
            idx_mapping, query_start_loc, positions, is_padding
        )  # fmt: skip
        self.num_reqs = idx_mapping.shape[0]
        self.num_reqs_padded, self.num_tokens_padded = num_reqs_padded, num_tokens_padded
        self.num_rows = num_reqs_padded
        self.num_computed_tokens = None
        self.do_gather, self.do_slots = do_gather, do_slots

    @classmethod
    def on_device(
        cls,
        layout: TablesLayout,
        idx: Any,
        num_reqs_padded: Any,
        qsl: Any,
        pos: Any,
        num_tokens_padded: Any,
        pad: Any = None,
        nct: Any = None,
    ) -> StepInputs | None:
        """The inputs of a call as an engine makes it on a GPU (contiguous 1-D device tensors of accepted dtypes,
        counts in range; `num_reqs_padded` None: no gather, `num_tokens_padded` None: no slot mappings), checked in as
        few attribute reads as possible; None for anything else, which `check` then checks in full and names what is
        wrong."""
        index = layout.device_index  # (-1 for the host: this is the GPU case)
        if not (
            index >= 0 and idx.__class__ is _T and idx.get_device() == index and idx.dtype in INDEX_DTYPES
            and idx.stride() == _UNIT  # 1-D, contiguous
        ):  # fmt: skip
            return None
        n = idx.shape[0]
        if n > layout.max_num_reqs:
            return None
        do_gather = num_reqs_padded is not None
        if do_gather and not (num_reqs_padded.__class__ is int and n <= num_reqs_padded <= layout.max_num_reqs):
            return None
        do_slots = num_tokens_padded is not None
        if do_slots and not (
            qsl.__class__ is _T and pos.__class__ is _T and num_tokens_padded.__class__ is int
            and qsl.get_device() == index and pos.get_device() == index
            and qsl.dtype in INDEX_DTYPES and pos.dtype in INDEX_DTYPES and qsl.stride() == _UNIT
            and pos.stride() == _UNIT and qsl.shape[0] > n and layout.max_num_batched_tokens is not None
            and 0 <= num_tokens_padded <= layout.max_num_batched_tokens
        ):  # fmt: skip
            return None
        if pad is not None and not (
            do_slots and pad.__class__ is _T and pad.dtype is torch.bool and pad.get_device() == index
            and pad.stride() == _UNIT and pad.shape[0] >= num_tokens_padded
        ):  # fmt: skip
            return None
        if nct is not None and not (
            nct.__class__ is _T and nct.get_device() == index and nct.dtype in INDEX_DTYPES and nct.stride() == _UNIT
            and nct.shape[0] >= layout.max_num_reqs
        ):  # fmt: skip
            return None
        step = cls.__new__(cls)  # (the fields of `__init__`, set here: one call less on the hot path)
        step.idx_mapping, step.is_padding, step.num_computed_tokens = idx, pad, nct
        step.query_start_loc, step.positions = (qsl, pos) if do_slots else (None, None)
        step.num_reqs = n
        step.num_reqs_padded = step.num_rows = num_reqs_padded if do_gather else n
        step.num_tokens_padded = num_tokens_padded if do_slots else 0
        step.do_gather, step.do_slots = do_gather, do_slots
        return step

    @classmethod
    def check(
        cls,
        layout: TablesLayout,
        what: str,
        idx_mapping: Any,
        num_reqs_padded: Any = None,
        query_start_loc: Any = None,
        positions: Any = None,
        num_tokens_padded: Any = None,
        is_padding: Any = None,
        host_counts: Callable[[], np.ndarray] | None = None,
        device_only: bool = False,
        num_computed_tokens: Any = None,
    ) -> StepInputs:
        """Check one call's inputs (module docstring) and bring them to the tables' device.

        Args:
            what: the call, for messages (`"prepare_inputs"`).
            num_reqs_padded: None when the call does not gather; num_tokens_padded: None when it maps no slots.
            host_counts: int32 `[num_groups, max_num_reqs]`, the kernel blocks each request will hold when the
                slots are computed (read only for host inputs).
            device_only: refuse inputs that are not tensors on the tables' device (a call being captured in a CUDA
                graph: a host->device copy would be captured, and replay the capture's buffer every time).
            num_computed_tokens: int32/int64 `[>= max_num_reqs]`, per request row the position of its first token
                scheduled this step (the gather's sliding-window cut), or None.

        Raises:
            StageInputError: naming the argument, the value or shape found and what is accepted.
        """
        device = layout.device
        R = layout.max_num_reqs
        if device_only:
            _on_device(what, device, idx_mapping=idx_mapping, query_start_loc=query_start_loc, positions=positions,
                       is_padding=is_padding, num_computed_tokens=num_computed_tokens)  # fmt: skip
        idx_t = _vector(f"{what}: idx_mapping", idx_mapping, INDEX_DTYPES, device)
        n = idx_t.shape[0]
        if n > R:
            raise StageInputError(f"{what}: idx_mapping has {n} batch entries, more than max_num_reqs={R}")
        idx = _host(idx_mapping, idx_t, device)
        if idx is not None and n:
            bad = np.flatnonzero((idx < -1) | (idx >= R))
            if bad.size:
                b = int(bad[0])
                raise StageInputError(
                    f"{what}: idx_mapping[{b}]={int(idx[b])} is outside the tables' request rows [0, {R}) "
                    "(-1, a dummy request, is accepted)"
                )
        padded = n
        if num_reqs_padded is not None:
            padded = check_count(f"{what}: num_reqs_padded", num_reqs_padded, R, "max_num_reqs")
            if padded < n:
                raise StageInputError(
                    f"{what}: num_reqs_padded={padded} is less than num_reqs={n} (idx_mapping's length)"
                )
        nct_t = None
        if num_computed_tokens is not None:
            nct_t = _vector(f"{what}: num_computed_tokens", num_computed_tokens, INDEX_DTYPES, device)
            if nct_t.shape[0] < R:
                raise StageInputError(
                    f"{what}: num_computed_tokens has {nct_t.shape[0]} entries, needs one per request row "
                    f"(max_num_reqs = {R})"
                )
        if num_tokens_padded is None:
            step = cls(idx_t, None, None, None, padded, 0, num_reqs_padded is not None, False)
            step.num_computed_tokens = nct_t
            return step
        T_max = layout.max_num_batched_tokens
        if T_max is None:
            raise StageInputError(
                f"{what}: these BlockTables were built without max_num_batched_tokens, so they have no slot_mappings "
                "buffer; pass max_num_batched_tokens= to the constructor"
            )
        T = check_count(f"{what}: num_tokens_padded", num_tokens_padded, T_max, "max_num_batched_tokens")
        qsl_t = _vector(f"{what}: query_start_loc", query_start_loc, INDEX_DTYPES, device)
        if qsl_t.shape[0] < n + 1:
            raise StageInputError(f"{what}: query_start_loc has {qsl_t.shape[0]} entries, needs num_reqs + 1 = {n + 1}")
        pos_t = _vector(f"{what}: positions", positions, INDEX_DTYPES, device)
        pad_t = None
        if is_padding is not None:
            pad_t = _vector(f"{what}: is_padding", is_padding, (torch.bool,), device)
            if pad_t.shape[0] < T:
                raise StageInputError(f"{what}: is_padding has {pad_t.shape[0]} entries, needs num_tokens_padded = {T}")
        step = cls(idx_t, qsl_t, pos_t, pad_t, padded, T, num_reqs_padded is not None, True)
        step.num_computed_tokens = nct_t
        qsl = _host(query_start_loc, qsl_t, device)
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
            if qsl[n] > pos_t.shape[0]:
                raise StageInputError(
                    f"{what}: positions has {pos_t.shape[0]} entries for {int(qsl[n])} scheduled tokens"
                )
            pos = _host(positions, pos_t, device)
            if pos is not None and idx is not None:
                pad = None if pad_t is None else _host(is_padding, pad_t, device)
                counts = None if host_counts is None else host_counts()
                _check_positions(layout, what, idx, qsl, pos[: int(qsl[n])], pad, counts)
        return step

    def gathered(self, layout: TablesLayout) -> tuple[torch.Tensor, ...]:
        """What a gather returns: `input_block_tables[g][:num_reqs_padded]` (views, fixed addresses)."""
        views = layout.gathered_views.get(self.num_reqs_padded)
        return layout.gathered(self.num_reqs_padded) if views is None else views

    def slots(self, layout: TablesLayout) -> torch.Tensor:
        """What a slot mapping returns: `slot_mappings[:, :num_tokens_padded]` (a view, fixed address)."""
        view = layout.slot_views.get(self.num_tokens_padded)
        return layout.slots(self.num_tokens_padded) if view is None else view


def check_count(what: str, value: Any, high: int, high_name: str) -> int:
    """`value` as an int in `[0, high]`, or `StageInputError` naming `what` (a bool or tensor is refused)."""
    if value.__class__ is int and 0 <= value <= high:
        return value
    if isinstance(value, (bool, torch.Tensor)):
        raise StageInputError(f"{what} must be a Python int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise StageInputError(f"{what} must be an integer, got {value!r}") from None
    if not 0 <= value <= high:
        raise StageInputError(f"{what}={value} is outside [0, {high_name}={high}]")
    return value


def _vector(what: str, t: Any, dtypes: tuple[torch.dtype, ...], device: torch.device) -> torch.Tensor:
    """`t` checked to be a 1-D tensor of `dtypes` on `device` or on the host, contiguous on `device` (kernels read
    element `i` at `data_ptr() + i`: a strided view is copied, on the current stream)."""
    if t.__class__ is _T and t.dtype in dtypes and t.device == device and t.dim() == 1 and t.is_contiguous():
        return t
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
    if not t.is_pinned():  # pageable: through a pinned copy from torch's cache, which guards its reuse
        t = t.contiguous().pin_memory()
    return t.to(device, non_blocking=True).contiguous()


def _host(original: Any, checked: torch.Tensor, device: torch.device) -> np.ndarray | None:
    """The values of an input the caller passed on the host (checked there), or None for a device input (never
    read: that would synchronize)."""
    if device.type != "cpu" and original.device == device:
        return None
    return original.numpy()


def _on_device(what: str, device: torch.device, **tensors: Any) -> None:
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != device:
            raise StageInputError(
                f"{what} during CUDA graph capture: {name} is on {t.device}, but a captured call needs every input "
                f"tensor on the tables' device {device} (a host->device copy would be captured and every replay "
                "would copy the capture's host buffer again). Keep the step's inputs in persistent device buffers "
                "and write each step's values into them before the replay. Nothing was recorded."
            )


def _check_positions(
    layout: TablesLayout,
    what: str,
    idx: np.ndarray,
    qsl: np.ndarray,
    pos: np.ndarray,
    pad: np.ndarray | None,
    counts: np.ndarray | None,
) -> None:
    """Every scheduled, unpadded token this rank stores must address a kernel block its request holds."""
    if not pos.shape[0]:
        return
    pos = pos.astype(np.int64)
    live = np.ones(pos.shape[0], dtype=bool) if pad is None else ~pad[: pos.shape[0]]
    entry = np.searchsorted(qsl[1:], np.arange(pos.shape[0]), side="right")
    req = idx[np.minimum(entry, idx.shape[0] - 1)].astype(np.int64)
    live &= req >= 0  # (a dummy request's tokens get PAD: nothing is read for them, not even their positions)
    negative = np.flatnonzero(live & (pos < 0))
    if negative.size:
        i = int(negative[0])
        raise StageInputError(f"{what}: positions[{i}]={int(pos[i])} is negative")
    req = np.maximum(req, 0)
    C, ilv, rank = layout.cp_size, layout.cp_interleave, layout.cp_rank
    for g, (bs, kbs, k, width) in enumerate(
        zip(layout.block_sizes, layout.kernel_block_sizes, layout.kernel_blocks_per_block, layout.widths)
    ):
        if not layout.slot_mapping_enabled[g]:
            continue
        if C == 1 or not layout.dcp_sharded[g]:
            column, owned = pos // kbs, live
        else:  # the virtual block of `bs * C` tokens, `bs` of them on each rank, dealt in chunks of `ilv`
            within = pos % (bs * C)
            owned = live & ((within // ilv) % C == rank)
            local = (within // (ilv * C)) * ilv + within % ilv
            column = (pos // (bs * C)) * k + local // kbs
        held = width if counts is None else counts[g, req]
        bad = np.flatnonzero(owned & (column >= held))
        if bad.size:
            i = int(bad[0])
            b, r = int(entry[i]), int(req[i])
            limit = (
                f"past its row width {width}" if counts is None or column[i] >= width
                else f"but request row {r} holds {int(held[i])} kernel blocks of group {g}"
            )  # fmt: skip
            raise StageInputError(
                f"{what}: token {i} (batch entry {b}, request row {r}) at position {int(pos[i])} needs kernel block "
                f"column {int(column[i])} of group {g}, {limit} (kernel block size {kbs}"
                + (f", cp_size {C})" if C > 1 else ")")
            )

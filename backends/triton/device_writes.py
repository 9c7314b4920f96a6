"""`DeviceWritesRunner`: the host side of device-sourced writes on the Triton backends, one per device: builds the
set descriptors (and the address tables of per-row tensors), picks the launch's shape, and launches the kernel of
`kernels/device_writes.py` once per call (docs/device-writes.md).

The descriptors of up to two sets travel as the launch's arguments. Eager calls that need memory (the descriptors of
more sets, the address tables of per-row tensors) or scan flags write it into a slot of a ring of pinned host memory
(`SlotRing`) that `SlotMirror` copies into device memory on a side stream; the slot is released by that copy and the
kernel reads device memory and stores nothing into host memory. The slot's scan state lives on the device. Calls that
need neither take no slot. A call made while the current stream captures a CUDA graph (or a `simulated_capture`)
gets a pinned buffer and a scan state of its own that are never rewritten and kept for the process (the graph reads
them over UVA at every replay); the replay reads the device inputs at their captured addresses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from multiwrite.backends.triton.device import TritonDevice
from multiwrite.backends.triton.kernels import device_writes as kernel
from multiwrite.backends.triton.launcher import Launcher
from multiwrite.backends.triton.mirror import SlotMirror
from multiwrite.backends.triton.ring import SlotRing
from multiwrite.capture import is_capturing, setup_calls
from multiwrite.errors import StagedWriteError

if TYPE_CHECKING:
    from multiwrite.device_writes import DeviceWrites

_SET_WORDS = kernel.SET_WORDS.value
_STATE_WORDS = kernel.STATE_WORDS.value
_DTYPE_CODE = {torch.int32: 0, torch.int64: 1, torch.float32: 2}
#: (block_w, block_l) of the tiles: short writes (every length known to be at most 8), medium (at most 256), long
#: (longer, or not known), ordered. A long tile is one write of 1024 cells: the fastest of the shapes measured for
#: `bench --sglang`'s extends on the H200 at bs 32, 256 and on rows of 100K (4.8, 5.7, 4.9 us against 5.2, 7.4, 6.4
#: for 4 writes x 256; scripts/probe_extend_split.py, docs/sglang.md).
_TILES = {"short": (128, 8), "medium": (4, 256), "long": (1, 1024), "ordered": (16, 32)}
#: Writes per scan block (a multiple of every tile's `block_w`): a flat set of at most this many writes is scanned
#: without flags (kernel docstring).
SCAN_W = 1024
#: Column splits of a tile at most. How many a launch takes is bounded by the runner's `split_budget` instead:
#: programs cost device time even when they find nothing to copy (bs 256 of `bench --sglang` on the H200: 512
#: programs 7.6 us, 4096 programs 13.4 us), and only a launch of few tiles, such as four rows of 100K tokens, needs
#: many splits (5 to 8 us where 4 splits took 29 us; scripts/probe_extend_split.py).
MAX_SPLITS = 1024
#: Values of one flat source the flag words can count (40 bits).
MAX_VALUES = (1 << 40) - 1
_NO_SETS = (0,) * (kernel.ARG_SETS_MAX * _SET_WORDS)


def _state(device: torch.device, capacity: int) -> torch.Tensor:
    """A fresh scan state: two unused words, epoch 1, `capacity` zeroed flags."""
    state = torch.zeros(_STATE_WORDS + max(capacity, 1), dtype=torch.int64, device=device)
    state[2:3].fill_(1)  # (a fill kernel: `state[2] = 1` copies a CPU scalar, which a CUDA graph capture refuses)
    return state


class DeviceWritesRunner:
    """Device-sourced writes of one `TritonDevice` (module docstring). Thread-safe: the ring is used under the
    device's lock from taking a slot until the launch is issued."""

    def __init__(self, device: TritonDevice):
        self.device = device
        with setup_calls(device.device):
            self.ring = SlotRing(device, device.depth, np.int64, "device writes")
            self.mirror = SlotMirror(self.ring)
            self.states = [_state(device.device, 64) for _ in range(device.depth)]
            self.noop_state = _state(device.device, 1)
            self.unread_faults = torch.zeros(8, dtype=torch.int64, device=device.device)  # faults nobody asked for
        noop = self.noop_state.data_ptr()
        self.launcher = Launcher(device, kernel.device_writes_kernel, 4,
                                 lambda done, counter, token: kernel.noop_args(done, counter, token, state_addr=noop))
        #: Programs the column splits may bring a launch to (MAX_SPLITS): half the device's program budget.
        self.split_budget = max(1, device.max_programs // 2)
        self.captured: list[object] = []  # what captured launches read at every replay: kept for the process
        self._consts: dict[tuple, dict] = {}

    def apply(self, table: torch.Tensor, writes: Sequence[DeviceWrites], ordered: bool,
              faults: torch.Tensor | None) -> None:  # fmt: skip
        """One launch of the kernel for every set of `writes` (checked by `apply_device_writes`). A launch that
        reads no host memory (the descriptors as its arguments, no address tables) and no scan flags takes no
        staging slot."""
        if table.shape[1] >= 1 << 31:
            raise StagedWriteError(f"triton: rows of {table.shape[1]} cells (at most 2^31 - 1)")
        bound = _bound(writes, table)
        tile = "ordered" if ordered else ("short" if bound <= 8 else "medium" if bound <= 256 else "long")
        block_w, block_l = _TILES[tile]
        tiles = [(w.num_writes + block_w - 1) // block_w for w in writes]
        total = sum(tiles)
        arg_sets = len(writes) if len(writes) <= kernel.ARG_SETS_MAX else 0
        words = (0 if arg_sets else len(writes) * _SET_WORDS) + sum(_table_words(w) for w in writes)
        scanned = int(any(w.kind == "values" and w.num_writes > SCAN_W for w in writes))
        if ordered:
            grid0 = splits = 1
        else:
            chunks = (min(bound, table.shape[1]) + block_l - 1) // block_l
            splits = max(1, min(chunks, MAX_SPLITS, self.split_budget // max(total, 1)))
            grid0 = max(1, min(total, self.device.max_programs // splits))
        codes = {_DTYPE_CODE[w.values.dtype if w.kind == "values" else w.source_dtype] for w in writes}  # type: ignore
        source = codes.pop() if len(codes) == 1 else -1
        variant = (table.dtype, tile, arg_sets, source, SCAN_W, block_w, block_l)
        consts = self._consts.get(variant)
        if consts is None:
            from multiwrite.backends.triton.device import _TL

            np_char = np.dtype(str(table.dtype).removeprefix("torch.")).char
            consts = self._consts[variant] = {"VALUE_DTYPE": _TL[np_char], "BLOCK_W": block_w, "BLOCK_L": block_l,
                                              "SCAN_W": SCAN_W, "ORDERED": ordered, "ARG_SETS": arg_sets,
                                              "SOURCE": source}  # fmt: skip
        tail = (table.data_ptr(), table.stride(0), table.stride(1), table.shape[0], table.shape[1], len(writes),
                total)  # fmt: skip
        fault_addr = (self.unread_faults if faults is None else faults).data_ptr()
        if is_capturing(table.device):
            self._captured_launch(writes, tiles, words, arg_sets, scanned, variant, consts, (grid0, splits),
                                  fault_addr, tail)  # fmt: skip
            return
        if not words and not scanned:
            sets = _describe(None, writes, tiles, arg_sets, 0)
            state = self.noop_state  # (never read: nothing scanned)
            args = (*_lead(0, sets, state, fault_addr), 0, 0, 0, *_tail(tail, state, scanned))
            self.launcher.launch(variant, consts, grid0, splits, args)
            return
        with self.device.lock:
            lease = self.ring.acquire(1, words + 1)
            try:
                buf = self.mirror.buffer(lease.slot, words)
                sets = _describe(lease.values[:words], writes, tiles, arg_sets, buf.data_ptr())
                state = self.states[lease.slot]
                if state.shape[0] - _STATE_WORDS < total:
                    self.mirror.retire(lease.slot, state)
                    state = self.states[lease.slot] = _state(table.device, max(total, 2 * state.shape[0]))
            except BaseException:
                self.ring.release(lease)
                raise
            self.mirror.hand_over(lease, buf, words, (writes, state))  # from here on the copy releases the slot
            try:  # (no completion word: the kernel stores nothing into host memory)
                args = (*_lead(buf.data_ptr(), sets, state, fault_addr), self.ring.counter_addrs[lease.slot], 0, 0,
                        *_tail(tail, state, scanned))  # fmt: skip
                self.launcher.launch(variant, consts, grid0, splits, args)
            finally:
                self.mirror.launched(lease.slot)

    def _captured_launch(self, writes, tiles, words, arg_sets, scanned, variant, consts, grid, fault_addr,
                         tail) -> None:  # fmt: skip
        """The launch of a call being captured: descriptors and scan state of its own, kept for the process. No
        completion word (done 0): its memory is never rewritten, so no replay needs to say it has read it (and the
        kernel skips the store into host memory and, unless it scans, its completion counter)."""
        device = self.device
        total = tail[-1]
        with setup_calls(device.device):
            desc = torch.zeros(max(words, 1), dtype=torch.int64, pin_memory=device.is_gpu)
        state = _state(device.device, total)
        counter = torch.zeros(1, dtype=torch.int32, device=device.device)
        sets = _describe(desc.numpy()[:words], writes, tiles, arg_sets, desc.data_ptr())
        self.captured.append((desc, state, counter, writes))
        args = (*_lead(desc.data_ptr(), sets, state, fault_addr), counter.data_ptr(), 0, 0,
                *_tail(tail, state, scanned))  # fmt: skip
        self.launcher.launch(variant, consts, *grid, args, jit=device.is_gpu)


def _lead(sets_addr: int, sets: tuple[int, ...], state: torch.Tensor, fault_addr: int) -> tuple[int, ...]:
    """The kernel's arguments before the completion counter, word and token: the memory of the descriptors and
    address tables, the descriptor arguments, the scan state, the fault record."""
    return (sets_addr, *sets, state.data_ptr(), fault_addr)


def _tail(tail: tuple, state: torch.Tensor, scanned: int) -> tuple:
    """The kernel's arguments after the token: the table's and the launch's (`tail`), the flags' capacity of
    `state`, whether flags are used."""
    return (*tail, state.shape[0] - _STATE_WORDS, scanned)


def _bound(writes: Sequence[DeviceWrites], table: torch.Tensor) -> int:
    """The largest length the host knows of (host copies, `max_length`), else the table's width."""
    bound = 0
    for w in writes:
        known = w.length_bound
        if known is None:
            return int(table.shape[1])
        bound = max(bound, known)
    return bound


def _inline(w: DeviceWrites) -> bool:
    """A set of one per-row tensor whose size the host checked: its address travels in the descriptor itself."""
    return w.kind == "tensors" and w.num_writes == 1 and w.host_arrays is not None


def _table_words(w: DeviceWrites) -> int:
    """int64 words of a set's address table in host memory: the addresses of per-row tensors, and their sizes where
    the kernel checks the lengths against them (no host copies)."""
    if w.kind != "tensors" or _inline(w):
        return 0
    return w.num_writes * (1 if w.host_arrays is not None else 2)


def _describe(out: np.ndarray | None, writes: Sequence[DeviceWrites], tiles: list[int], arg_sets: int,
              out_addr: int) -> tuple[int, ...]:  # fmt: skip
    """The set descriptors: returned as the launch's `ARG_SETS_MAX * SET_WORDS` descriptor arguments when
    `arg_sets`, else written at the start of `out` (int64, at address `out_addr`; the arguments then zeros); the
    addresses and sizes of per-row tensors follow in `out`."""
    first = 0
    tail = 0 if arg_sets else len(writes) * _SET_WORDS
    described: list[int] = []
    for s, (w, t) in enumerate(zip(writes, tiles)):
        i64 = torch.int64
        flags = (w.rows.dtype == i64) | (w.starts.dtype == i64) << 1 | (w.lengths.dtype == i64) << 2
        if w.kind == "values":
            if w.values.shape[0] > MAX_VALUES:  # type: ignore[union-attr]
                raise StagedWriteError(f"triton: set {s} has more than 2^40 - 1 values")
            source, count, code = w.values.data_ptr(), w.values.shape[0], _DTYPE_CODE[w.values.dtype]  # type: ignore
        else:
            flags |= 1 << 3
            code, count = _DTYPE_CODE[w.source_dtype], 0  # type: ignore[index]
            if w.kind == "addresses":
                source = w.sources.data_ptr()  # type: ignore[union-attr]
            elif _inline(w):
                flags |= 1 << 6
                source = int(w.source_addresses[0])  # type: ignore[index]
            else:
                n = w.num_writes
                out[tail : tail + n] = w.source_addresses  # type: ignore[index]
                source = out_addr + 8 * tail
                if w.host_arrays is None:  # (with host copies the lengths were checked against the sizes already)
                    out[tail + n : tail + 2 * n] = w.source_sizes  # type: ignore[index]
                    count = out_addr + 8 * (tail + n)
                tail += _table_words(w)
        flags |= code << 4
        described += (w.rows.data_ptr(), w.starts.data_ptr(), w.lengths.data_ptr(), source, w.num_writes, first,
                      flags, count)  # fmt: skip
        first += t
    if not arg_sets:
        out[: len(described)] = described  # type: ignore[index]
        return _NO_SETS
    return (*described, *_NO_SETS[len(described) :])

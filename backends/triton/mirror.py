"""`SlotMirror`: a device copy of each slot of a `SlotRing`, written on a side stream, for kernels that would
otherwise read their slot of pinned host memory over UVA (docs/device-writes.md, "Where the kernel reads its
tables").

Why. A kernel reading host memory waits a host round trip before its first dependent read (1.1-1.8 us more than
device memory on the H200), and a kernel that hands its slot back counts its programs out with an atomic and stores
into host memory at its end (1.5 us of device time at 256 programs, docs/sglang.md). A call through the mirror
instead copies the slot on the device's side stream and makes the current stream wait for that copy (an event)
before its launch: the copy runs while the stream still runs the work queued before the call, and the kernel reads
device memory.

Who releases what. The slot's token travels as the word after the copied values and is copied back into the slot's
completion word once the copy has landed, on the side stream: the slot of host memory is released by its copy, not
by the kernel, which stores nothing into host memory. The slot's device buffer is overwritten only after the kernel
that last read it: the side stream waits for that launch's event (`launched`) before the next copy into it. That
ordering also puts the next launch on the slot after the previous one (the current stream waits for the copy, which
waited for it), so the slot's scan state and counter are never used by two launches at once.

On a CPU (Triton's interpreter) both copies are plain synchronous ones, so that the same path runs and is tested
there.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from multiwrite.backends.triton.ring import SlotRing
from multiwrite.capture import setup_calls
from multiwrite.staging.arena import Lease


class SlotMirror:
    """Device copies of the slots of `ring` (int64 values; module docstring). Used under the ring owner's lock.

    Args:
        ring: the ring whose slots it mirrors (`np.int64` values).
    """

    def __init__(self, ring: SlotRing):
        self.ring = ring
        self.device = ring.owner.device
        self.is_gpu = ring.owner.is_gpu
        depth = ring.depth
        self.stream = torch.cuda.Stream(self.device) if self.is_gpu else None
        self.copied = torch.cuda.Event() if self.is_gpu else None
        self.read = [torch.cuda.Event() if self.is_gpu else None for _ in range(depth)]  # the slot's last launch
        self.pending: list[torch.cuda.Stream | None] = [None] * depth  # a launch's stream until `launched` ran
        self.buffers: list[torch.Tensor | None] = [None] * depth
        self.views: list[tuple[np.ndarray, torch.Tensor] | None] = [None] * depth  # a slot's memory as a tensor

    def buffer(self, slot: int, words: int) -> torch.Tensor:
        """The device buffer of `slot` with room for `words` int64 values and the token after them (grown by
        doubling; the old buffer is freed once the launch that last read it is done)."""
        buf = self.buffers[slot]
        if buf is None or buf.shape[0] < words + 1:
            size = max(words + 1, 64, 2 * (0 if buf is None else buf.shape[0]))
            if buf is not None:
                self.retire(slot, buf)
            # (allocated on the side stream, which writes it: a block freed on the current stream may still be in
            # use by work queued there, which the side stream does not wait for)
            side = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
            with setup_calls(self.device), side:
                buf = self.buffers[slot] = torch.empty(size, dtype=torch.int64, device=self.device)
        return buf

    def retire(self, slot: int, tensor: torch.Tensor) -> None:
        """`tensor`, read by the slot's launches and about to be replaced (its buffer, its scan state), is freed
        only once the launch that last read it is done: the slot itself may be released before that launch ran."""
        if self.stream is not None:
            self._after_last_launch(slot)
            tensor.record_stream(self.stream)  # (the allocator reuses it only after the stream passed that wait)

    def _after_last_launch(self, slot: int) -> None:
        """The side stream waits for the slot's last launch: its event, or (a launch interrupted before `launched`
        recorded it) everything its stream held then."""
        pending = self.pending[slot]
        if pending is not None:
            self.stream.wait_stream(pending)  # type: ignore[union-attr]
            self.pending[slot] = None
        self.stream.wait_event(self.read[slot])  # type: ignore[union-attr, arg-type]

    def hand_over(self, lease: Lease, buf: torch.Tensor, words: int, keep: object) -> None:
        """Copy the first `words` values of `lease` (acquired from the ring, for room of `words + 1`) into `buf`
        (`buffer(lease.slot, words)`), ordered before whatever the current stream runs next, and have the slot
        released once the copy has landed. `keep` stays referenced until the slot's next hand-over (the slot's
        scan state and buffer are guarded by `retire`; the caller's tensors by torch's stream rule). Call `launched`
        after the launch that reads `buf`, whether it was issued or not."""
        ring, slot = self.ring, lease.slot
        token, queued = None, False
        try:
            token = ring.hand_over(lease, keep)
            lease.values[words] = token
            view = self.views[slot]
            if view is None or view[0] is not lease.values:
                view = self.views[slot] = (lease.values, torch.from_numpy(lease.values))
            src, done = view[1][: words + 1], ring.done_t[slot : slot + 1]
            gpu = self.stream is not None
            current = torch.cuda.current_stream(self.device) if gpu else None
            with torch.cuda.stream(self.stream) if gpu else contextlib.nullcontext():
                if gpu:
                    self._after_last_launch(slot)
                buf[: words + 1].copy_(src, non_blocking=gpu)  # (pinned memory: an asynchronous DMA)
                done.copy_(buf.view(torch.int32)[2 * words : 2 * words + 1], non_blocking=gpu)  # (the token's low half)
                queued = True
                if gpu:
                    self.copied.record(self.stream)  # type: ignore[union-attr]
            if gpu:
                current.wait_event(self.copied)  # type: ignore[union-attr, arg-type]
                self.pending[slot] = current
        except BaseException:
            if token is not None and not queued:  # (`hand_over` frees the slot itself when it fails)
                ring.launch_failed(lease, token)  # no copy will release it
            raise

    def launched(self, slot: int) -> None:
        """The launch reading the buffer of `slot` was issued (or failed): the next copy into it waits for it."""
        pending = self.pending[slot]
        if pending is not None:
            self.read[slot].record(pending)  # type: ignore[union-attr]
            self.pending[slot] = None

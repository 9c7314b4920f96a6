"""Staging memory the Triton kernels read in place: rings of slots of pinned host memory, each guarded by a
completion word.

A launch reading a slot takes the slot's next token; its last program stores the token into the slot's pinned
completion word (no driver call). A slot is handed out again only once its word holds its token, so no slot is ever
rewritten while a launched kernel, or a queued one, may still read it. (The device-writes ring's slots are read by a
copy instead, which stores the token itself once it has landed: `SlotMirror`.) One ring per staging arena lends its
slots to it (`SlotRing` is its `StagingBuffers`): the arena stages into a slot and an apply launches on it in place,
without a copy. Each device also has a shared ring per dtype for batches that arrive as plain arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from multiwrite.capture import settle, setup_calls
from multiwrite.staging.arena import Lease, StagingBuffers
from multiwrite.staging.layout import META_COLUMNS
from multiwrite.staging.wait import wait_until

if TYPE_CHECKING:
    from multiwrite.backends.triton.device import TritonDevice

_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SlotRing(StagingBuffers):
    """`depth` slots of host memory (pinned on a GPU) for values of one dtype, each with its completion word.

    Args:
        owner: the `TritonDevice` whose kernels read the slots.
        depth: slots (>= 2 for a ring lent to an arena: it stages into one while a kernel reads another).
        np_dtype: numpy dtype of the values.
        name: whose ring it is, for messages.

    Not locked: a ring lent to an arena is used by the one thread that stages into the arena; the shared rings are
    used under the device's lock.
    """

    def __init__(self, owner: TritonDevice, depth: int, np_dtype: type[np.generic], name: str):
        self.owner = owner
        self.depth = depth
        self.np_dtype = np.dtype(np_dtype)
        self.name = name
        pin = owner.is_gpu
        self.done_t = torch.zeros(depth, dtype=torch.int32, pin_memory=pin)
        self.done = self.done_t.numpy()
        self.counters = torch.zeros(depth, dtype=torch.int32, device=owner.device)
        settle(owner.device)  # the zeroed counters are complete whatever stream launches next
        self.counter_addrs = [self.counters.data_ptr() + 4 * i for i in range(depth)]
        self._buffers: list[torch.Tensor] = [torch.empty(0)] * depth
        self.leases = [self._slot(i, 64, 1024, token=0) for i in range(depth)]
        self.next = 0  # the slot the next `acquire` hands out
        self.succ = [(i + 1) % depth for i in range(depth)]

    def _slot(self, i: int, wcap: int, vcap: int, token: int) -> Lease:
        """Memory for slot `i`: `[meta int32 [wcap, 5] | bounds int32 [wcap + 1] | values [vcap]]`."""
        b_off = _align(wcap * META_COLUMNS * 4)
        v_off = b_off + _align((wcap + 1) * 4)
        with setup_calls(self.owner.device):  # (a pinned allocation: safe while another thread captures)
            buf = torch.empty(v_off + vcap * self.np_dtype.itemsize, dtype=torch.uint8, pin_memory=self.owner.is_gpu)
        raw = buf.numpy()
        meta = raw[:b_off].view(np.int32)[: wcap * META_COLUMNS].reshape(wcap, META_COLUMNS)
        bounds = raw[b_off:v_off].view(np.int32)[: wcap + 1]
        values = raw[v_off:].view(self.np_dtype)
        lease = Lease(meta, values, bounds, done_addr=self.done_t.data_ptr() + 4 * i, slot=i, lender=self)
        lease.token = token  # the completion word holds the last token stored for this slot
        self._buffers[i] = buf
        return lease

    # -- StagingBuffers --------------------------------------------------------------------------------------
    def acquire(self, write_capacity: int, value_capacity: int, why: Callable[[str], str] | None = None) -> Lease:
        """The next slot, once nothing launched reads it (waits: `RingWaitWarning` after 1 s, `RingStallError`
        after 10 s; `why` gives the message, default the ring's), with room for `write_capacity` writes and
        `value_capacity` values (a larger allocation when it has none: rare)."""
        i = self.next
        lease = self.leases[i]
        if not lease.released():
            what = why or (lambda how: self._waiting(lease, how))
            wait_until(lease.released, what, self.owner.device)
        if lease.meta_cap < write_capacity or lease.values_cap < value_capacity:
            lease = self.leases[i] = self.grow(lease, max(write_capacity, lease.meta_cap),
                                                max(value_capacity, lease.values_cap))  # fmt: skip
        self.next = self.succ[i]
        return lease

    def grow(self, lease: Lease, write_capacity: int, value_capacity: int) -> Lease:
        """Larger memory for `lease`'s slot (released or not yet launched; the arena copies what it staged). The
        ring's own record of the slot changes when the new memory is handed out or launched, not here: an arena
        interrupted before it adopts the new memory keeps staging into, and launching, the old one."""
        return self._slot(lease.slot, write_capacity, value_capacity, lease.token)

    def handed_over(self, lease: Lease) -> None:
        """Record `lease` as the memory of its slot: the one the slot's completion word guards from now on."""
        self.leases[lease.slot] = lease

    def hand_over(self, lease: Lease, keep: object) -> int:
        """What precedes every launch (or device copy) that reads `lease`, a slot of this ring: its next token (the
        return value), `keep` referenced by the lease until the slot's next hand-over, and `lease` recorded as the
        memory the slot's completion word guards (`handed_over`). Interrupted after the token advanced, the slot is
        free again (nothing read it) before the interrupt propagates."""
        before = lease.token
        try:
            token = lease.next_token()
            lease.keep = keep
            self.leases[lease.slot] = lease
        except BaseException:
            if lease.token != before:
                self.launch_failed(lease, lease.token)
            raise
        return token

    def release(self, lease: Lease) -> None:
        """`lease`, acquired for an apply that failed before its launch, goes back: the next `acquire` returns it."""
        if (lease.slot + 1) % self.depth == self.next and self.leases[lease.slot] is lease:
            self.next = lease.slot

    def close(self) -> None:
        """The arena is gone: the memory is freed once no launched kernel reads it."""
        self.owner.retire(self)

    # -- launches --------------------------------------------------------------------------------------------
    def launch_failed(self, lease: Lease, token: int) -> None:
        """A launch that was to read `lease` with `token` did not happen: the slot is free again."""
        self.done[lease.slot] = token

    def idle(self) -> bool:
        """True when no launched kernel may still read any slot."""
        return all(lease.released() for lease in self.leases)

    def _waiting(self, lease: Lease, why: str) -> str:
        return (
            f"staging slot {lease.slot} of the {self.name} ring (depth {self.depth}) of the multiwrite Triton backend "
            f"on {self.owner.device} {why} to be released by the kernel (or copy) that reads it (completion token "
            f"{lease.token}, its word holds {int(self.done[lease.slot])}). Likely causes: the stream that kernel was "
            "launched on is held up by long work queued before it; more applies (or, in graph mode, committed "
            "batches no replay has consumed) in flight than ring slots (MULTIWRITE_TRITON_RING_DEPTH); or the launch "
            "never ran. Nothing was applied or committed; the staged writes stay staged."
        )

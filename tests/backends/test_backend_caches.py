"""What the backends cache per table layout (plans, descriptors) never writes the wrong memory or bit pattern, and
keeps no table alive; every built-in backend."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import torch

from multiwrite import FusedStagedWriter, StagedWriteTensor
from multiwrite.reference import apply_writes_reference
from tests.support.tables import host


def test_a_float32_view_of_an_int32_table_already_known_is_written_with_float32_bits(backend):
    writer = FusedStagedWriter(backend.device, backend.name)
    ints = StagedWriteTensor((2, 4), torch.int32, backend.device, name="ints")
    ints.stage_write(0, 0, [1, 2, 3])
    writer.apply([ints])  # the backend now knows this address, shape and strides as an int32 table
    floats = StagedWriteTensor((2, 4), torch.float32, backend.device, name="floats")
    floats.tensor = ints.tensor.view(torch.float32)  # same storage, shape and strides; float32 bits
    floats.stage_write(0, 1, [1.5, -2.25])
    floats.stage_write(1, 3, [3.0])
    writer.apply([floats])
    expected = np.array([[1, 2, 3, 0], [0, 0, 0, 0]], dtype=np.int32)
    apply_writes_reference(expected.view(np.float32), [(0, 1, [1.5, -2.25]), (1, 3, [3.0])])
    np.testing.assert_array_equal(host(ints.tensor), expected)  # bit for bit


def test_a_dropped_table_is_freed_and_a_new_one_at_its_address_is_written_in_its_own_dtype(backend):
    """Every table is installed over the same 64 bytes of one pool, alternately int32 and float32 (a fresh allocation
    is not guaranteed to land where a freed one was): an entry left by a dead table at a reused address and shape
    addresses the new table's memory in the new table's dtype, and no cache holds the table object alive."""
    writer = FusedStagedWriter(backend.device, backend.name)
    pool = torch.zeros(64, dtype=torch.uint8, device=backend.device)
    for i in range(6):
        dtype = torch.float32 if i % 2 else torch.int32
        pool.zero_()
        t = StagedWriteTensor((4, 4), dtype, backend.device, name="t")
        t.tensor = pool.view(dtype).view(4, 4)
        t.stage_write(i % 4, i % 3, [i, i + 1])
        writer.apply([t])
        expected = apply_writes_reference(np.zeros((4, 4), host(t.tensor).dtype), [(i % 4, i % 3, [i, i + 1])])
        np.testing.assert_array_equal(host(t.tensor), expected)
        assert t.tensor.data_ptr() == pool.data_ptr()
        dead = weakref.ref(t)
        del t
        gc.collect()  # a StagedWriteTensor and its staging arena refer to each other
        assert dead() is None

"""Host-side staging: staged writes wait in a staging arena (`arena`) until one apply lands them all.

`table` (`StagedWriteTensor`) and `block_ids` (`BlockTables.append_block_ids`) stage into arenas; `fields` holds
the arena's C-level fields (compiled in `_cstaging_arena.c`, or their Python twins); `layout` and `values` define
and check what a staged write is; `headers` is graph mode's ring of published batches.
"""

from multiwrite._deprecated import moved_names

_LAYOUT = "multiwrite.staging.layout"
#: 0.2.0's `multiwrite/staging.py` held these names; they live in the submodules now (deprecated, removed in 0.4.0).
__getattr__ = moved_names("multiwrite.staging", globals(), {
    **dict.fromkeys(("META_TABLE", "META_ROW", "META_START", "META_LENGTH", "META_VALUE_OFFSET", "META_COLUMNS",
                     "SUPPORTED_DTYPES", "dtype_name", "shape_text", "strict_index", "check_dtype", "check_device",
                     "device_unavailable_reason"), _LAYOUT),
    "StagedWriteTensor": "multiwrite.staging.table",
    "expand_kernel_blocks": "multiwrite.staging.values",
})  # fmt: skip

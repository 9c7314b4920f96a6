"""Host-side staging: staged writes wait in a staging arena (`arena`) until one apply lands them all.

`table` (`StagedWriteTensor`) and `block_ids` (`BlockTables.append_block_ids`) stage into arenas; `fields` holds
the arena's C-level fields (compiled in `_cstaging_arena.c`, or their Python twins); `layout` and `values` define
and check what a staged write is; `headers` is graph mode's ring of published batches.
"""

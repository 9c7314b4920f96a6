"""multiwrite in vLLM: `BlockTables` with vLLM 0.33's signature over multiwrite's (docs/vllm.md)."""

from multiwrite.vllm.block_tables import BlockCounts, BlockTables, GroupTable

__all__ = ["BlockCounts", "BlockTables", "GroupTable"]

"""`multiwrite.bench.paged_attention`: the page maps a step's gathered table gives, the KV write's PAD handling, and
both attention implementations against dense attention (decode and a prefill chunk)."""

from __future__ import annotations

import pytest
import torch

from multiwrite.bench.paged_attention import PagedAttention, PagedBatch, dense_attention, write_kv

BS = 4  # tokens per page


def _batch() -> tuple[PagedBatch, torch.Tensor]:
    """Entry 0 at positions 0..9 on pages [5, 2, 7]; entry 1 at 0..3 on page [3]; entry 2 padding (stale row)."""
    gathered = torch.tensor([[5, 2, 7, 0], [3, 0, 0, 0], [6, 6, 6, 6]], dtype=torch.int32)
    q_pos = torch.tensor([[7, 8, 9], [3, -1, -1], [-1, -1, -1]])  # entry 0: a 3-token chunk; entry 1: a decode
    batch = PagedBatch(3, 4, 3, BS, num_slots=8 * BS, device="cpu")
    batch.update(gathered, q_pos)
    return batch, gathered


def test_the_page_maps_name_each_listed_page_s_entry_and_column_and_nothing_else():
    batch, _ = _batch()
    assert batch.kv_len.tolist() == [10, 4, 0] and batch.num_blocks().tolist() == [3, 1, 0]
    assert batch.owner.tolist() == [-1, -1, 0, 1, -1, 0, -1, 0, -1]  # page 6 is only in the padding entry's row
    assert batch.logical.tolist() == [-1, -1, 1, 0, -1, 0, -1, 2, -1]
    # entry 1's one page holds positions 0..3, all at most its query's: full (no key of it is masked)
    assert batch.num_full.flatten().tolist() == [2, 1, 0] and batch.full[0, 0, 0, :2].tolist() == [5, 2]
    assert batch.full[1, 0, 0, 0].item() == 3
    assert batch.num_partial.flatten().tolist() == [1, 0, 0] and batch.partial[0, 0, 0, 0].item() == 7


def test_a_chunk_s_pages_past_its_first_query_are_partial_not_full():
    """FlexAttention's compiled kernels skip the mask on full blocks: a page holding a position after a query of the
    entry must be partial, or that query sees later keys (measured on the H200: errors of 4.9 against dense
    attention in the decode example, every slot right, while the eager reference, which masks everything, passed)."""
    gathered = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
    batch = PagedBatch(1, 4, 8, BS, num_slots=8 * BS, device="cpu")
    batch.update(gathered, torch.arange(2, 10)[None, :])  # a chunk at positions 2..9 over pages [5, 2, 7]
    assert batch.num_full.flatten().tolist() == [0]
    assert batch.num_partial.flatten().tolist() == [3] and batch.partial[0, 0, 0, :3].tolist() == [5, 2, 7]
    batch.update(gathered, torch.tensor([[4, 5, 6, 7, 8, 9, -1, -1]]))  # from position 4: page 5 (0..3) is full
    assert batch.full[0, 0, 0, :1].tolist() == [5] and batch.partial[0, 0, 0, :2].tolist() == [2, 7]


def test_write_kv_puts_each_token_at_its_slot_and_pad_tokens_in_the_dump_block():
    cache = torch.zeros(2, 3 * BS, 1)  # [kv_heads, 2 pages + the dump page, head_dim]
    new = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]).unsqueeze(-1)  # [T, kv_heads, head_dim]
    write_kv(cache, torch.tensor([6, -1, 1]), new)
    assert cache[:, 6, 0].tolist() == [1.0, 2.0] and cache[:, 1, 0].tolist() == [5.0, 6.0]
    assert cache[:, -1, 0].tolist() == [3.0, 4.0]  # the PAD token, in the dump block's last slot
    assert int((cache != 0).sum()) == 6


@pytest.mark.parametrize("impl", ["flex-paged", "sdpa-gathered"])
def test_attention_through_the_gathered_pages_equals_dense_attention_over_each_history(impl):
    torch.manual_seed(0)
    batch, gathered = _batch()
    k_cache, v_cache = torch.randn(2, 9 * BS, 8), torch.randn(2, 9 * BS, 8)
    q = torch.randn(3, 4, 3, 8)  # 4 query heads over 2 KV heads
    out = PagedAttention(impl)(q, k_cache, v_cache, batch)
    for b, length, queries in ((0, 10, 3), (1, 4, 1)):
        slots = (gathered[b, :, None].long() * BS + torch.arange(BS)).flatten()[:length]
        want = dense_attention(q[b, :, :queries], k_cache[:, slots].transpose(0, 1), v_cache[:, slots].transpose(0, 1),
                               batch.q_pos[b, :queries])  # fmt: skip
        assert torch.allclose(out[b, :, :queries].double(), want, atol=1e-5), (impl, b)
    # the chunk is causal: its first query (position 7) does not see positions 8 and 9
    early = dense_attention(q[0, :, :1], k_cache[:, [20, 21, 22, 23, 8, 9, 10, 11]].transpose(0, 1),
                            v_cache[:, [20, 21, 22, 23, 8, 9, 10, 11]].transpose(0, 1), torch.tensor([7]))  # fmt: skip
    assert torch.allclose(out[0, :, :1].double(), early, atol=1e-5)

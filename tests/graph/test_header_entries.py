"""What a commit writes into its header entry (the wire format of `multiwrite/staging/headers.py`) and how a replay
reads it back: white-box where no public behaviour shows the word in question on a CPU."""

from __future__ import annotations

from multiwrite.staging.headers import H_COUNTS, H_META, H_NUM_VALUES, H_SEQ, H_TOKEN
from tests.graph.model import GraphModel, graph_tables


def test_an_inline_batch_whose_checksum_does_not_match_is_read_again_and_applied_exactly():
    """A replay that reads an inline entry while the host writes it sees a mix of two batches, which the checksum
    (the token word) catches: it reads the entry again, ordered after the sequence word. Here the checksum word of
    a committed entry is made wrong: the replay must count one re-read and still apply exactly its batch."""
    m = GraphModel()
    ring = m.bt.graph.ring
    for step in range(3):  # entries that match: read once each
        m.stage(step, ([step + 1, step + 2], [step + 3], [step + 4]), True)
        m.commit()
        m.replay()
    m.check("matching entries")
    assert ring.rereads == 0
    m.stage(2, ([41, 42, 43], [44], [45, 46]), True)
    m.stage(3, ([47], [], [48]), False)
    h = m.commit()
    entry = ring.entry(h)
    assert entry[H_COUNTS] < 0 and entry[H_SEQ] == h + 1  # inline (the sign bit), published
    entry[H_TOKEN] += 1
    m.replay()
    m.check("the re-read entry")
    assert ring.rereads == 1
    assert m.bt[0].tensor[2, :3].tolist() == [41, 42, 43] and m.bt[2].tensor[3, :1].tolist() == [48]


def test_a_batch_of_65537_overlap_rounds_is_published_with_every_round_and_not_inline():
    """65,537 writes to one cell are 65,537 overlap rounds: the counts word must carry every write and every round
    (`num_writes | num_rounds << 32`, no INLINE sign bit). A layout with the INLINE flag inside the rounds' bits read
    65,536 rounds as an inline batch of no rounds, and its replay applied nothing. Replaying that many rounds through
    the interpreter takes minutes: the replay itself runs on a GPU (tests/gpu/test_graph_replays.py)."""
    bt = graph_tables(ring_depth=2, reqs=2, widths=[4, 2, 4])
    table = bt.block_tables[0]
    n = (1 << 16) + 1
    for i in range(n - 1):
        table.stage_write(0, 1, [i % 1000 + 1])
    table.stage_write(0, 1, [4242])
    h = bt.commit_staged_writes()
    words = bt.graph.ring.entry(h)
    counts = int(words[H_COUNTS])
    assert counts > 0, "a batch of many rounds must not read as an inline batch"
    assert (counts & 0xFFFFFFFF, counts >> 32) == (n, n)  # every write, every round
    assert int(words[H_NUM_VALUES]) == n and int(words[H_META]) != 0 and int(words[H_TOKEN]) > 0

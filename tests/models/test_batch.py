"""fill_step writes buffers that satisfy every invariant blink.device.step lists, over stale contents."""
import pytest
import torch

from blink.device.step import StepBuffers, StepLayout
from blink.models.batch import SeqChunk, fill_step


def test_invariants_hold_over_stale_buffers():
    layout = StepLayout(32, 6, 8)
    buf = StepBuffers(layout)
    for name in layout.fields():
        getattr(buf, name).fill_(9)
    chunks = [SeqChunk([5, 6, 7], 0, [4, 1]), SeqChunk([8], 6, [2, 0], temperature=0.5, seed=3),
              SeqChunk([1, 2, 3, 4, 5], 2, [7, 3], sample=False, top_k=4, top_p=0.5)]
    n = fill_step(buf, chunks, page_size=4)
    assert n == 9 and buf.num_seqs[0] == 3
    assert buf.query_start_loc.tolist() == [0, 3, 4, 9, 9, 9, 9]
    assert buf.seq_lens.tolist() == [3, 7, 7, 0, 0, 0]
    assert buf.positions[:9].tolist() == [0, 1, 2, 6, 2, 3, 4, 5, 6]
    # page * page_size + offset, via each sequence's block table
    assert buf.slot_mapping[:9].tolist() == [16, 17, 18, 2, 30, 31, 12, 13, 14]
    assert torch.all(buf.slot_mapping[9:] == -1)
    assert buf.logits_indices.tolist() == [2, 3, -1, -1, -1, -1]
    assert buf.block_tables[1, :2].tolist() == [2, 0]
    assert buf.temperature[:3].tolist() == [0.0, 0.5, 0.0] and buf.seed[:3].tolist() == [0, 3, 0]
    assert buf.top_k[:3].tolist() == [0, 0, 4] and buf.top_p[:4].tolist() == [1.0, 1.0, 0.5, 1.0]


@pytest.mark.parametrize("chunks, words", [
    ([SeqChunk([1] * 9, 0, [0, 1])], "2 pages cannot hold 9 positions"),
    ([SeqChunk([1], 0, [0])] * 7, "exceed max_num_seqs"),
    ([SeqChunk([1] * 33, 0, list(range(9)))], "exceed max_num_batched_tokens"),
    ([SeqChunk([1], 40, list(range(11)))], "exceed max_pages_per_seq"),
])
def test_rejects_what_the_buffers_cannot_hold(chunks, words):
    with pytest.raises(ValueError, match=words):
        fill_step(StepBuffers(StepLayout(32, 6, 8)), chunks, page_size=4)

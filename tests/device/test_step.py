"""blink.device.step: fresh step buffers already hold what a step may read before any plan, by name."""
import torch

from blink.device.step import N_PENALTIES, StepBuffers, StepLayout
from blink.models.batch import SeqChunk, fill_step


def test_fresh_buffers_are_padding_with_neutral_sampling():
    buf = StepBuffers(StepLayout(max_num_batched_tokens=8, max_num_seqs=4, max_pages_per_seq=2))
    assert (buf.slot_mapping == -1).all() and (buf.logits_indices == -1).all()
    assert (buf.top_p == 1).all() and (buf.temperature == 0).all()
    assert buf.penalties.shape == (4, N_PENALTIES)
    assert buf.penalties.tolist() == [[0.0, 0.0, 1.0]] * 4, "presence 0, frequency 0, repetition 1: none"


def test_fill_step_leaves_every_row_without_penalties():
    buf = StepBuffers(StepLayout(max_num_batched_tokens=8, max_num_seqs=4, max_pages_per_seq=2))
    buf.penalties.fill_(7.0)
    fill_step(buf, [SeqChunk(tokens=[1, 2, 3], start=0, pages=[0])], page_size=4)
    assert torch.equal(buf.penalties, torch.tensor([[0.0, 0.0, 1.0]] * 4))

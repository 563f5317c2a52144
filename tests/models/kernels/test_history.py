import torch

from blink.models.kernels import reference


def test_record_tokens_stores_each_row_at_its_slot_as_the_reference(backend):
    """Rows past one program's block, padding rows (-1) among them: every slot a row names holds its token, as the
    reference's; the other entries keep theirs (the reference's last entry, its padding rows' sink, aside)."""
    from blink.models.kernels.history import record_tokens

    device, _, _ = backend
    n, size = 300, 2000
    slot_mapping = torch.randperm(size - 1, device=device)[:n].int()
    slot_mapping[::7] = -1
    token_ids = torch.randint(0, 150_000, (n,), dtype=torch.int32, device=device)
    before = torch.randint(0, 9, (size,), dtype=torch.int32, device=device)
    got, want = before.clone(), before.clone()
    record_tokens(got, token_ids, slot_mapping)
    reference.record_tokens(want, token_ids, slot_mapping)
    assert torch.equal(got[:-1], want[:-1])
    live = slot_mapping >= 0
    assert torch.equal(got[slot_mapping[live].long()], token_ids[live])
    untouched = torch.ones(size, dtype=torch.bool, device=device)
    untouched[slot_mapping[live].long()] = False
    assert torch.equal(got[untouched], before[untouched])

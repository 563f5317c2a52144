import torch

from blink.models.hashing import row_key
from blink.models.kernels import reference


def test_gumbel_argmax_matches_reference(backend):
    device, _, _ = backend
    rows, vocab = 12, 9000
    scaled = torch.randn(rows, vocab, device=device) * 2
    threshold = torch.where(torch.arange(rows, device=device) % 3 == 0, float("-inf"), scaled.quantile(0.999, 1))
    key = row_key(torch.arange(rows, device=device) * 7919, torch.full((rows,), 5, device=device))
    greedy = torch.arange(rows, device=device) % 4 == 1
    from blink.models.kernels.sampling import gumbel_argmax

    ids = gumbel_argmax(scaled, threshold, key, greedy)
    ref = reference.gumbel_argmax(scaled, threshold, key, greedy)
    assert ids.dtype == torch.int32
    assert torch.equal(ids, ref)
    assert torch.all(scaled.gather(1, ids[:, None].long())[:, 0] >= threshold)

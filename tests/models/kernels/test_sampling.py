import torch

from blink.models.kernels import reference


def test_gumbel_argmax_matches_reference(backend):
    """The kernel derives each row's key from its seed and length as ``hashing.row_key`` does: seeds past 32 bits
    and negative ones (int64 bit patterns) included."""
    device, _, _ = backend
    rows, vocab = 12, 9000
    scaled = torch.randn(rows, vocab, device=device) * 2
    threshold = torch.where(torch.arange(rows, device=device) % 3 == 0, float("-inf"), scaled.quantile(0.999, 1))
    seed = torch.tensor([0, 1, 7919, 2**32, 2**32 + 5, 2**63 - 1, -1, -2**63, 123456789012345, 42, 42, 42],
                        dtype=torch.int64, device=device)
    seq_lens = torch.tensor([5, 5, 5, 5, 5, 9, 1, 300, 5, 1, 2, 3], dtype=torch.int32, device=device)
    greedy = torch.arange(rows, device=device) % 4 == 1
    from blink.models.kernels.sampling import gumbel_argmax

    ids = gumbel_argmax(scaled, threshold, seed, seq_lens, greedy)
    ref = reference.gumbel_argmax(scaled, threshold, seed, seq_lens, greedy)
    assert ids.dtype == torch.int32
    assert torch.equal(ids, ref)
    assert torch.all(scaled.gather(1, ids[:, None].long())[:, 0] >= threshold)

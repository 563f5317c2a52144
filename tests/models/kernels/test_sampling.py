import torch

from blink.models.kernels import reference
from conftest import rel_err


def _divisor(rows, device):
    """Temperatures as the sampler passes them: 1 for greedy rows, else the row's temperature."""
    return torch.tensor([1.0, 0.7, 1.3, 0.05, 2.0, 1.0] * (rows // 6), device=device)


def test_gumbel_argmax_matches_reference(backend):
    """The kernel divides by the row's temperature as it reads, and derives each row's key from its seed and length
    as ``hashing.row_key`` does: seeds past 32 bits and negative ones (int64 bit patterns) included."""
    device, _, _ = backend
    rows, vocab = 12, 9000
    logits = torch.randn(rows, vocab, device=device) * 2
    divisor = _divisor(rows, device)
    scaled = logits / divisor[:, None]
    threshold = torch.where(torch.arange(rows, device=device) % 3 == 0, float("-inf"), scaled.quantile(0.999, 1))
    seed = torch.tensor([0, 1, 7919, 2**32, 2**32 + 5, 2**63 - 1, -1, -2**63, 123456789012345, 42, 42, 42],
                        dtype=torch.int64, device=device)
    seq_lens = torch.tensor([5, 5, 5, 5, 5, 9, 1, 300, 5, 1, 2, 3], dtype=torch.int32, device=device)
    greedy = torch.arange(rows, device=device) % 4 == 1
    from blink.models.kernels.sampling import gumbel_argmax

    ids = gumbel_argmax(logits, divisor, threshold, seed, seq_lens, greedy)
    ref = reference.gumbel_argmax(logits, divisor, threshold, seed, seq_lens, greedy)
    assert ids.dtype == torch.int32
    assert torch.equal(ids, ref)
    assert torch.all(scaled.gather(1, ids[:, None].long())[:, 0] >= threshold)


def test_row_logsumexp_matches_reference(backend):
    """Both log-sum-exps of each row in one pass, over a vocabulary that is not a multiple of the block, with rows
    of very different scales (a temperature of 0.05 makes one logit dominate)."""
    device, _, _ = backend
    rows, vocab = 6, 5003
    logits = torch.randn(rows, vocab, device=device, dtype=torch.float64).mul(4).float()
    divisor = _divisor(rows, device)
    from blink.models.kernels.sampling import row_logsumexp

    lse, lse_scaled = row_logsumexp(logits, divisor)
    want, want_scaled = (torch.logsumexp(x.double(), dim=1) for x in (logits, logits / divisor[:, None]))
    assert lse.dtype == lse_scaled.dtype == torch.float32
    assert rel_err(lse, want) < 1e-6 and rel_err(lse_scaled, want_scaled) < 1e-6

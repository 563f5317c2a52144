import pytest
import torch

from blink.models.kernels import reference
from tests.models.kernels.conftest import rel_err


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
    # The step's logits are bf16: read as they are, they draw what their exact float32 copy draws.
    half = logits.bfloat16()
    assert torch.equal(gumbel_argmax(half, divisor, threshold, seed, seq_lens, greedy),
                       reference.gumbel_argmax(half.float(), divisor, threshold, seed, seq_lens, greedy))


def test_gumbel_argmax_gives_a_tie_across_chunks_to_the_lowest_index(backend):
    """Greedy rows whose largest logit appears in several 4096-entry chunks draw its lowest index, as the reference's
    argmax does; in a row of equal logits, token 0."""
    from blink.models.kernels.sampling import gumbel_argmax

    device, _, _ = backend
    logits = torch.randn(3, 9000, device=device)
    for row, ties in ((0, (8999, 5000, 100)), (1, (4096, 4095))):
        logits[row, list(ties)] = 50.0
    logits[2] = 1.0
    args = (torch.ones(3, device=device), torch.full((3,), float("-inf"), device=device),
            torch.zeros(3, dtype=torch.int64, device=device), torch.ones(3, dtype=torch.int32, device=device),
            torch.ones(3, dtype=torch.bool, device=device))
    ids = gumbel_argmax(logits, *args)
    assert ids.tolist() == [100, 4095, 0]
    assert torch.equal(ids, reference.gumbel_argmax(logits, *args))


def test_sampling_params_matches_reference(backend):
    """Each row's greedy flag, divisor and min-p floor, bit for bit as the reference, over more rows than one program
    takes, from candidates with a row stride wider than their count, in float32 and bf16: greedy rows (temperature
    0 or below) divide by 1, min_p 0 gives -inf, 1 the scaled maximum itself."""
    from blink.models.kernels.sampling import sampling_params

    device, _, _ = backend
    rows = 300
    temperature = torch.tensor([0.0, 0.7, 1.3, 0.05, 2.0, -1.0], device=device).repeat(rows // 6)
    min_p = torch.tensor([0.0, 0.1, 1.0, 1e-4, 0.5, 0.3], device=device).repeat_interleave(rows // 6 + 1)[:rows]
    wide = torch.randn(rows, 40, device=device) * 5
    for cand in (wide[:, :16], wide[:, :16].bfloat16()):
        got, want = sampling_params(temperature, min_p, cand), reference.sampling_params(temperature, min_p, cand)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    greedy, divisor, floor = want
    assert torch.equal(greedy, temperature <= 0) and torch.all(divisor[greedy] == 1.0)
    top = cand[:, 0].float() / divisor  # the scaled maximum: correctly rounded, as the kernel divides
    assert torch.all(floor[min_p == 0] == float("-inf")) and torch.equal(floor[min_p == 1], top[min_p == 1])
    want = top.double() + min_p.double().log()
    assert torch.allclose(floor[min_p > 0].double(), want[min_p > 0], rtol=1e-6, atol=1e-5)


def test_gumbel_argmax_never_draws_a_token_for_its_noise_alone(backend):
    """The token whose hash is at the top of the range (``tests/models/test_hashing.TOP``) once drew Gumbel noise
    +inf and won at a logit 100 below the rest; it must lose, in the kernel as in the reference."""
    from blink.models.kernels.sampling import gumbel_argmax
    from tests.models.test_hashing import TOP

    device, _, _ = backend
    logits = torch.zeros(1, 4096, device=device)
    logits[0, TOP["index"]] = -100.0
    args = (torch.ones(1, device=device), torch.full((1,), float("-inf"), device=device),
            torch.tensor([TOP["seed"]], dtype=torch.int64, device=device),
            torch.tensor([TOP["seq_len"]], dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.bool,
                                                                                        device=device))
    ids = gumbel_argmax(logits, *args)
    assert torch.equal(ids, reference.gumbel_argmax(logits, *args)) and ids.item() != TOP["index"]


def test_row_logsumexp_matches_reference(backend):
    """Both log-sum-exps of each row in one pass, over a vocabulary that is not a multiple of the block, with rows
    of very different scales (a temperature of 0.05 makes one logit dominate), a row whose first 4096-entry chunk is
    all -inf, and one that is -inf throughout (-inf, as torch, not NaN)."""
    device, _, _ = backend
    rows, vocab = 6, 5003
    logits = torch.randn(rows, vocab, device=device, dtype=torch.float64).mul(4).float()
    logits[2, :4096] = float("-inf")
    logits[5] = float("-inf")
    divisor = _divisor(rows, device)
    no_floor = torch.full((rows,), float("-inf"), device=device)
    from blink.models.kernels.sampling import row_logsumexp

    lse, lse_scaled = row_logsumexp(logits, divisor, no_floor)
    want, want_scaled = (torch.logsumexp(x.double(), dim=1) for x in (logits, logits / divisor[:, None]))
    assert lse.dtype == lse_scaled.dtype == torch.float32
    assert torch.all(lse[5] == float("-inf")) and torch.all(lse_scaled[5] == float("-inf"))
    assert rel_err(lse[:5], want[:5]) < 1e-6 and rel_err(lse_scaled[:5], want_scaled[:5]) < 1e-6
    assert torch.equal(lse_scaled[0], lse[0])  # a divisor of 1 and no floor: the row's own sums
    half = logits.bfloat16()
    for got, want in zip(row_logsumexp(half, divisor, no_floor), row_logsumexp(half.float(), divisor, no_floor)):
        assert torch.equal(got, want)  # bf16 read as it is: the same sums as its float32 copy


def test_row_logsumexp_sums_the_scaled_row_above_its_floor(backend):
    """min-p: the scaled log-sum-exp covers only the entries ``>= floor`` (float64 reference), the plain one the
    whole row; a floor at the row's maximum keeps the maximum alone."""
    device, _, _ = backend
    rows, vocab = 6, 5003
    logits = torch.randn(rows, vocab, device=device).mul(3)
    divisor = _divisor(rows, device)
    scaled = logits / divisor[:, None]
    top = scaled.max(dim=1).values
    floor = top + torch.log(torch.tensor([0.0, 0.05, 0.3, 0.5, 1.0, 1e-4], device=device))
    from blink.models.kernels.sampling import row_logsumexp

    lse, lse_scaled = row_logsumexp(logits, divisor, floor)
    kept = torch.where(scaled >= floor[:, None], scaled.double(), float("-inf"))
    assert rel_err(lse, torch.logsumexp(logits.double(), 1)) < 1e-6
    assert rel_err(lse_scaled, torch.logsumexp(kept, 1)) < 1e-6
    assert lse_scaled[4] == top[4]      # min_p = 1: the maximum alone
    assert rel_err(lse_scaled, reference.row_logsumexp(logits, divisor, floor)[1]) < 1e-6


def test_candidate_threshold_with_min_p_matches_reference(backend):
    """min-p's floor with top-k, top-p, both and neither; a floor below every candidate with top-p unclosed (the
    threshold is the floor, not -inf) and one at the maximum (only it stays)."""
    device, _, _ = backend
    from blink.models.kernels.sampling import candidate_threshold

    rows, vocab, n = 12, 3000, 1024
    logits = torch.randn(rows, vocab, device=device) * 3
    logits[9:] *= 0.001  # flat rows: every candidate survives min-p, top-p does not close within them
    divisor = _divisor(rows, device)
    scaled = logits / divisor[:, None]
    min_p = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.5, 1.0, 0.01, 0.3, 0.0, 1e-3, 1e-3, 0.9], device=device)
    floor = scaled.max(dim=1).values + torch.log(min_p)
    lse_scaled = reference.row_logsumexp(logits, divisor, floor)[1]
    top_k = torch.tensor([0, 5, 0, 40, 0, 0, 3, 2000, 0, 0, 0, 0], dtype=torch.int32, device=device)
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.95, 0.9, 1.0, 0.8, 0.9, 0.7, 0.9, 1.0, 0.5], device=device)
    cand = torch.topk(logits, n, dim=1).values
    got = candidate_threshold(cand, divisor, lse_scaled, top_k, top_p, floor)
    want = reference.candidate_threshold(cand, divisor, lse_scaled, top_k, top_p, floor)
    assert torch.equal(got, want), (got, want)
    assert torch.all(want >= floor) and want[5] == scaled[5].max()
    assert torch.equal(want[9:11], floor[9:11])     # unclosed: cut at the floor


def test_candidate_threshold_matches_reference(backend):
    """Top-k alone, top-p alone (renormalised over the whole row), both, neither, a top-k past the candidates, and
    rows whose candidates fall short of top-p (flat logits: not truncated, -inf), at two candidate counts (a power of
    two and not)."""
    device, _, _ = backend
    from blink.models.kernels.sampling import candidate_threshold

    for vocab, n in ((5000, 1024), (700, 700)):
        logits = torch.randn(12, vocab, device=device) * 3
        logits[10:] *= 0.01  # flat rows
        divisor = _divisor(12, device)
        lse_scaled = torch.logsumexp(logits / divisor[:, None], dim=1)
        top_k = torch.tensor([0, 5, 0, 40, 2000, 0, 1, 0, 3, 0, 0, 7], dtype=torch.int32, device=device)
        top_p = torch.tensor([1.0, 1.0, 0.5, 0.95, 0.9, 0.999, 1.0, 0.05, 0.3, 0.8, 0.9, 0.9], device=device)
        cand = torch.topk(logits, n, dim=1).values
        floor = torch.full((12,), float("-inf"), device=device)
        got = candidate_threshold(cand, divisor, lse_scaled, top_k, top_p, floor)
        want = reference.candidate_threshold(cand, divisor, lse_scaled, top_k, top_p, floor)
        assert torch.equal(got, want), (vocab, got, want)
        half = cand.bfloat16()
        assert torch.equal(candidate_threshold(half, divisor, lse_scaled, top_k, top_p, floor),
                           reference.candidate_threshold(half.float(), divisor, lse_scaled, top_k, top_p, floor))
        assert want[0] == float("-inf") and torch.isfinite(want[[1, 2, 3, 11]]).all()
        assert (want[10] == float("-inf")) == (n < vocab)  # a flat row's nucleus is wider than the candidates


@pytest.mark.parametrize("top", [0, 5])
def test_store_sampled_writes_the_sampled_rows_as_the_reference(backend, top):
    """Rows that sample write their token, its logprob and the top candidates' ids and logprobs, bit for bit as the
    reference; rows with ``logits_indices`` -1 keep what the buffers held."""
    device, _, _ = backend
    from blink.models.kernels.sampling import store_sampled
    from blink.models.sampler import CANDIDATES
    from tests.models.test_sampler import empty_sampled

    rows, vocab = 6, 3000
    logits = (torch.randn(rows, vocab, device=device) * 3).bfloat16()
    cand = torch.topk(logits, CANDIDATES, dim=1)
    lse = torch.logsumexp(logits.float(), dim=1)
    ids = torch.randint(0, vocab, (rows,), dtype=torch.int32, device=device)
    logits_indices = torch.tensor([0, -1, 2, 3, -1, 5], device=device)
    got, want = empty_sampled(rows, top, device), empty_sampled(rows, top, device)
    for out in (got, want):
        for buffer in out:
            buffer.fill_(-7)
    store_sampled(got, logits_indices, logits, ids, lse, cand.values, cand.indices)
    reference.store_sampled(want, logits_indices, logits, ids, lse, cand.values, cand.indices)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(want.ids[logits_indices < 0], torch.full((2,), -7, dtype=torch.int32, device=device))
    sampled = logits_indices >= 0
    assert torch.equal(want.ids[sampled], ids[sampled])
    assert torch.equal(want.logprobs[sampled], (logits.float().gather(1, ids[:, None].long())[:, 0] - lse)[sampled])
    if top:
        assert torch.equal(want.top_ids[sampled], cand.indices[sampled, :top].int())

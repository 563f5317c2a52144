"""In-step sampling against HF's logits warpers and the softmax it must draw from."""
import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from blink.models.kernels import reference
from blink.models.sampler import CANDIDATES, Sampled, sample


def empty_sampled(rows: int, top: int, device="cpu") -> Sampled:
    return Sampled(torch.zeros(rows, dtype=torch.int32, device=device), torch.zeros(rows, device=device),
                   torch.zeros(rows, top, dtype=torch.int32, device=device), torch.zeros(rows, top, device=device))


def _sample(logits, temperature=0.0, top_k=0, top_p=1.0, seed=0, seq_lens=None, min_p=0.0, top=0):
    s = logits.shape[0]
    full = lambda v, dt: torch.full((s,), v, dtype=dt) if not torch.is_tensor(v) else v  # noqa: E731
    seq_lens = torch.arange(s, dtype=torch.int32) + 5 if seq_lens is None else seq_lens
    out = empty_sampled(s, top)
    sample(logits, full(temperature, torch.float32), full(top_k, torch.int32), full(top_p, torch.float32),
           full(min_p, torch.float32), full(seed, torch.int64), seq_lens, reference, out, torch.arange(s))
    return out[:2]


def filter_threshold(logits, divisor, lse_scaled, top_k, top_p, ops):
    """The sampler's threshold without min-p, from the candidates as ``sample`` takes them."""
    cand = torch.topk(logits, min(CANDIDATES, logits.shape[1]), dim=1).values
    no_floor = torch.full((logits.shape[0],), float("-inf"))
    return ops.candidate_threshold(cand, divisor, lse_scaled, top_k, top_p, no_floor)


def test_greedy_and_logprobs():
    logits = torch.randn(6, 300) * 3
    ids, logprobs = _sample(logits)
    assert torch.equal(ids.long(), logits.argmax(1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, 1).gather(1, ids[:, None].long())[:, 0])


def test_bf16_logits_sample_as_their_float32_copy():
    """The step hands the sampler its bf16 logits: tokens and logprobs are those of the exact float32 copy."""
    logits = (torch.randn(8, 3000) * 3).bfloat16()
    params = dict(temperature=torch.tensor([0.0, 0.7, 1.0, 1.3] * 2), top_k=torch.tensor([0, 0, 5, 40] * 2),
                  top_p=torch.tensor([1.0, 0.9, 0.95, 0.5] * 2), seed=torch.arange(8))
    ids, logprobs = _sample(logits, **params)
    want_ids, want_logprobs = _sample(logits.float(), **params)
    assert torch.equal(ids, want_ids) and torch.equal(logprobs, want_logprobs)
    assert logprobs.dtype == torch.float32


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (7, 0.5), (40, 0.95), (2000, 0.9)])
def test_filter_keeps_what_transformers_keeps(top_k, top_p):
    torch.manual_seed(top_k)
    scaled = torch.randn(8, 3000) * 2
    threshold = filter_threshold(scaled, torch.ones(8), torch.logsumexp(scaled, 1), torch.full((8,), top_k),
                                 torch.full((8,), top_p), reference)
    allowed = scaled >= threshold[:, None]
    want = scaled
    if top_k:
        want = TopKLogitsWarper(min(top_k, CANDIDATES))(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    assert torch.equal(allowed, want > float("-inf"))


def test_draws_follow_the_filtered_softmax():
    logits = torch.randn(1, 12) * 1.5
    n = 6000
    rows = logits.expand(n, -1).contiguous()
    ids, _ = _sample(rows, temperature=0.8, top_k=6, seed=11, seq_lens=torch.arange(n, dtype=torch.int32))
    freq = torch.bincount(ids.long(), minlength=12).float() / n
    want = torch.softmax(TopKLogitsWarper(6)(None, logits / 0.8), 1)[0]
    assert torch.all(freq[want == 0] == 0)
    assert (freq - want).abs().max() < 0.025


def test_seed_fixes_tokens_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 500)
    seeds = torch.tensor([7, 8, 9, 10, 11])
    lens = torch.tensor([3, 3, 9, 4, 4], dtype=torch.int32)
    ids, _ = _sample(logits, temperature=1.0, top_p=0.9, seed=seeds, seq_lens=lens)
    perm = torch.tensor([3, 0, 4, 2, 1])
    shuffled, _ = _sample(logits[perm], temperature=1.0, top_p=0.9, seed=seeds[perm], seq_lens=lens[perm])
    assert torch.equal(shuffled, ids[perm])
    alone, _ = _sample(logits[2:3], temperature=1.0, top_p=0.9, seed=seeds[2:3], seq_lens=lens[2:3])
    assert alone[0] == ids[2]
    other_seed, _ = _sample(logits, temperature=1.0, top_p=0.9, seed=seeds + 100, seq_lens=lens)
    assert not torch.equal(other_seed, ids)


def test_threshold_of_logits_and_temperature_is_that_of_the_scaled_row():
    """The sampler never stores ``logits / T``: its candidates are the top logits, divided. Dividing by a positive
    T keeps the order, so the threshold must be exactly the one computed from the scaled row itself."""
    torch.manual_seed(3)
    logits = torch.randn(6, 3000) * 3
    divisor = torch.tensor([0.05, 0.3, 0.7, 1.0, 1.5, 4.0])
    scaled = logits / divisor[:, None]
    top_k, top_p = torch.tensor([0, 5, 0, 40, 2000, 0]), torch.tensor([0.9, 1.0, 0.5, 0.95, 0.9, 1.0])
    lse = torch.logsumexp(scaled, 1)
    assert torch.equal(filter_threshold(logits, divisor, lse, top_k, top_p, reference),
                       filter_threshold(scaled, torch.ones(6), lse, top_k, top_p, reference))


def _reference_probs(logits: torch.Tensor, bias: dict, temperature: float, min_p: float) -> torch.Tensor:
    """float64: softmax((logits + bias) / T), then vLLM's min-p (keep p >= min_p * max p), renormalised."""
    x = logits.double().clone()
    for token, b in bias.items():
        x[token] += b
    p = torch.softmax(x / temperature, dim=0)
    p = torch.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature, min_p, bias", [(1.0, 0.0, {}), (1.0, 0.2, {}), (0.7, 0.05, {3: 2.5, 0: -100}),
                                                      (1.3, 0.3, {7: 1.75, 9: -0.5}), (1.0, 1.0, {5: 4.0})])
def test_draws_follow_softmax_of_biased_logits_with_min_p(temperature, min_p, bias):
    """The sampler, with ``logit_bias`` applied to the logits as the step does, against the float64 distribution it
    must draw from: no token outside min-p's survivors, and Pearson's chi-square over the survivors (20000 draws,
    the noise of each row a different seed) not rejected at 1e-4."""
    gen = torch.Generator().manual_seed(17)
    logits = torch.randn(12, generator=gen) * 1.5
    n = 20000
    rows = logits.expand(n, -1).contiguous()
    width = max(len(bias), 1)
    ids = torch.tensor([list(bias) + [0] * (width - len(bias))] * n, dtype=torch.int32)
    values = torch.tensor([list(bias.values()) + [0.0] * (width - len(bias))] * n)
    reference.apply_logit_bias(rows, ids, values, torch.full((n,), len(bias), dtype=torch.int32))
    drawn, _ = _sample(rows, temperature=temperature, min_p=min_p, seed=torch.arange(n) * 7919 + 3,
                       seq_lens=torch.full((n,), 9, dtype=torch.int32))
    want = _reference_probs(logits, bias, temperature, min_p)
    counts = torch.bincount(drawn.long(), minlength=12).double()
    assert torch.all(counts[want == 0] == 0), (counts, want)
    kept = want > 0
    if kept.sum() == 1:
        assert counts[kept].item() == n
        return
    expected = want[kept] * n
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum()
    p_value = 1 - torch.distributions.Chi2(torch.tensor(float(kept.sum() - 1), dtype=torch.float64)).cdf(chi2)
    assert p_value > 1e-4, (counts, expected, p_value)


def test_min_p_keeps_exactly_vllms_survivors():
    """Over many random rows and min-p values, the tokens the sampler can draw (its threshold) are exactly those
    whose float64 probability after temperature is >= min_p times the largest, with top-k and top-p applied to the
    survivors after it, renormalised, as vLLM orders them."""
    torch.manual_seed(5)
    rows, vocab = 64, 3000
    logits = torch.randn(rows, vocab) * 2
    temperature = torch.rand(rows) + 0.3
    min_p = torch.rand(rows) ** 3
    scaled = logits / temperature[:, None]
    cand = torch.topk(logits, CANDIDATES, dim=1).values
    floor = cand[:, 0] / temperature + torch.log(min_p)
    lse_scaled = reference.row_logsumexp(logits, temperature, floor)[1]
    top_k, top_p = torch.zeros(rows, dtype=torch.int32), torch.ones(rows)
    threshold = reference.candidate_threshold(cand, temperature, lse_scaled, top_k, top_p, floor)
    p = torch.softmax(logits.double() / temperature.double()[:, None], dim=1)
    want = p >= min_p.double()[:, None] * p.max(dim=1, keepdim=True).values
    got = scaled >= threshold[:, None]
    # Only a probability within float32 rounding of the cut may fall on the other side.
    ratio = p / p.max(dim=1, keepdim=True).values / min_p.double()[:, None]
    assert torch.all((got == want) | ((ratio - 1).abs() < 1e-5))
    assert (got != want).sum() <= 2
    # top-p over the min-p survivors, renormalised (HF's warper on the min-p-filtered row).
    top_p = torch.full((rows,), 0.8)
    threshold = reference.candidate_threshold(cand, temperature, lse_scaled, top_k, top_p, floor)
    masked = torch.where(want, scaled, float("-inf"))
    nucleus = TopPLogitsWarper(0.8)(None, masked) > float("-inf")
    exact = (got == want).all(dim=1)
    assert torch.equal((scaled >= threshold[:, None])[exact], nucleus[exact])


def test_top_logprobs_are_the_largest_logprobs_most_likely_first():
    torch.manual_seed(2)
    logits = torch.randn(5, 400) * 3
    out = empty_sampled(5, 7)
    sample(logits, torch.ones(5), torch.zeros(5, dtype=torch.int32), torch.ones(5), torch.zeros(5), torch.arange(5),
           torch.arange(5, dtype=torch.int32) + 3, reference, out, torch.arange(5))
    want = torch.log_softmax(logits.double(), dim=1).topk(7, dim=1)
    assert out.top_ids.dtype == torch.int32 and torch.equal(out.top_ids.long(), want.indices)
    torch.testing.assert_close(out.top_logprobs.double(), want.values, rtol=0, atol=1e-5)
    drawn = out.top_ids == out.ids[:, None]     # the sampled token's logprob is the same number among the top ones
    assert torch.equal(out.top_logprobs[drawn], out.logprobs[drawn.any(dim=1)])

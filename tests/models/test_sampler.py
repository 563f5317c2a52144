"""In-step sampling against HF's logits warpers and the softmax it must draw from."""
import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from blink.models.kernels import reference
from blink.models.sampler import CANDIDATES, filter_threshold, sample


def _sample(logits, temperature=0.0, top_k=0, top_p=1.0, seed=0, seq_lens=None):
    s = logits.shape[0]
    full = lambda v, dt: torch.full((s,), v, dtype=dt) if not torch.is_tensor(v) else v  # noqa: E731
    seq_lens = torch.arange(s, dtype=torch.int32) + 5 if seq_lens is None else seq_lens
    return sample(logits, full(temperature, torch.float32), full(top_k, torch.int32), full(top_p, torch.float32),
                  full(seed, torch.int64), seq_lens, reference)


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

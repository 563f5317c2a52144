"""The counter-based noise: 32-bit values, uniform, and a function of (seed, seq_len, index) alone."""
import torch

from blink.models.hashing import MASK32, gumbel_noise, hash32, row_key, uniform


def test_hash_is_32_bit_and_mixes():
    x = torch.arange(1 << 16)
    h = hash32(x)
    assert h.min() >= 0 and h.max() <= MASK32
    assert h.unique().numel() == x.numel()  # a bijection on 32 bits
    # flipping one input bit flips about half the output bits
    flips = torch.stack([(hash32(x) ^ hash32(x ^ (1 << b))) for b in range(16)])
    bits = sum(((flips >> i) & 1).sum() for i in range(32)).item() / flips.numel()
    assert 15 < bits < 17


def test_uniform_draws():
    key = row_key(torch.tensor([123456789012345]), torch.tensor([17]))
    u = uniform(key, torch.arange(200_000))
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.005


def test_key_depends_on_seed_halves_and_length():
    seeds = torch.tensor([1, 1, 1 << 32, 1])
    lens = torch.tensor([5, 6, 5, 5])
    keys = row_key(seeds, lens)
    assert keys[0] == keys[3] and len(set(keys[:3].tolist())) == 3


# A row and vocabulary index whose hash is at the top of the range (found by searching seed 0's lengths and indices).
TOP = dict(seed=0, seq_len=4590, index=1948)


def test_the_top_of_the_hash_range_draws_below_one():
    """With 24 bits the top hash drew exactly 1.0 in float32, Gumbel noise +inf: that token won whatever its logit."""
    key = row_key(torch.tensor([TOP["seed"]]), torch.tensor([TOP["seq_len"]]))
    index = torch.tensor([TOP["index"]])
    assert hash32(key ^ hash32(index)).item() >= MASK32 - 0xFF  # the top 24-bit value: still the case to test
    assert 0 < uniform(key, index).item() < 1 and torch.isfinite(gumbel_noise(key, index)).all()

"""Counter-based random numbers for in-step sampling: a pure function of ``(seed, seq_len, vocab index)``.

No generator state lives on the device, so a captured step draws fresh numbers every step (``seq_len`` grows) and a
seeded request samples the same tokens whatever else shares its batch. Values are 32-bit unsigned integers kept in
int64 tensors; every product stays below 2**63, so the torch arithmetic never overflows and the Triton kernel,
working in uint32, computes the same bits.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MIX = 0x45D9F3B  # the multiplier of a well-mixing 32-bit integer hash (two rounds + final xorshift)


def hash32(x: torch.Tensor) -> torch.Tensor:
    x = (((x >> 16) ^ x) * MIX) & MASK32
    x = (((x >> 16) ^ x) * MIX) & MASK32
    return (x >> 16) ^ x


def row_key(seed: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per sequence row from its int64 seed and its context length."""
    seed = seed.long()
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    return hash32(hash32(hash32(hi) ^ lo) ^ seq_lens.long())


# Bits of a hash a uniform draw takes: float32 holds (bits + 0.5) / 2**23 exactly, the largest 1 - 2**-24. With 24
# bits the largest, (2**24 - 0.5) / 2**24, rounds to 1.0, whose Gumbel noise is +inf: one token in 2**24 per draw
# would win whatever its logit (one sampled token in ~110 over Qwen3's vocabulary).
UNIFORM_BITS = 23


def uniform(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in (0, 1), both ends excluded, from the top ``UNIFORM_BITS`` bits of ``hash32(key ^
    hash32(index))``."""
    bits = hash32(key ^ hash32(index.long())) >> (32 - UNIFORM_BITS)
    return (bits.float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def gumbel_noise(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform(key, index)))

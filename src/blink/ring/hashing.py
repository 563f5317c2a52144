"""Prefix keys: a 64-bit key for each full KV page of a sequence, chained over every token before it.

With ``page_size`` tokens per page, the key of page ``j`` is the chain state after its last token::

    state(0) = 0
    state(n) = state(n - 1) + term(token[n - 1], n - 1)          (mod 2**64)
    term(t, p) = mix64(seed ^ t * TOKEN_MIX ^ p * POSITION_MIX)   (mod 2**64)
    key(j) = state((j + 1) * page_size)

so ``key(j) = H(key(j - 1), tokens of page j)``: it names the page's tokens, their positions and everything before
them, which is all a page's K/V depend on (a LoRA adapter would be folded into ``seed``). The sum makes both sides
cheap: the agent hashes a prompt in one vectorised pass (every token's term, a cumulative sum, each page's last
entry: ``prompt_keys``), and the GPU extends a sequence's state by one term per generated token
(``blink.device.prefix.extend``, tested equal to ``reference_keys``).

Keys are not cryptographic. Two different prefixes share a key with probability about 2**-64 (a cache of a million
pages: about 3e-8 that any two collide); a collision would serve one prefix's K/V to the other. ``seed`` is drawn at
random by each ring's creator (``control.fresh``), so a client cannot compute keys to craft a collision.
"""
from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
TOKEN_MIX = 0x9E3779B97F4A7C15
POSITION_MIX = 0xC2B2AE3D27D4EB4F
MIX_A, MIX_B = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(x):
    """splitmix64's finalizer, a bijection of 64-bit words; ``x`` is an int or a numpy uint64 array."""
    x = ((x ^ (x >> 30)) * MIX_A) & MASK64
    x = ((x ^ (x >> 27)) * MIX_B) & MASK64
    return x ^ (x >> 31)


def token_term(token: int, position: int, seed: int) -> int:
    """What token ``token`` at ``position`` adds to the chain state."""
    return mix64((seed ^ (token * TOKEN_MIX) ^ (position * POSITION_MIX)) & MASK64)


def reference_keys(tokens, page_size: int, seed: int) -> tuple[list[int], int]:
    """The keys of every full page of ``tokens`` and the state after the last token, one token at a time."""
    state, keys = 0, []
    for position, token in enumerate(tokens):
        state = (state + token_term(int(token), position, seed)) & MASK64
        if (position + 1) % page_size == 0:
            keys.append(state)
    return keys, state


def prompt_keys(prompt: np.ndarray, page_size: int, seed: int) -> tuple[np.ndarray, int]:
    """``reference_keys`` of a prompt (int token ids), vectorised: (uint64 keys of its full pages, final state)."""
    tokens = np.asarray(prompt).astype(np.uint64)
    positions = np.arange(tokens.size, dtype=np.uint64)
    states = np.cumsum(mix64(np.uint64(seed) ^ (tokens * np.uint64(TOKEN_MIX))
                             ^ (positions * np.uint64(POSITION_MIX))), dtype=np.uint64)
    full = tokens.size // page_size
    return states[page_size - 1:full * page_size:page_size], int(states[-1]) if tokens.size else 0

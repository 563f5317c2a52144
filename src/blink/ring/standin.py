"""The stand-in model: a deterministic "sampler" that lets the ring and the scheduler run before any model exists.

Token at position ``p`` (``p >= prompt_len``) of a request = ``standin_token(token at p-1, p, seed, vocab)``. It is a
splitmix64 hash, so outputs depend on exactly the inputs a real sampler would see and nothing else (not on batch
composition, slot or timing). The GPU stand-in step (``blink_standin_step`` in ``blink/device/shim.cu``) computes the
same function; tests pin the two together.
"""
from __future__ import annotations

from blink.ring.hashing import MASK64, POSITION_MIX, TOKEN_MIX, mix64

STANDIN_VOCAB = 32000


def _hash(prev_token, position, seed):
    return mix64((seed ^ (prev_token * TOKEN_MIX) ^ (position * POSITION_MIX)) & MASK64)


def standin_token(prev_token, position, seed, vocab_size: int = STANDIN_VOCAB):
    """Next token after ``prev_token`` (at ``position - 1``) for a request seeded with ``seed``. Ints, or numpy
    uint64 arrays of one length (a token per element; the arithmetic wraps at 64 bits either way)."""
    return _hash(prev_token, position, seed) % vocab_size


def standin_logprob(prev_token, position, seed):
    """The logprob reported with that token: a multiple of 1/256 in (-16, 0], exact in float32 (arguments as for
    ``standin_token``)."""
    return ((_hash(prev_token, position, seed) >> 32) % 4096) / -256.0


def standin_continuation(prompt: list[int], seed: int, n: int, vocab_size: int = STANDIN_VOCAB) -> list[int]:
    """The first ``n`` tokens the stand-in model generates after ``prompt`` (no stop conditions)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(standin_token(tokens[-1], len(tokens), seed, vocab_size))
    return tokens[len(prompt):]


def standin_step(step, bucket_tokens: int, vocab_size: int = STANDIN_VOCAB) -> None:
    """The stand-in model step on the CPU, over numpy views of the step buffers (``step.py``'s contract).

    It records its query tokens in the token history (``step.history_tokens``), as a model's step does; every row
    that samples gets the stand-in token after its last query token, whatever else is in the batch.
    """
    fed = step.slot_mapping[:bucket_tokens] >= 0
    step.history_tokens[step.slot_mapping[:bucket_tokens][fed]] = step.token_ids[:bucket_tokens][fed]
    rows = min(bucket_tokens, step.logits_indices.shape[0])
    for r in range(rows):
        t = int(step.logits_indices[r])
        if t < 0:
            continue
        prev, position, seed = int(step.token_ids[t]), int(step.positions[t]) + 1, int(step.seed[r]) & MASK64
        step.sampled_ids[r] = standin_token(prev, position, seed, vocab_size)
        step.sampled_logprobs[r] = standin_logprob(prev, position, seed)

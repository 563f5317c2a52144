"""Gumbel-max token choice in Triton; reference: ``reference.gumbel_argmax``, noise: ``blink.models.hashing``.

Program ``(row, chunk)`` derives the row's key from its seed and length (``hashing.row_key``, in uint32: one kernel
instead of the ~40 elementwise launches of the torch version), scans ``CHUNK`` vocabulary entries and writes its
best (value, index); the host-free ``torch.max`` over the chunks of a row picks the token. The first chunk wins a
tie, as the lowest index does in the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..hashing import MIX

CHUNK = 4096
_MIX = tl.constexpr(MIX)


@triton.jit
def _hash32(x):
    x = ((x >> 16) ^ x) * _MIX  # uint32 arithmetic wraps: the same bits as the masked int64 reference
    x = ((x >> 16) ^ x) * _MIX
    return (x >> 16) ^ x


@triton.jit
def _row_key(seed, length):
    """``hashing.row_key`` of one row: int64 ``seed`` split in 32-bit halves, int ``length``."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _hash32(_hash32(_hash32(hi) ^ lo) ^ length.to(tl.uint32))


@triton.jit
def _gumbel_argmax_kernel(scaled_ptr, thr_ptr, seed_ptr, len_ptr, greedy_ptr, best_val_ptr, best_idx_ptr, vocab,
                          stride, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    thr = tl.load(thr_ptr + row)
    key = _row_key(tl.load(seed_ptr + row).to(tl.int64), tl.load(len_ptr + row))
    greedy = tl.load(greedy_ptr + row) != 0
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32) + chunk * CHUNK
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < vocab
        x = tl.load(scaled_ptr + row * stride + idx, mask=ok, other=float("-inf"))
        bits = _hash32(key ^ _hash32(idx.to(tl.uint32))) >> 8
        u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        noisy = tl.where(x >= thr, x - tl.log(-tl.log(u)), float("-inf"))
        val = tl.where(greedy, x, noisy)
        val = tl.where(ok, val, float("-inf"))
        m = tl.max(val, 0)
        if m > best_val:
            best_val = m
            best_idx = tl.argmax(val, 0) + start
    tl.store(best_val_ptr + row * n_chunks + chunk, best_val)
    tl.store(best_idx_ptr + row * n_chunks + chunk, best_idx)


def gumbel_argmax(scaled: torch.Tensor, threshold: torch.Tensor, seed: torch.Tensor, seq_lens: torch.Tensor,
                  greedy: torch.Tensor) -> torch.Tensor:
    """``scaled [S, V]`` float32 (unit stride in V) → int32 token ids ``[S]``."""
    rows, vocab = scaled.shape
    n_chunks = triton.cdiv(vocab, CHUNK)
    best_val = torch.empty((rows, n_chunks), dtype=torch.float32, device=scaled.device)
    best_idx = torch.empty((rows, n_chunks), dtype=torch.int32, device=scaled.device)
    _gumbel_argmax_kernel[(rows, n_chunks)](scaled, threshold, seed, seq_lens, greedy, best_val, best_idx, vocab,
                                            scaled.stride(0), n_chunks, CHUNK=CHUNK, BLOCK=1024)
    return best_idx.gather(1, best_val.argmax(dim=1, keepdim=True))[:, 0]

"""RoPE (NeoX / HF half-rotation, partial rotary dims) in place in Triton; reference: ``reference.rope``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, t, heads, cos, sin, half, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < half)
    p1 = x_ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, q_st, q_sh, k_st, k_sh, q_heads, k_heads, half,
                 BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    cos = tl.load(cs_ptr + pos * 2 * half + d, mask=d < half, other=0.0)
    sin = tl.load(cs_ptr + pos * 2 * half + half + d, mask=d < half, other=0.0)
    _rotate(q_ptr, q_st, q_sh, t, q_heads, cos, sin, half, BLOCK_QH, BLOCK_D)
    _rotate(k_ptr, k_st, k_sh, t, k_heads, cos, sin, half, BLOCK_KH, BLOCK_D)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """``q [T, H, D]``, ``k [T, KH, D]`` (unit stride in D) rotated in place; ``cos_sin [max_pos, rotary_dim]``."""
    half = cos_sin.shape[1] // 2
    _rope_kernel[(q.shape[0],)](q, k, positions, cos_sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                q.shape[1], k.shape[1], half, BLOCK_QH=triton.next_power_of_2(q.shape[1]),
                                BLOCK_KH=triton.next_power_of_2(k.shape[1]), BLOCK_D=triton.next_power_of_2(half))

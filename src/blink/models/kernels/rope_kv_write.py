"""Per-head q/k RMSNorm (Qwen3), RoPE and the KV write, fused into one Triton kernel;
reference: ``reference.rope_kv_write`` (composed of ``reference.rms_norm``, ``rope`` and ``kv_write``).

Fusing matters at small batches, where a decode step is a few hundred tiny launches: this replaces up to four per
layer. Program ``(t, c)`` takes token ``t``'s query heads ``c * B ..`` or, for the last ``c``, its K heads and the KV
write, where ``B`` (``BLOCK_KH``) is the KV head count rounded up to a power of two, at least ``MIN_BLOCK_HEADS``: one
program per token left one SM to do all of a decode token's heads in series (3.2 us per layer for Llama-3-8B at batch
1 on the H200, 2.6 us split), while blocks of 4 heads (Qwen3-30B-A3B's KV heads) made 9 programs per token and took
its 2048-token prefill's RoPE from 847 to 1154 us.
Roundings follow the reference (the normalised value and its product with the weight are rounded to the model dtype
before the rotation), so the result matches it to the last bit or nearly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..e4m3 import FP8, FP8_MAX
from .pdl import pdl_args, wait_for_previous
from .quantize import e4m3_code

MIN_BLOCK_HEADS = 8  # query heads per program at least (see the module docstring)
KV_MAX = tl.constexpr(FP8_MAX)  # an e4m3 pool saturates here


@triton.jit
def _normed(x_ptr, h, d, mask, w_ptr, rstd, NORM: tl.constexpr):
    x = tl.load(x_ptr + h + d, mask=mask, other=0.0)
    if NORM:
        w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        x = (w * (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _norm_rope_heads(x_ptr, stride_h, w_ptr, heads, dim, half, cos_ptr, eps, NORM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Normalise (optionally) and rotate ``heads`` rows of ``dim`` at ``x_ptr`` in place; returns them (float32)."""
    h = (tl.arange(0, BLOCK_H) * stride_h)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (tl.arange(0, BLOCK_H)[:, None] < heads) & (d < dim)
    rstd = tl.zeros([BLOCK_H, 1], tl.float32)
    if NORM:
        x = tl.load(x_ptr + h + d, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) / dim + eps)
    x = _normed(x_ptr, h, d, mask, w_ptr, rstd, NORM)
    # dim j < half pairs with j + half; dims >= 2 * half are not rotated
    first = d < half
    rotated = d < 2 * half
    partner = tl.where(first, d + half, d - half)
    y = _normed(x_ptr, h, partner, mask & rotated, w_ptr, rstd, NORM)
    j = tl.where(first, d, d - half)
    cos = tl.load(cos_ptr + j, mask=rotated, other=1.0)
    sin = tl.load(cos_ptr + half + j, mask=rotated, other=0.0)
    out = tl.where(first, x * cos - y * sin, x * cos + y * sin)
    out = tl.where(rotated, out, x)
    tl.store(x_ptr + h + d, out.to(x_ptr.dtype.element_ty), mask=mask)
    return out


@triton.jit
def _rope_kv_write_kernel(q_ptr, k_ptr, v_ptr, q_st, q_sh, k_st, k_sh, v_st, v_sh, pos_ptr, cs_ptr, cache_ptr,
                          slot_ptr, qw_ptr, kw_ptr, eps, q_heads, kv_heads, dim, half, v_offset, NORM: tl.constexpr,
                          FP8_KV: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """``FP8_KV``: ``cache_ptr`` is an e4m3 pool seen as bytes; K and V (rounded to the model dtype first, as the
    reference's cast from it) go in as e4m3 codes, saturating at ±``KV_MAX``."""
    t, c = tl.program_id(0), tl.program_id(1)
    cos_ptr = cs_ptr + tl.load(pos_ptr + t).to(tl.int64) * 2 * half  # a step buffer: read before the wait
    wait_for_previous(PDL)
    first_q = c * BLOCK_KH
    if first_q < q_heads:
        _norm_rope_heads(q_ptr + t * q_st + first_q * q_sh, q_sh, qw_ptr, tl.minimum(q_heads - first_q, BLOCK_KH),
                         dim, half, cos_ptr, eps, NORM, BLOCK_KH, BLOCK_D)
        return
    k = _norm_rope_heads(k_ptr + t * k_st, k_sh, kw_ptr, kv_heads, dim, half, cos_ptr, eps, NORM, BLOCK_KH, BLOCK_D)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # a padding row (slot -1) writes nothing
        h = tl.arange(0, BLOCK_KH)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < kv_heads) & (d < dim)
        dst = cache_ptr + slot * kv_heads * dim + h * dim + d
        v = tl.load(v_ptr + t * v_st + h * v_sh + d, mask=mask)
        if FP8_KV:
            k = k.to(k_ptr.dtype.element_ty).to(tl.float32)
            tl.store(dst, e4m3_code(tl.minimum(tl.maximum(k, -KV_MAX), KV_MAX)).to(tl.uint8), mask=mask)
            v = tl.minimum(tl.maximum(v.to(tl.float32), -KV_MAX), KV_MAX)
            tl.store(dst + v_offset, e4m3_code(v).to(tl.uint8), mask=mask)
        else:
            tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + v_offset, v.to(cache_ptr.dtype.element_ty), mask=mask)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  kv_layer: torch.Tensor, slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                  k_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """``q [T, H, D]``, ``k, v [T, KH, D]`` (unit stride in D; q and k are overwritten) → the rotated q."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    norm, fp8 = q_weight is not None, kv_layer.dtype == FP8
    block_kh = max(triton.next_power_of_2(kv_heads), MIN_BLOCK_HEADS)
    _rope_kv_write_kernel[(q.shape[0], triton.cdiv(heads, block_kh) + 1)](
        q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), positions, cos_sin,
        kv_layer.view(torch.uint8) if fp8 else kv_layer, slot_mapping, q_weight if norm else q,
        k_weight if norm else k, eps, heads, kv_heads, dim, cos_sin.shape[1] // 2, kv_layer[0].numel(), NORM=norm,
        FP8_KV=fp8, BLOCK_KH=block_kh,
        BLOCK_D=triton.next_power_of_2(dim), **pdl_args(q.device))
    return q

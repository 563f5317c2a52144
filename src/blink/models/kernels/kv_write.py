"""KV write into the paged pool in Triton; reference: ``reference.kv_write``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, k_st, k_sh, v_st, v_sh, heads, dim, v_offset,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # a padding row writes nothing
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < dim)
    dst = cache_ptr + slot * heads * dim + h * dim + d
    k = tl.load(k_ptr + t * k_st + h * k_sh + d, mask=mask)
    v = tl.load(v_ptr + t * v_st + h * v_sh + d, mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + v_offset, v.to(cache_ptr.dtype.element_ty), mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor):
    """``k, v [T, KH, D]`` (unit stride in D) → ``kv_layer [2, pages, page_size, KH, D]`` (contiguous)."""
    heads, dim = k.shape[1], k.shape[2]
    _kv_write_kernel[(k.shape[0],)](k, v, kv_layer, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                                    v.stride(1), heads, dim, kv_layer[0].numel(),
                                    BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim))

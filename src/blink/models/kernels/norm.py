"""Fused RMSNorm (+ residual add) in Triton; reference: ``reference.rms_norm``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous


@triton.jit
def _rms_norm_kernel(x_ptr, stride_xt, stride_xh, res_ptr, sum_ptr, out_ptr, w_ptr, heads, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)  # one row = one (token, head); residual, sum and out are contiguous
    t, h = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait
    wait_for_previous(PDL)
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)  # HF rounds the sum to the model dtype before normalising
        tl.store(sum_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    out = w * normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``x`` is ``[T, N]`` or ``[T, H, N]`` (any stride but unit stride in N); returns contiguous outputs."""
    x3 = x if x.dim() == 3 else x[:, None, :]
    t, heads, n = x3.shape
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else x
    _rms_norm_kernel[(t * heads,)](x3, x3.stride(0), x3.stride(1), residual if residual is not None else x, total,
                                   out, weight, heads, n, eps, HAS_RESIDUAL=residual is not None,
                                   BLOCK=triton.next_power_of_2(n), **pdl_args(x.device))
    return out.view(x.shape), total.view(x.shape) if residual is not None else x
